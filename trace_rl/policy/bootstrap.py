"""Bootstrap a tiny CPU policy for a synthetic family: tokenizer, model, SFT warm start, cache.

The RL stage (DESIGN.md §1) learns only from groups whose outcomes are mixed, so the starting
policy must succeed *sometimes*: a random model (success ~0) and a perfect imitator (~1) both give
groups with no contrast. The recipe, per family:

1. a byte-level BPE trained on the family's own text (system prompt, questions, expert turns,
   tool observations), deterministic for the same settings;
2. a seeded model from ``build_model(tokenizer, preset)``;
3. supervised fine-tuning on expert traces written in the turn format
   (``expert_episode``: prompt_ids | gen_ids | obs_ids | ...), with cross-entropy on the policy's
   tokens only (prompt and observation tokens carry label -100). A fraction ``noise`` of the traces
   is deliberately imperfect, built by one of ``CORRUPTIONS`` (a wrong final answer, an answer
   given too early, a wrong intermediate tool call), so the imitated behaviour fails part of the
   time in the ways RL can fix. ``THOUGHTS`` gives a family's expert thoughts (arith restates
   the step's sentence, chain the fact it follows; the others think nothing);
4. after every epoch the policy is measured by real rollouts (HF engine, ``run_episodes``,
   temperature 1) on held-out test items; SFT stops at the first epoch whose success lies in
   ``target_success``, else the epoch closest to that range is kept;
5. the result is written with ``save_policy`` into a temporary directory that is renamed onto
   ``out_dir`` (a kill never leaves a half-written policy), with ``bootstrap.json`` holding the
   settings, the input hash and the measured success rates (sampled and greedy, on a separate
   held-out report set). A later call with the same inputs returns at once.

This is project scaffolding, not part of the paper (which starts RL from Qwen3 checkpoints).
synth_arith at difficulty 1 meets the target in 2-5 epochs (seed 0: 32 % sampled, 55 % greedy);
at difficulty 2 it ended at 19 % after 8 epochs and synth_chain at 0 % after 12, so callers should
read ``bootstrap.json``'s ``target_met`` rather than assume a middle-range start (figures:
docs/results.md, "Tiny policy bootstrap").
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import transformers
from transformers import DynamicCache

from trace_rl.engines.hf import HFEngine
from trace_rl.envs.base import Environment, TaskItem
from trace_rl.envs.registry import make_env
from trace_rl.envs.synthetic.chain import expert_thoughts as chain_thoughts
from trace_rl.policy.tiny import PRESETS, build_model, build_tokenizer, save_policy
from trace_rl.progress import Progress, Silent
from trace_rl.rollout.format import render_action
from trace_rl.rollout.react import Start, expert_episode, run_episodes
from trace_rl.rollout.types import Action, Episode, SamplingSettings

log = logging.getLogger(__name__)

RECORD = "bootstrap.json"
"""Name of the record written next to the weights."""
RECIPE_VERSION = 4
"""Part of the input hash: bump when the recipe changes so cached policies are rebuilt."""
IGNORE_INDEX = -100
"""Label of a token that carries no loss (transformers' convention)."""


@dataclass(frozen=True)
class BootstrapConfig:
    """Everything that determines a bootstrapped policy (all of it enters the input hash)."""

    family: str
    """Task family name in the environment registry (e.g. ``synth_arith``)."""
    difficulty: int = 2
    """Family difficulty (1..5) of the SFT traces and the held-out measurement."""
    mix: tuple[int, ...] = ()
    """Item difficulties taken in turn (``SynthConfig.mix``); empty = all at ``difficulty``."""
    options: tuple[tuple[str, Any], ...] = ()
    """The family's generator options as (name, value) pairs (``TrainConfig.family_options``,
    e.g. synth_chain's hop distribution and hazard rates); empty = the family's defaults."""
    preset: str = "tiny"
    """Model shape, a key of ``trace_rl.policy.tiny.PRESETS``."""
    seed: int = 0
    """Seeds item order, corruption draws, model init and the measurement rollouts."""
    sft_examples: int = 1600
    """Training traces per epoch (train-split items; clean and noisy together)."""
    sft_epochs: int = 8
    """Most SFT epochs; training stops earlier once the measured success is in ``target_success``."""
    target_success: tuple[float, float] = (0.3, 0.7)
    """Sampled success range (temperature 1, held-out) at which SFT stops."""
    noise: float = 0.25
    """Fraction of SFT traces that are deliberately imperfect (one of ``CORRUPTIONS``)."""
    vocab_size: int = 1024
    """BPE vocabulary size, special and marker tokens included."""
    split_digits: bool = True
    """One token per digit (``build_tokenizer(split_digits=...)``), so numbers copy token by token."""
    split_names: bool = False
    """A space before a capitalised word is a token of its own (``build_tokenizer(split_names=
    ...)``), so a name is the same tokens in the question, a thought, a query and an observation."""
    tokenizer_items: int = 500
    """Train items whose expert conversations the tokenizer is trained on."""
    batch_size: int = 16
    """Traces per optimiser step."""
    learning_rate: float = 2e-3
    """Peak AdamW learning rate (linear warm-up, then cosine decay over all planned steps).
    2e-3 because on synth_arith d=1 at 6e-3 the loss stalls near 0.3 and the policy never copies
    numbers (2-12 % success); at 2e-3 it reached 0.09 and 42-46 % (measured 2026-11-29)."""
    warmup_steps: int = 30
    """Steps of linear learning-rate warm-up."""
    eval_items: int = 48
    """Held-out test items measured after each epoch to decide when to stop."""
    report_items: int = 96
    """Further held-out test items (disjoint from ``eval_items``) for the recorded success rates."""

    def __post_init__(self) -> None:
        lo, hi = self.target_success
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"BootstrapConfig.target_success={self.target_success}: need "
                             "0 <= low <= high <= 1")
        if self.preset not in PRESETS:
            raise ValueError(f"BootstrapConfig.preset={self.preset!r}: choose one of {sorted(PRESETS)}")
        if not 0.0 <= self.noise < 1.0:
            raise ValueError(f"BootstrapConfig.noise={self.noise}: need 0 <= noise < 1")
        for name in ("sft_examples", "sft_epochs", "batch_size", "eval_items", "report_items",
                     "tokenizer_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"BootstrapConfig.{name}={getattr(self, name)}: need >= 1")
        if self.learning_rate <= 0 or self.warmup_steps < 0:
            raise ValueError(f"BootstrapConfig: learning_rate={self.learning_rate} must be > 0 and "
                             f"warmup_steps={self.warmup_steps} >= 0")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_success"] = list(self.target_success)
        if self.mix:
            d["mix"] = list(self.mix)
        else:
            del d["mix"]  # keeps the input hash of policies made before the option existed
        if self.options:
            d["options"] = {k: v for k, v in self.options}
        else:
            del d["options"]  # likewise
        if not self.split_names:
            del d["split_names"]  # likewise
        return d


# ------------------------------------------------------------------------------------ corruptions
Corruption = Callable[[list[Action], list[Action], random.Random], "list[Action] | None"]
"""(expert actions of the item, expert actions of a donor item, rng) -> imperfect actions, or
None where the corruption would not change this item's trace."""


def _tools(actions: Sequence[Action]) -> list[Action]:
    return [a for a in actions if a.kind == "tool"]


def wrong_final(own: list[Action], donor: list[Action], rng: random.Random) -> list[Action] | None:
    """All the right calls, then another item's answer (a plausible value of the right type)."""
    if str(donor[-1].answer) == str(own[-1].answer):
        return None  # e.g. function calling, whose answer is always "done"
    return _tools(own) + [donor[-1]]


def stop_early(own: list[Action], donor: list[Action], rng: random.Random) -> list[Action] | None:
    """Only the first j < n calls, then another item's answer: the agent quits too soon."""
    calls = _tools(own)
    if not calls:
        return None
    return calls[:rng.randrange(len(calls))] + [donor[-1]]


def wrong_step(own: list[Action], donor: list[Action], rng: random.Random) -> list[Action] | None:
    """One call's arguments swapped for a donor's call to the same tool; the rest unchanged (the
    real environment decides whether the slip still ends in success)."""
    calls = _tools(own)
    slots = [(i, d) for i, a in enumerate(calls) for d in _tools(donor)
             if d.tool == a.tool and dict(d.arguments or {}) != dict(a.arguments or {})]
    if not slots:
        return None
    i, d = rng.choice(slots)
    return calls[:i] + [d] + calls[i + 1:] + [own[-1]]


CORRUPTIONS: dict[str, Corruption] = {"wrong_final": wrong_final, "stop_early": stop_early,
                                      "wrong_step": wrong_step}
"""The registry of imperfect-trace generators; one is drawn uniformly among those that apply."""


Thoughts = Callable[[TaskItem, Sequence[Action]], "list[str]"]
"""(item, action script) -> the thought written before each action."""


def arith_thoughts(item: TaskItem, actions: Sequence[Action]) -> list[str]:
    """Before the k-th calculator call, the sentence of the question that step k applies; before
    the answer, nothing. Restating the step turns "which numbers go into this call" from a search
    over the question into a copy of the words just written, which a tiny model learns far sooner."""
    steps = re.split(r"(?<=\.) ", item.question)[1:-1]  # drop the opening and the question
    thoughts, k = [], 0
    for action in actions:
        thoughts.append(steps[k] if action.kind == "tool" and k < len(steps) else "")
        k += action.kind == "tool"
    return thoughts


def no_thoughts(item: TaskItem, actions: Sequence[Action]) -> list[str]:
    return [""] * len(actions)


THOUGHTS: dict[str, Thoughts] = {"synth_arith": arith_thoughts, "synth_chain": chain_thoughts}
"""Family -> expert thoughts; families not listed think nothing (``<think></think>``)."""


class _Scripted:
    """``env`` with ``expert_actions`` replaced by a fixed script, so ``expert_episode`` renders
    (and really runs and grades) an imperfect trace exactly as it renders the gold one."""

    def __init__(self, env: Environment, actions: Sequence[Action]):
        self._env, self._actions = env, list(actions)

    def expert_actions(self, item: TaskItem) -> list[Action]:
        return list(self._actions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def trace_actions(env: Environment, items: Sequence[TaskItem], noise: float,
                  rng: random.Random) -> Iterator[tuple[TaskItem, list[Action], str]]:
    """Per item: (item, action script, kind), kind ``expert`` or the corruption's name."""
    for item in items:
        own = list(env.expert_actions(item))
        if rng.random() >= noise:
            yield item, own, "expert"
            continue
        donor = list(env.expert_actions(items[rng.randrange(len(items))]))
        options = [(name, fn(own, donor, rng)) for name, fn in CORRUPTIONS.items()]
        options = [(name, acts) for name, acts in options if acts is not None]
        if not options:
            yield item, own, "expert"
            continue
        name, acts = options[rng.randrange(len(options))]
        yield item, acts, name


# ------------------------------------------------------------------------------------ SFT batches
@dataclass(frozen=True)
class SFTExample:
    """One training sequence: the episode's tokens and which of them the policy wrote."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    """1 on ``gen_ids`` tokens (trained), 0 on prompt and observation tokens."""


def episode_example(ep: Episode) -> SFTExample:
    """prompt_ids | gen_ids | obs_ids | ... as one sequence, the loss mask set on gen_ids only."""
    ids, mask = list(ep.prompt_ids), [0] * len(ep.prompt_ids)
    for turn in ep.turns:
        ids += turn.gen_ids
        mask += [1] * len(turn.gen_ids)
        ids += turn.obs_ids
        mask += [0] * len(turn.obs_ids)
    return SFTExample(tuple(ids), tuple(mask))


def sft_batch(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``/``labels`` [B, T]; labels are the token ids on
    masked-in positions and ``IGNORE_INDEX`` elsewhere (prompt, observations, padding). The model
    shifts labels itself, so position t's label is the token the model must produce there."""
    if not examples:
        raise ValueError("sft_batch: no examples")
    T = max(len(e.token_ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)  # [B, T]
    attn = torch.zeros((len(examples), T), dtype=torch.long)  # [B, T]
    labels = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    for b, e in enumerate(examples):
        if len(e.token_ids) != len(e.loss_mask):
            raise ValueError(f"sft_batch: example {b} has {len(e.token_ids)} tokens but "
                             f"{len(e.loss_mask)} mask entries")
        n = len(e.token_ids)
        row = torch.tensor(e.token_ids, dtype=torch.long)
        ids[b, :n] = row
        attn[b, :n] = 1
        keep = torch.tensor(e.loss_mask, dtype=torch.bool)
        labels[b, :n] = torch.where(keep, row, torch.full_like(row, IGNORE_INDEX))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def shared_prefix_len(examples: Sequence[SFTExample]) -> int:
    """Leading tokens identical in every example and masked in all of them (the family's system
    prompt): ``sft_loss`` runs them once per batch instead of once per row."""
    first = examples[0].token_ids
    n = min(min(len(e.token_ids) for e in examples),
            min(e.loss_mask.index(1) if 1 in e.loss_mask else len(e.loss_mask) for e in examples))
    for e in examples[1:]:
        n = next((i for i in range(n) if e.token_ids[i] != first[i]), n)
    # The token at the split is a label of the suffix pass; keep it a masked (prompt) token.
    return max(0, n - 1)


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], shared: int = 0) -> torch.Tensor:
    """Mean cross-entropy over the labelled tokens of ``batch`` (from ``sft_batch``).

    With ``shared > 0`` the first ``shared`` tokens (identical and unlabelled in every row) go
    through the model once, their key/value cache is repeated over the batch, and only the rest
    of each row is computed; gradients still flow into the shared part. Equal to the plain loss
    up to float rounding, for about half the compute on the synthetic families, whose system
    prompt is half of every trace.
    """
    if shared <= 0:
        return model(**batch).loss
    ids, attn, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]  # [B, T]
    cache = DynamicCache()
    model(input_ids=ids[:1, :shared], use_cache=True, past_key_values=cache)
    cache.batch_repeat_interleave(ids.shape[0])
    T = ids.shape[1]
    pos = torch.arange(shared, T)[None].expand(ids.shape[0], -1)  # [B, T - shared]
    return model(input_ids=ids[:, shared:], attention_mask=attn, position_ids=pos,
                 past_key_values=cache, use_cache=True, labels=labels[:, shared:]).loss


