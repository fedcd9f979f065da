"""How soon does SFT teach the tiny policy synth_chain's copies? Accuracy per token kind along SFT.

The bootstrap measures sampled success after each epoch, which stays at 0 until names *and*
relations are right nearly every time, so it says nothing about what is being learnt. This trains
the bootstrap's own model on the bootstrap's own traces (synth_chain's registered settings: the
``split_names`` tokenizer, 800 traces a quarter of them imperfect, batch 16, AdamW 2e-3 with
warm-up and a cosine over the 600 steps of 12 epochs) and every ``--every`` steps reads the
policy's teacher-forced argmax along held-out expert traces, by kind of token
(``studies.chain_tokens``), with the relation a thought starts with (``relation@think``) apart from
the relations it lists after it (``relation@rest``).

Variants, one option each:

* ``--copy-steps K``: before SFT, K steps of a dense copy task (random sequences of the tokens
  the policy writes, each written twice, the loss on the second copy), which forms the attention
  circuit that copies an earlier token (an induction head) from a signal on every token.
  ``--copy-gap G`` puts 0..G random tokens between the copies: with the copies always 32 apart a
  head at that fixed offset does the task without any induction.
* ``--thoughts rest``: each thought also carries the rest of the relation path ("friend Jedo
  follow rival > parent"), so that the next hop's relation is the first of the previous thought's
  list instead of the k-th of the question's path.
* ``--thoughts numbered``: the question numbers its path ("follow 1 owner, 2 mentor") and each
  hop's thought starts with its number ("2 mentor Dova"): the number is the last one plus one,
  and the relation the word after that number in the question (an induction copy, as a name is),
  where the family's own thoughts need the k-th relation of an unnumbered list.
* ``--thoughts numbered-joined``: the same with no space between number and relation ("follow
  1owner, 2mentor", "2mentor Dova"). With ``split_names`` the space is a token of its own, so in
  ``numbered`` the relation follows the two tokens "2" " ", which recur in every thought; joined,
  it is the token right after the digit, the one-token copy that names are learnt as.
* ``--chain-facts 1`` / ``--chain-syllables 1``: the family's options of those names (one fact
  per record; one-syllable names, a single token each).
* ``--sft-examples N --epochs E``: more (fresh) traces, the schedule planned over E epochs of
  them (the bootstrap's 800 traces are seen 12 times each).

    python -m studies.chain_sft --steps 300 [--copy-steps 600] [--thoughts rest] [--out FILE]
    python -m studies.chain_sft --steps 600 --sft-examples 9600 --epochs 1
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from studies.chain_tokens import FIRST_KINDS, expert_tokens, score
from trace_rl.envs.base import TaskItem
from trace_rl.rollout.types import Action

KINDS = ("name@think-start", "name@think-hop", "name@query", "name@answer", "relation@think",
         "relation@rest", "other") + FIRST_KINDS


def rest_of_path_thoughts(item: TaskItem, actions: Sequence[Action]) -> list[str]:
    """The family's expert thoughts (``chain.expert_thoughts``), each followed by the relations
    still to follow: "start Kalo follow owner > mentor", "owner Miru follow mentor", "mentor
    Dova"; nothing before a retry under the listed name, as there."""
    from trace_rl.envs.synth_chain.env import expert_thoughts

    path = item.meta["path"]
    thoughts, hop = [], 0
    for thought in expert_thoughts(item, actions):
        if not thought:  # a retry: no hop taken
            thoughts.append("")
            continue
        rest = path[hop:]
        thoughts.append(thought + (f" follow {' > '.join(rest)}" if rest else ""))
        hop += 1
    return thoughts


def numbered_question(item: TaskItem, joined: bool = False) -> TaskItem:
    """``item`` with its relation path numbered: "follow 1 owner, 2 mentor, 3 friend." for
    "follow owner > mentor > friend.", so that a hop's relation is the word after its number;
    ``joined``: "follow 1owner, 2mentor, 3friend." (the relation's token right after the digit's,
    with no space token between them)."""
    import dataclasses

    path = item.meta["path"]
    listed = " > ".join(path)
    if f"follow {listed}." not in item.question:
        raise ValueError(f"numbered_question: item {item.id} does not list its path as "
                         f"'follow {listed}.'")
    sep = "" if joined else " "
    numbered = ", ".join(f"{k}{sep}{r}" for k, r in enumerate(path, 1))
    return dataclasses.replace(item, question=item.question.replace(f"follow {listed}.",
                                                                    f"follow {numbered}."))


