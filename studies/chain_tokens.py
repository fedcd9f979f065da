"""Where does a synth_chain policy go wrong? Teacher-forced loss per kind of policy token.

Sampled success of the tiny policy stays at 0 long after it writes the turn format, so it says
nothing about what is learnt. This reads the policy's next-token distribution along held-out
expert traces (the bootstrap's own rendering: ``expert_episode`` with the family's thoughts) and
groups the policy's tokens by what they are:

* ``name@think-start``: the start person, restated from the question ("start Kalo");
* ``name@think-hop``: the next person, read off the observation after the hop's relation;
* ``name@query``: a name in a search query (a copy of the thought just written, or of the
  observation's "Did you mean ...?");
* ``name@answer``: the answer;
* ``relation@think``: the relation word of a hop's thought (the next one of the question's path);
* ``other``: format, JSON, markers.

For each kind: the number of tokens, the mean negative log-likelihood (nats) and the share where
the most likely token is the expert's. A policy that copies names has name accuracy near 1 (0.5
at a homonym); one that does not sits near chance over the names it has seen. Each name kind
is also given for its first token alone (``name@query/first``): the model may continue a copy
(the second syllable of a name whose first it wrote, an induction copy) long before it can
start one.

    python -m studies.chain_tokens --policy DIR [--items 24]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any, Sequence

from trace_rl.envs.synth_chain.env import RELATIONS

KINDS = ("name@think-start", "name@think-hop", "name@query", "name@answer", "relation@think",
         "other")
FIRST_KINDS = tuple(f"{k}/first" for k in KINDS if k.startswith("name@"))
"""A name kind's first tokens alone (``score``): the token that starts each copy."""


def token_kinds(pieces: Sequence[str], mask: Sequence[int], names: set[str]) -> list[str | None]:
    """Per token (decoded ``pieces``): its kind, or None where ``mask`` is 0 (prompt and
    observation tokens). A name token is any piece that is, or is part of, a name of ``names``
    standing in a name position (after "start", a relation, a query's quote or ``<answer>``)."""
    kinds: list[str | None] = []
    where = "other"
    for i, (piece, m) in enumerate(zip(pieces, mask)):
        word = piece.strip()
        if not m:
            kinds.append(None)
            where = "other"
            continue
        if word in RELATIONS and where == "other":
            kinds.append("relation@think")
            where = "name@think-hop"
            continue
        if word == "start" or (word == "art" and i and pieces[i - 1].strip() == "st"):
            kinds.append("other")
            where = "name@think-start"
            continue
        if word in ("<answer>",):
            kinds.append("other")
            where = "name@answer"
            continue
        if word.endswith('"') and i >= 2 and "query" in "".join(pieces[max(0, i - 3):i]):
            kinds.append("other")
            where = "name@query"
            continue
        if where != "other" and word and (word in names or any(word in n for n in names)):
            kinds.append(where)
            continue
        if where != "other" and word in ("", "-"):  # the space or hyphen inside a name slot
            kinds.append("other")
            continue
        where = "other"
        kinds.append("other")
    return kinds


def expert_tokens(env: Any, items: Sequence[Any], tokenizer: Any, thoughts: Any = None
                  ) -> list[tuple[list[int], list[str | None]]]:
    """Per item: the token ids of its expert trace as the bootstrap renders it (``thoughts``: a
    thought function; None: the family's registered ones) and each token's kind (None: not
    the policy's). A relation that does not open its thought (one listed after it, as a
    rest-of-path thought writes) is ``relation@rest``."""
    from trace_rl.policy.bootstrap import episode_example, family_thoughts
    from trace_rl.rollout.react import expert_episode

    think = thoughts or family_thoughts("synth_chain")
    out = []
    for item in items:
        ex = episode_example(expert_episode(env, item, tokenizer,
                                            thoughts=think(item, env.expert_actions(item))))
        pieces = [tokenizer.decode([t]) for t in ex.token_ids]
        names = {r["name"] for r in item.meta["records"]} | set(item.meta["surface"])
        kinds = [("relation@rest" if k == "relation@think" and pieces[t - 1].strip() != "<think>"
                  else k) for t, k in enumerate(token_kinds(pieces, ex.loss_mask, names))]
        out.append((list(ex.token_ids), kinds))
    return out


def score(model: Any, traces: Sequence[tuple[list[int], list[str | None]]]
          ) -> dict[str, dict[str, float]]:
    """Per kind of ``traces`` (``expert_tokens``): tokens, mean nll and the share where the
    model's most likely next token is the expert's, teacher-forced (the model is put in eval
    mode for it and left as it was); also per name kind, its first token of each name alone
    (``name@query/first``): the one that starts a copy, where the rest continue one."""
    import torch

    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for ids, kinds in traces:
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)  # [T-1, V]
            best = logp.argmax(-1)
            for t, kind in enumerate(kinds):
                if kind is None or t == 0:
                    continue
                nll, right = -float(logp[t - 1, ids[t]]), int(int(best[t - 1]) == ids[t])
                # a name's first token apart: it starts a copy, the rest continue one (the
                # syllable after a hyphen, whose previous token is "other", continues it)
                opens = kind.startswith("name@") and kinds[t - 1] != kind and not (
                    t >= 2 and kinds[t - 1] == "other" and kinds[t - 2] == kind)
                for key in (kind, f"{kind}/first") if opens else (kind,):
                    s = sums[key]
                    s[0] += 1
                    s[1] += nll
                    s[2] += right
    model.train(was_training)
    return {k: {"tokens": s[0], "nll": s[1] / s[0], "accuracy": s[2] / s[0]}
            for k, s in sums.items() if s[0]}


def measure(policy: str, items: int = 24, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per kind: tokens, mean nll and argmax accuracy over ``items`` held-out expert traces."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace_rl.envs.registry import make_env
    from trace_rl.policy.bootstrap import read_record

    record = read_record(policy) or {}
    options = (record.get("config") or {}).get("options") or {}
    env = make_env("synth_chain", difficulty=1, seed=seed, **options)
    tok = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy)
    out = score(model, expert_tokens(env, env.load("test", limit=items), tok))
    return {k: out[k] for k in KINDS + FIRST_KINDS if k in out}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True, help="a bootstrapped synth_chain policy directory")
    ap.add_argument("--items", type=int, default=24, help="held-out test items")
    args = ap.parse_args(argv)
    out = measure(args.policy, args.items)
    print(f"{'kind':18s} {'tokens':>7s} {'nll':>7s} {'argmax = expert':>16s}")
    for kind, row in out.items():
        print(f"{kind:18s} {row['tokens']:7d} {row['nll']:7.3f} {row['accuracy']:16.2f}")
    return out


if __name__ == "__main__":
    main()