# ------------------------------------------------------------------------------------ measurement
def measure_success(engine: Any, env: Environment, items: Sequence[TaskItem], *,
                    temperature: float, seed: int, max_turn_tokens: int,
                    max_context: int | None = None) -> float:
    """Mean reward of one real rollout per item (``run_episodes``) at ``temperature``."""
    if not items:
        raise ValueError("measure_success: no items")
    episodes = run_episodes(engine, env, [Start(item) for item in items],
                            sampling=SamplingSettings(max_tokens=max_turn_tokens,
                                                      temperature=temperature),
                            seed=seed, max_context=max_context)
    return sum(float(ep.reward or 0.0) for ep in episodes) / len(episodes)


def _distance(x: float, lo: float, hi: float) -> float:
    return max(lo - x, 0.0, x - hi)


# ------------------------------------------------------------------------------------ the recipe
def input_hash(config: BootstrapConfig, env: Environment, items: Sequence[TaskItem]) -> str:
    """sha256 over the recipe version, the config, the family's prompt, the version of its expert
    thoughts where they carry one (``expert_thoughts.version``) and the items used."""
    h = hashlib.sha256()
    head = {"recipe": RECIPE_VERSION, "config": config.to_json(), "system": env.system_prompt()}
    thoughts_version = getattr(THOUGHTS.get(config.family), "version", None)
    if thoughts_version is not None:  # a family whose expert thoughts changed since recipe 4
        head["thoughts"] = thoughts_version
    h.update(json.dumps(head, sort_keys=True).encode())
    for item in items:
        h.update(json.dumps([item.id, item.question, item.gold], sort_keys=True,
                            default=str).encode())
    return h.hexdigest()