def numbered_thoughts(item: TaskItem, actions: Sequence[Action], joined: bool = False
                      ) -> list[str]:
    """The family's expert thoughts with each hop's number first: "start Kalo", "1 owner Miru",
    "2 mentor Dova" (with ``numbered_question``: the number is the previous thought's plus one,
    and the relation the word after that number in the question); ``joined``: "1owner Miru"."""
    from trace_rl.envs.synth_chain.env import expert_thoughts

    thoughts, hop = [], 0
    for thought in expert_thoughts(item, actions):
        if not thought or thought.startswith("start "):
            thoughts.append(thought)
        else:
            hop += 1
            thoughts.append(f"{hop}{'' if joined else ' '}{thought}")
    return thoughts


THOUGHT_VARIANTS = {"expert": None, "rest": rest_of_path_thoughts, "numbered": numbered_thoughts,
                    "numbered-joined": functools.partial(numbered_thoughts, joined=True)}
"""``--thoughts``; ``numbered`` and ``numbered-joined`` also number the questions' paths
(``numbered_question``)."""


def copy_row(rng: random.Random, pool: Sequence[int], length: int, gap: int
             ) -> tuple[list[int], list[int]]:
    """One row of the copy warm-up and its labels: ``length`` random ``pool`` tokens, 0..``gap``
    random tokens, the same ``length`` tokens again, the rest of the ``gap`` tokens; labels only
    on the second copy after its first token (the rest ``IGNORE_INDEX``)."""
    from trace_rl.policy.sft import IGNORE_INDEX

    x = [rng.choice(pool) for _ in range(length)]
    g = rng.randint(0, gap)
    filler = [rng.choice(pool) for _ in range(gap)]
    row = x + filler[:g] + x + filler[g:]
    labels = ([IGNORE_INDEX] * (length + g + 1) + row[length + g + 1:2 * length + g]
              + [IGNORE_INDEX] * (gap - g))
    return row, labels