def _tokenizer_texts(env: Environment, items: Sequence[TaskItem]) -> list[str]:
    """The family's text as the policy will see it: system prompt, question, each expert turn and
    each observation, plus the chat role names the template writes around them."""
    texts = ["system\n", "user\n", "assistant\n", "tool\n"]
    for item in items:
        texts += [env.system_prompt(), env.user_prompt(item)]
        state = env.reset(item)
        for action in env.expert_actions(item):
            texts.append(render_action(action))
            result = env.step(state, action)
            if result.observation:
                texts.append(result.observation)
    return texts


def read_record(out_dir: str | Path) -> dict[str, Any] | None:
    """The ``bootstrap.json`` of ``out_dir``, or None when there is none."""
    path = Path(out_dir) / RECORD
    if not path.is_file():
        return None
    return json.loads(path.read_text())


FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "synth_chain": {"sft_examples": 800, "sft_epochs": 12, "split_names": True}}
"""A family's own ``BootstrapConfig`` settings where the defaults do not suit it
(``bootstrap_policy`` uses them unless told otherwise). synth_chain's traces are 3-4x longer than
arith's: half the traces per epoch measures the policy twice as often, so SFT stops nearer the
first epoch in the target; its names are copied from question to thought to query, so they must
be the same tokens everywhere (``split_names``)."""


def bootstrap_policy(family: str, out_dir: str | Path, *, difficulty: int = 2, preset: str = "tiny",
                     seed: int = 0, sft_examples: int | None = None, sft_epochs: int | None = None,
                     target_success: tuple[float, float] = (0.3, 0.7), threads: int | None = None,
                     cache_dir: str | Path | None = None, show_progress: bool = False,
                     **settings: Any) -> Path:
    """Build (or reuse) the SFT-warm-started tiny policy of ``family`` in ``out_dir``; return it.

    ``settings`` are further ``BootstrapConfig`` fields (noise, vocab_size, batch_size, ...).
    Cached: when ``out_dir/bootstrap.json`` holds the same input hash, nothing is recomputed; with
    ``cache_dir``, a policy built once for the same inputs is copied from there (``run_bootstrap``).
    ``show_progress``: report each phase and SFT step (``trace_rl.progress``).
    """
    own = FAMILY_SETTINGS.get(family, {})
    sft_examples = sft_examples or own.get("sft_examples", BootstrapConfig.sft_examples)
    sft_epochs = sft_epochs or own.get("sft_epochs", BootstrapConfig.sft_epochs)
    settings = {k: v for k, v in own.items() if k not in ("sft_examples", "sft_epochs")} | settings
    try:
        config = BootstrapConfig(family=family, difficulty=difficulty, preset=preset, seed=seed,
                                 sft_examples=sft_examples, sft_epochs=sft_epochs,
                                 target_success=tuple(target_success), **settings)
    except TypeError as exc:
        fields = sorted(f.name for f in dataclasses.fields(BootstrapConfig))
        raise TypeError(f"bootstrap_policy: {exc}; known settings: {fields}") from None
    return run_bootstrap(config, out_dir, threads=threads, cache_dir=cache_dir,
                         show_progress=show_progress)