def copy_warmup(model: torch.nn.Module, pool: Sequence[int], steps: int, length: int = 32,
                batch: int = 32, lr: float = 2e-3, seed: int = 1, gap: int = 0) -> list[float]:
    """``steps`` AdamW steps on random sequences of ``pool`` tokens written twice, the loss on
    the second copy; the losses. ``gap`` > 0: each row puts a random number (0..``gap``) of
    random tokens between the two copies (and the rest after the second), so the distance to
    the token to copy differs from row to row and a head at a fixed offset cannot do it: only
    one that finds the current token earlier and copies its successor (an induction head)."""
    from trace_rl.policy.sft import warmup_cosine

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = warmup_cosine(opt, min(30, steps), steps)
    model.train()
    losses = []
    for _ in range(steps):
        rows, labels = zip(*(copy_row(rng, pool, length, gap) for _ in range(batch)))
        ids = torch.tensor(rows)  # [B, 2L + gap]
        loss = model(input_ids=ids, labels=torch.tensor(labels)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def run(steps: int, every: int = 50, copy_steps: int = 0, thoughts: str = "expert",
        items: int = 24, sft_examples: int | None = None, preset: str = "tiny", seed: int = 0,
        save: str | None = None, out: str | None = None, epochs: int | None = None,
        copy_gap: int = 0, chain_facts: int = 2, chain_syllables: int = 2) -> list[dict[str, Any]]:
    """Train and measure as the module says; one row per measurement (also appended to ``out``
    as JSON lines)."""
    from trace_rl.envs.registry import make_env
    from trace_rl.policy.bootstrap.config import family_config
    from trace_rl.policy.bootstrap.data import tokenizer_texts, write_examples
    from trace_rl.policy.sft import sft_step, warmup_cosine
    from trace_rl.policy.tiny import build_model, build_tokenizer, save_policy

    if thoughts not in THOUGHT_VARIANTS:
        raise ValueError(f"studies.chain_sft: thoughts={thoughts!r}; choose one of "
                         f"{sorted(THOUGHT_VARIANTS)}")
    think = THOUGHT_VARIANTS[thoughts]
    config = family_config("synth_chain", difficulty=1, preset=preset, seed=seed,
                           sft_examples=sft_examples, sft_epochs=epochs, target_success=(0.3, 0.7))
    env = make_env("synth_chain", difficulty=1, seed=seed, n_train=config.sft_examples,
                   n_test=items, chain_facts=chain_facts,
                   chain_syllables=chain_syllables)
    train = env.load(getattr(env, "sft_split", "train"))
    test = env.load("test")
    if thoughts.startswith("numbered"):
        joined = thoughts == "numbered-joined"
        train = [numbered_question(x, joined) for x in train]
        test = [numbered_question(x, joined) for x in test]
    tok = build_tokenizer(tokenizer_texts(env, train[:config.tokenizer_items]),
                          vocab_size=config.vocab_size, split_digits=config.split_digits,
                          split_names=config.split_names)
    model = build_model(tok, preset, seed=seed)
    examples, _, _ = write_examples(config, env, train, tok,
                                    random.Random(f"bootstrap:synth_chain:{seed}"), thoughts=think)
    held = expert_tokens(env, test, tok, think)
    planned = -(-len(examples) // config.batch_size) * config.sft_epochs
    label = {"thoughts": thoughts, "copy_steps": copy_steps, "copy_gap": copy_gap, "seed": seed,
             "preset": preset, "chain_facts": chain_facts,
             "chain_syllables": chain_syllables,
             "sft_examples": config.sft_examples, "planned_steps": planned}
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def record(step: int, loss: float | None) -> None:
        kinds = score(model, held)
        row = label | {"sft_step": step, "loss": loss, "seconds": round(time.perf_counter() - t0),
                       "accuracy": {k: round(kinds[k]["accuracy"], 3) for k in KINDS if k in kinds}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")

    if copy_steps:
        pool = sorted({t for e in examples for t, m in zip(e.token_ids, e.loss_mask) if m})
        losses = copy_warmup(model, pool, copy_steps, seed=seed + 1, gap=copy_gap)
        print(f"copy warm-up: {copy_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
              flush=True)
    record(0, None)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    sched = warmup_cosine(opt, config.warmup_steps, planned)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    model.train()
    recent: list[float] = []
    for step in range(1, steps + 1):
        chunk = [examples[order[((step - 1) * config.batch_size + j) % len(order)]]
                 for j in range(config.batch_size)]
        recent.append(sft_step(model, opt, sched, chunk, tok.pad_token_id, params))
        if step % every == 0 or step == steps:
            record(step, round(sum(recent) / len(recent), 4))
            recent = []
    if save:
        save_policy(model, tok, Path(save))
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="SFT steps of 16 traces")
    ap.add_argument("--every", type=int, default=50, help="measure every this many steps")
    ap.add_argument("--copy-steps", type=int, default=0, help="copy warm-up steps before SFT")
    ap.add_argument("--copy-gap", type=int, default=0,
                    help="random tokens (0..this many) between the warm-up's two copies")
    ap.add_argument("--thoughts", default="expert", choices=sorted(THOUGHT_VARIANTS))
    ap.add_argument("--items", type=int, default=24, help="held-out expert traces measured")
    ap.add_argument("--sft-examples", type=int, default=None,
                    help="traces (default: synth_chain's bootstrap setting, 800)")
    ap.add_argument("--epochs", type=int, default=None,
                    help="epochs the learning-rate schedule is planned over (default: synth_chain's "
                         "bootstrap setting, 12); with --steps past them the rate stays at 0")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--chain-facts", type=int, default=2, choices=(1, 2),
                    help="facts per record (the family's chain_facts)")
    ap.add_argument("--chain-syllables", type=int, default=2, choices=(1, 2),
                    help="syllables per name (the family's chain_syllables)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--save", default=None, help="save the final policy to this directory")
    ap.add_argument("--out", default=None, help="append each measurement to this JSON-lines file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    return run(args.steps, args.every, args.copy_steps, args.thoughts, args.items,
               args.sft_examples, args.preset, args.seed, args.save, args.out, args.epochs,
               args.copy_gap, args.chain_facts, args.chain_syllables)


if __name__ == "__main__":
    main()