def auto_threads() -> int:
    """CPU cores not already busy (by the 1-minute load average), at least 1. On a shared 2-core
    machine a second torch thread that has to wait for a busy core costs far more than it gives
    (measured: 4x the CPU time per SFT step under load), so threads follow the idle cores."""
    cores = os.cpu_count() or 1
    return max(1, min(cores, round(cores - os.getloadavg()[0])))


def run_bootstrap(config: BootstrapConfig, out_dir: str | Path, threads: int | None = None,
                  cache_dir: str | Path | None = None, show_progress: bool = False) -> Path:
    """``bootstrap_policy`` for a ready ``BootstrapConfig``; ``threads`` (default
    ``auto_threads()``) sets torch's CPU threads during the run (restored afterwards).

    With ``cache_dir`` (``trace_rl.environ.cache_dir()`` from the flows) the policy is built once
    per machine: it lives in ``cache_dir/policies/<family>-<input hash>``, keyed by everything that
    determines it (``input_hash``: recipe version, config, system prompt, items), and each work
    dir gets its own copy, so a work dir stays whole when moved or when the cache is cleared. A
    file lock makes a second process wanting the same policy wait for the first instead of
    training it twice."""
    out = Path(out_dir)
    env = make_env(config.family, difficulty=config.difficulty, seed=config.seed,
                   n_train=config.sft_examples,
                   n_test=config.eval_items + config.report_items,
                   **({"mix": tuple(config.mix)} if config.mix else {}), **dict(config.options))
    # A family may keep its SFT traces apart from the prompts RL trains on (``sft_split``).
    train, test = env.load(getattr(env, "sft_split", "train")), env.load("test")
    digest = input_hash(config, env, train + test)
    if _holds(out, digest):
        return out
    if out.exists() and read_record(out) is None and any(out.iterdir()):
        raise FileExistsError(f"bootstrap_policy: {out} exists, is not empty and has no {RECORD}; "
                              "refusing to overwrite it (choose an empty or new directory)")
    if cache_dir is None:
        _build(config, env, train, test, digest, out, threads, show_progress)
        return out
    cached = Path(cache_dir) / "policies" / f"{config.family}-{digest[:16]}"
    return build_once(cached, out, lambda d: _holds(d, digest),
                      lambda d: _build(config, env, train, test, digest, d, threads, show_progress),
                      "bootstrap" if show_progress else None)


def build_once(cached: Path, out: Path, holds: Callable[[Path], bool],
               build: Callable[[Path], None], announce: str | None = None) -> Path:
    """Build a policy into the machine-wide cache directory ``cached`` unless it ``holds`` it
    already (under a file lock, so a second process waits for the first), then copy it onto
    ``out`` atomically (``_replace_dir``); ``announce``: a label to print a cache hit with."""
    from filelock import FileLock

    cached.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cached) + ".lock"):
        if holds(cached):
            if announce:
                print(f"{announce}: reusing the policy cached at {cached}", file=sys.stderr,
                      flush=True)
        else:
            build(cached)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as work:
        staged = Path(work) / "policy"
        shutil.copytree(cached, staged)
        _replace_dir(staged, out, Path(work))
    return out


def _holds(directory: Path, digest: str) -> bool:
    """Whether ``directory`` holds a finished policy built from inputs with hash ``digest``."""
    record = read_record(directory) if directory.is_dir() else None
    return record is not None and record.get("input_hash") == digest


def _build(config: BootstrapConfig, env: Environment, train: list[TaskItem], test: list[TaskItem],
           digest: str, out: Path, threads: int | None, show_progress: bool) -> None:
    """Train the policy and move it onto ``out`` atomically (``_replace_dir``)."""
    eval_items, report_items = test[:config.eval_items], test[config.eval_items:]
    previous_threads = torch.get_num_threads()
    threads = threads or auto_threads()
    torch.set_num_threads(threads)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as work:
            staged = Path(work) / "policy"
            record = _train(config, env, train, eval_items, report_items, staged, Path(work),
                            show_progress)
            record["input_hash"] = digest
            record["threads"] = threads
            (staged / RECORD).write_text(json.dumps(record, indent=2) + "\n")
            _replace_dir(staged, out, Path(work))
    finally:
        torch.set_num_threads(previous_threads)


def _replace_dir(staged: Path, out: Path, work: Path) -> None:
    """Move ``staged`` onto ``out``; an old ``out`` is moved aside first (rename is atomic on one
    file system, so ``out`` is at all times either the old policy, absent, or the new one)."""
    if out.exists():
        out.rename(work / "old")
    staged.rename(out)


def _train(config: BootstrapConfig, env: Environment, train: list[TaskItem],
           eval_items: list[TaskItem], report_items: list[TaskItem], staged: Path,
           work: Path, show_progress: bool = False) -> dict[str, Any]:
    total_steps = math.ceil(len(train) / config.batch_size) * config.sft_epochs  # at most
    label = f"bootstrap {config.family} d{config.difficulty}"
    with (Progress(label, total_steps) if show_progress else Silent()) as progress:
        return _train_steps(config, env, train, eval_items, report_items, staged, work,
                            progress)


def _train_steps(config: BootstrapConfig, env: Environment, train: list[TaskItem],
                 eval_items: list[TaskItem], report_items: list[TaskItem], staged: Path,
                 work: Path, progress: Progress | Silent) -> dict[str, Any]:
    t_start = time.perf_counter()
    progress.note(f"training a tokenizer and writing {len(train)} SFT traces")
    rng = random.Random(f"bootstrap:{config.family}:{config.seed}")
    tokenizer = build_tokenizer(_tokenizer_texts(env, train[:config.tokenizer_items]),
                                vocab_size=config.vocab_size, split_digits=config.split_digits,
                                split_names=config.split_names)
    model = build_model(tokenizer, config.preset, seed=config.seed)
    n_params = sum(p.numel() for p in model.parameters())

    examples, kinds, rewards = [], {}, {}
    for item, actions, kind in trace_actions(env, train, config.noise, rng):
        ep = expert_episode(_Scripted(env, actions), item, tokenizer,
                            thoughts=THOUGHTS.get(config.family, no_thoughts)(item, actions))
        examples.append(episode_example(ep))
        kinds[kind] = kinds.get(kind, 0) + 1
        rewards[kind] = rewards.get(kind, 0.0) + float(ep.reward or 0.0)
    trace_success = {k: rewards[k] / kinds[k] for k in kinds}
    longest_turn = max(len(t.gen_ids) for item in train[:50]
                       for t in expert_episode(env, item, tokenizer).turns)
    # Room for a turn somewhat longer than any expert turn, without letting junk run on.
    max_turn_tokens = 2 * longest_turn + 8
    max_context = PRESETS[config.preset].max_positions

    # One engine for all measurements; each epoch's weights go in through load_weights.
    probe = work / "probe"
    save_policy(model, tokenizer, probe)
    engine = HFEngine(probe, device="cpu", seed=config.seed)

    def measure(items: list[TaskItem], temperature: float, salt: int) -> float:
        save_policy(model, tokenizer, probe)
        engine.load_weights(probe)
        return measure_success(engine, env, items, temperature=temperature,
                               seed=config.seed * 1000 + salt, max_turn_tokens=max_turn_tokens,
                               max_context=max_context)

    progress.note(f"measuring the untrained policy on {len(eval_items)} held-out items")
    success_init = measure(eval_items, 1.0, 0)
    progress.note(f"SFT: up to {config.sft_epochs} epochs, stopping once held-out success is in "
                  f"[{config.target_success[0]}, {config.target_success[1]}]")
    steps_per_epoch = math.ceil(len(examples) / config.batch_size)
    total_steps = steps_per_epoch * config.sft_epochs
    opt = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, config.warmup_steps))
                                              * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    gen = torch.Generator().manual_seed(config.seed)
    lo, hi = config.target_success
    history: list[dict[str, float]] = []
    best: tuple[float, int, dict[str, torch.Tensor]] | None = None
    t_sft = time.perf_counter()
    for epoch in range(1, config.sft_epochs + 1):
        model.train()
        order = torch.randperm(len(examples), generator=gen).tolist()
        losses = []
        for s in range(steps_per_epoch):
            chunk = [examples[i] for i in order[s * config.batch_size:(s + 1) * config.batch_size]]
            batch = sft_batch(chunk, tokenizer.pad_token_id)
            loss = sft_loss(model, batch, shared_prefix_len(chunk))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            progress.advance(epoch=f"{epoch}/{config.sft_epochs}", loss=losses[-1])
        model.eval()
        progress.note(f"epoch {epoch}: measuring held-out success on {len(eval_items)} items")
        success = measure(eval_items, 1.0, epoch)
        progress.advance(0, success=success)
        history.append({"epoch": epoch, "loss": sum(losses) / len(losses), "eval_success": success,
                        "seconds": time.perf_counter() - t_sft})
        log.info("bootstrap %s epoch %d: loss %.4f, held-out success %.3f (%.0fs)", config.family,
                 epoch, history[-1]["loss"], success, history[-1]["seconds"])
        gap = _distance(success, lo, hi)
        if best is None or gap <= best[0]:  # on a tie the later, better-fit epoch wins
            best = (gap, epoch, copy.deepcopy(model.state_dict()))
        if gap == 0.0:
            break
    sft_seconds = time.perf_counter() - t_sft
    assert best is not None
    model.load_state_dict(best[2])
    model.eval()
    progress.note(f"kept epoch {best[1]}; measuring it on {len(report_items)} report items "
                  "(sampled and greedy)")
    success_sampled = measure(report_items, 1.0, 10_000)
    success_greedy = measure(report_items, 0.0, 20_000)
    engine.close()
    save_policy(model, tokenizer, staged)
    return {
        "config": config.to_json(), "recipe_version": RECIPE_VERSION,
        "params": n_params, "vocab_size": len(tokenizer),
        "sft_traces": kinds, "sft_trace_success": trace_success,
        "max_turn_tokens": max_turn_tokens,
        "epochs_run": len(history), "epoch_kept": best[1], "target_met": best[0] == 0.0,
        "history": history,
        "success_init": success_init,
        "success_sampled": success_sampled, "success_greedy": success_greedy,
        "report_items": len(report_items),
        "sft_seconds": sft_seconds, "total_seconds": time.perf_counter() - t_start,
        "torch": torch.__version__, "python": sys.version.split()[0],
    }


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m trace_rl.policy.bootstrap --family synth_arith --out DIR``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", required=True, help="task family, e.g. synth_arith")
    p.add_argument("--out", required=True, help="output policy directory")
    p.add_argument("--difficulty", type=int, default=2)
    p.add_argument("--mix", type=lambda t: tuple(int(x) for x in t.split(",")), default=(),
                   help="item difficulties taken in turn, e.g. 1,2,3 (with --difficulty 3)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-examples", type=int, default=None,
                   help=f"default {BootstrapConfig.sft_examples}, or the family's (FAMILY_SETTINGS)")
    p.add_argument("--sft-epochs", type=int, default=None,
                   help=f"default {BootstrapConfig.sft_epochs}, or the family's (FAMILY_SETTINGS)")
    p.add_argument("--target", type=float, nargs=2, default=(0.3, 0.7), metavar=("LOW", "HIGH"))
    p.add_argument("--noise", type=float, default=BootstrapConfig.noise)
    p.add_argument("--lr", type=float, default=BootstrapConfig.learning_rate)
    p.add_argument("--merged-digits", action="store_true",
                   help="BPE may merge digits (the recipe before version 4)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    out = bootstrap_policy(args.family, args.out, difficulty=args.difficulty, preset=args.preset,
                           seed=args.seed, sft_examples=args.sft_examples,
                           sft_epochs=args.sft_epochs, target_success=tuple(args.target),
                           noise=args.noise, learning_rate=args.lr,
                           split_digits=not args.merged_digits, mix=args.mix)
    rec = read_record(out) or {}
    print(f"{out}: {args.family} d={args.difficulty} preset={args.preset} "
          f"params={rec.get('params')} epochs={rec.get('epochs_run')} (kept {rec.get('epoch_kept')}) "
          f"sft_s={rec.get('sft_seconds', 0):.1f} success sampled={rec.get('success_sampled', 0):.3f} "
          f"greedy={rec.get('success_greedy', 0):.3f} init={rec.get('success_init', 0):.3f} "
          f"(this call {time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
