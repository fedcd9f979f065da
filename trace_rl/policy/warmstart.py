"""Warm-start a real language model for a real task family: SFT on ReAct traces of the training
data, then a measurement of sampled success on the family's held-out split.

The RL stage needs a policy that succeeds *sometimes* (DESIGN.md §1). SmolLM2-135M-Instruct as
converted writes prose and never uses the turn format (issue 25: 0.000 everywhere), so RL has
nothing to learn from. The recipe, for ``hotpotqa``:

1. **Traces from training items only, never an evaluation item.** By default the 100 HotpotQA
   ``train`` questions and ``dev_rest``, the 400 dev items after the fixed held-out block
   ``dev_heldout`` (the first 100 dev items in file order, ``trace_rl.envs.hotpotqa.BLOCKS``),
   which is what the policy is measured on; ``load_split_items`` refuses any split whose items
   (by id or question) meet the measured ones. Per item, a *gold* trace: ``search`` for each
   gold supporting entity (the one the question names first, so the first hop comes first),
   each followed by the observation that the project's BM25 tool really returns for it, then
   ``<answer>`` with the gold answer. For a share ``recovery`` of the items also a *recovery*
   trace: first a search for one of the item's distractor paragraphs, then the gold trace. With
   ``bridge_thoughts`` (recipe 3) the queries are entity names (titles without their
   disambiguation) and the thoughts teach the bridge step: before searching an entity the
   question does not name, the thought quotes the span of an earlier observation that names it
   (``The result says "... starring then 17-year-old Shirley Temple".``); before the answer,
   the span that holds the answer. Traces are written in the turn format by ``expert_episode``
   (tools really run, the answer is really graded) with the base model's own chat template.
2. **SFT** of any Hugging Face causal-LM directory (``base``: a directory or a named policy,
   default ``smollm2``): cross-entropy on the policy's tokens only (``bootstrap.sft_loss``),
   AdamW with linear warm-up and cosine decay, traces longer than ``max_tokens`` left out and
   counted. ``trainable_layers`` > 0 trains only the top layers (and the final norm), which
   saves most of the backward pass on a CPU.
3. **Measurement**: ``eval_items`` items of ``eval_split`` (``dev_heldout``), ``eval_samples``
   sampled rollouts each at ``eval_temperature`` (and at 1.0 beside it when that differs)
   through the real ReAct loop and engine, before SFT (the base model) and after; success
   overall and per question type (bridge, comparison).
4. **Cache**: the result is keyed by the hash of everything that determines it (recipe version,
   config, the base model's files, system prompt, training items with their supporting titles
   and paragraphs, the measured items' ids) and built once per machine
   under ``cache_dir()/policies``; each work dir gets a copy with ``warmstart.json`` (config,
   input hash, trace counts, loss history, success rates, wall times). An MLflow run
   (experiment ``warmstart``) in the work dir holds the same figures.

The environment settings used (``env_args``: BM25 ``top_k`` and ``max_chars``) are part of the
recipe; train and evaluate the warm-started policy with the same ones (``extra=``; the CLI prints
the command).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.envs.registry import make_env
from trace_rl.rollout.types import Action

RECORD = "warmstart.json"
"""Name of the record written next to the weights."""
RECIPE_VERSION = 3
"""Part of the input hash: bump when the recipe changes so cached policies are rebuilt."""


@dataclass(frozen=True)
class WarmstartConfig:
    """Everything that determines a warm-started policy (all of it enters the input hash)."""

    family: str = "hotpotqa"
    """Task family with a trace builder in ``TRACES``."""
    base: str = "smollm2"
    """Hugging Face causal-LM directory, or a named policy (``trace_rl.policy.named``)."""
    train_split: str = "train+dev_rest"
    """Splits (or files) the traces are built from, joined by ``+``: HotpotQA's 100 training
    questions and ``dev_rest``, the 400 dev items after the fixed held-out block. No item of
    ``eval_split`` may be among them (checked by id before anything is built)."""
    train_items: int = 0
    """Training items the traces come from (the first ones; 0 = all of ``train_split``)."""
    eval_split: str = "dev_heldout"
    """Held-out split the policy is measured on: by default the first 100 dev items, which no
    training trace comes from (``trace_rl.envs.hotpotqa.BLOCKS``)."""
    env_args: tuple[tuple[str, Any], ...] = (("top_k", 2), ("max_chars", 200))
    """Family settings for the traces and the measurement (short observations keep the SFT
    sequences short); give the same ``extra`` to ``trace train``/``trace eval``."""
    recovery: float = 0.2
    """Share of training items that also get a recovery trace (a bad search first)."""
    bridge_thoughts: bool = True
    """Write thoughts that teach the bridge step: before the second search of a bridge question
    the thought quotes the span of the first observation that names the second entity, and the
    query is that name; before the answer it quotes the observation's span holding the answer.
    False: empty thoughts and the gold titles as queries (recipe 2)."""
    epochs: int = 1
    """Passes over the traces."""
    batch_size: int = 4
    """Traces per optimiser step."""
    learning_rate: float = 3e-4
    """Peak AdamW learning rate (of the top layers only, by default). 3e-4 because 1e-4 for one
    epoch left the format half-learnt (0 of 40 dev items)."""
    warmup_steps: int = 5
    """Steps of linear warm-up before the cosine decay."""
    trainable_layers: int = 6
    """Train only the top this many decoder layers and the final norm (0 = every parameter).
    6 of SmolLM2's 30 by CPU time: an SFT step of 4 traces took 112 s with the top 8 layers
    and 290-430 s with every parameter on the shared 2-core machine."""
    max_tokens: int = 1024
    """Traces longer than this (prompt included) are left out of the SFT (and counted)."""
    eval_items: int = 100
    """Held-out items measured before and after SFT (0 = no measurement)."""
    eval_samples: int = 1
    """Sampled rollouts per held-out item."""
    max_turns: int = 5
    """Turn cap of a measured episode."""
    max_new_tokens: int = 128
    """Token cap of one measured turn."""
    eval_temperature: float = 1.0
    """Sampling temperature of the measurement (and the one to give RL as ``temperature``).
    Anything but 1.0 is measured at 1.0 as well, reported beside it (``after_t1``)."""
    measure_base: bool = True
    """Also measure the base model before SFT, on the same items and seeds."""
    measure_greedy: bool = True
    """Also measure the warm-started policy greedily (temperature 0), beside the sampled run."""
    seed: int = 0
    """Seeds the trace draws, the batch order and the measurement's sampling."""

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "max_tokens", "eval_samples", "max_turns",
                     "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"warmstart: {name}={getattr(self, name)} must be >= 1")
        for name in ("train_items", "eval_items", "trainable_layers", "warmup_steps", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"warmstart: {name}={getattr(self, name)} must be >= 0")
        if not 0.0 <= self.recovery <= 1.0:
            raise ValueError(f"warmstart: recovery={self.recovery} must be in [0, 1]")
        if not 0.0 < self.eval_temperature <= 2.0:
            raise ValueError(f"warmstart: eval_temperature={self.eval_temperature} must be in "
                             "(0, 2] (greedy is measured anyway, measure_greedy)")
        if self.learning_rate <= 0:
            raise ValueError(f"warmstart: learning_rate={self.learning_rate} must be > 0")
        if self.family not in TRACES:
            raise ValueError(f"warmstart: no trace builder for family {self.family!r}; "
                             f"families: {', '.join(sorted(TRACES))}")
        if self.eval_split in self.train_splits:
            raise ValueError("warmstart: train_split and eval_split must differ (traces are "
                             "never built from evaluation items)")

    @property
    def train_splits(self) -> list[str]:
        """``train_split`` as its ``+``-joined parts."""
        parts = [p.strip() for p in self.train_split.split("+")]
        if not all(parts):
            raise ValueError(f"warmstart: train_split={self.train_split!r} has an empty part")
        return parts

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["env_args"] = dict(self.env_args)
        return d


def config_from_args(args: Sequence[str]) -> WarmstartConfig:
    """``key=value`` arguments (``family=hotpotqa epochs=1``) as a ``WarmstartConfig``; values
    read as JSON when they parse (``env_args={"top_k": 3}``). ``ValueError`` names a bad one."""
    known = {f.name: f for f in dataclasses.fields(WarmstartConfig)}
    values: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or key not in known:
            raise ValueError(f"warmstart: {arg!r}: give key=value with a key among "
                             f"{', '.join(known)}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        default = known[key].default
        if key == "env_args":
            if not isinstance(value, dict):
                raise ValueError(f"warmstart: env_args={raw!r} must be a JSON object")
            value = tuple(sorted(value.items()))
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"warmstart: {key}={raw!r} must be true or false")
        elif isinstance(default, (int, float)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (isinstance(default, int) and not isinstance(value, int)):
                raise ValueError(f"warmstart: {key}={raw!r} must be a {type(default).__name__}")
            value = type(default)(value)
        else:
            value = str(raw)
        values[key] = value
    return WarmstartConfig(**values)


# ------------------------------------------------------------------------------------ traces
TraceBuilder = Callable[[Environment, TaskItem, random.Random, bool, bool],
                        "tuple[list[Action], list[str]] | None"]
"""(env, training item, rng, recovery?, thoughts?) -> (actions, the thought before each) or None
when the item cannot give that trace."""


def _name(title: str) -> str:
    """A title without its disambiguation ("Kiss and Tell (1945 film)" -> "Kiss and Tell")."""
    return title.split(" (")[0].strip()


def _hop_order(item: TaskItem) -> list[str]:
    """Supporting titles, those the question names first (the first hop of a bridge question)."""
    titles = list(dict.fromkeys(item.meta.get("supporting_titles") or []))
    q = item.question.lower()
    return sorted(titles, key=lambda t: (_name(t).lower() not in q, titles.index(t)))


QUOTE_CHARS = 60
"""Characters of observation a bridge thought quotes before the span it points at."""


def quote(observation: str, span: str) -> str | None:
    """The stretch of ``observation`` that ends with ``span`` (case aside, whole words only),
    starting at a word boundary at most ``QUOTE_CHARS`` before it and never in a result's
    ``[k] Title:`` head; None when no result's text holds ``span``."""
    if not span.strip():
        return None
    for found in re.finditer(rf"(?<!\w){re.escape(span.strip())}(?!\w)", observation,
                             re.IGNORECASE):
        at = found.start()
        line_start = observation.rfind("\n", 0, at) + 1
        head = observation.find(": ", line_start)
        text_start = line_start if head < 0 or "\n" in observation[line_start:head] else head + 2
        if at < text_start:
            continue  # the span is (in) the result's title, not its text
        start = max(text_start, at - QUOTE_CHARS)
        if start > text_start and observation[start - 1] != " ":
            space = observation.find(" ", start, at)
            start = space + 1 if space >= 0 else at
        return observation[start:found.end()].strip()
    return None


def hotpotqa_trace(env: Environment, item: TaskItem, rng: random.Random, recovery: bool,
                   thoughts: bool = True) -> tuple[list[Action], list[str]] | None:
    """Gold: search each supporting title, answer. Recovery: a distractor title first.

    With ``thoughts`` (the bridge step made explicit), queries are the entity names (titles
    without their disambiguation, as a policy can copy them from the question or an observation)
    and each thought quotes what the next action copies: before a search for an entity the
    question does not name, the span of an earlier observation that names it; before the answer,
    the span of an observation that holds it. Observations are the environment's real ones."""
    titles = _hop_order(item)
    if not titles:
        return None
    queries = [_name(t) if thoughts else t for t in titles]
    if recovery:
        distractors = sorted({p["title"] for p in item.meta.get("paragraphs") or []} - set(titles))
        if not distractors:
            return None
        bad = rng.choice(distractors)
        queries.insert(0, _name(bad) if thoughts else bad)
    actions = [Action(kind="tool", tool="search", arguments={"query": q}) for q in queries]
    actions.append(Action(kind="answer", answer=str(item.gold)))
    if not thoughts:
        # Empty thoughts (recipe 2): recipe 1's fixed phrases ("I search for the first entity.")
        # carried nothing, and the policy answered with them (0/40 on dev).
        return actions, [""] * len(actions)
    state = env.reset(item)
    seen: list[str] = []
    said: list[str] = []
    question = item.question.lower()
    for action in actions:
        target = action.arguments["query"] if action.kind == "tool" else str(action.answer)
        said.append("")
        if (action.kind == "tool" and target.lower() in question) or \
                target.strip().lower() in ("yes", "no"):
            said[-1] = ""  # the question names it, or a comparison's yes/no: nothing to quote
        else:
            for obs in reversed(seen):
                span = quote(obs, target)
                if span is not None:
                    said[-1] = f'The result says "{span}".'
                    break
        if action.kind == "tool":
            seen.append(env.step(state, action).observation or "")
    return actions, said


TRACES: dict[str, TraceBuilder] = {"hotpotqa": hotpotqa_trace}
"""Family -> trace builder (the registry of families this recipe supports)."""


def build_traces(config: WarmstartConfig, env: Environment, items: Sequence[TaskItem],
                 rng: random.Random) -> Iterator[tuple[TaskItem, list[Action], list[str], str]]:
    """(item, actions, thoughts, kind) per trace: a gold trace per item, and a recovery trace
    for a share ``config.recovery`` of them."""
    build = TRACES[config.family]
    for item in items:
        for kind in ("gold", "recovery"):
            if kind == "recovery" and rng.random() >= config.recovery:
                continue
            made = build(env, item, rng, kind == "recovery", config.bridge_thoughts)
            if made is not None:
                yield item, made[0], made[1], kind


# ------------------------------------------------------------------------------------ cache
def input_hash(config: WarmstartConfig, base_dir: Path, env: Environment,
               items: Sequence[TaskItem], eval_items: Sequence[TaskItem] = ()) -> str:
    """sha256 over the recipe version, the config, the base model's files (names and sizes; its
    config.json in full), the family's prompt, the training items (with the metadata the traces
    are built from: supporting titles, paragraphs) and the ids of the measured items."""
    h = hashlib.sha256()
    h.update(json.dumps({"recipe": RECIPE_VERSION, "config": config.to_json(),
                         "system": env.system_prompt()}, sort_keys=True).encode())
    h.update((base_dir / "config.json").read_bytes())
    for f in sorted(base_dir.iterdir()):
        if f.is_file():
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    for item in items:
        h.update(json.dumps([item.id, item.question, item.gold,
                             item.meta.get("supporting_titles"), item.meta.get("paragraphs")],
                            default=str).encode())
    h.update(json.dumps([it.id for it in eval_items]).encode())
    return h.hexdigest()


def load_split_items(config: WarmstartConfig, env: Environment
                     ) -> tuple[list[TaskItem], list[TaskItem]]:
    """(training items, measured items): the ``+``-joined parts of ``train_split`` in order (the
    first ``train_items`` of them), and the first ``eval_items`` of ``eval_split``.
    ``ValueError`` when an item of the measured split is among the training items (by id, and by
    question, as ids alone may repeat across files): traces never come from evaluation items."""
    train: list[TaskItem] = []
    for part in config.train_splits:
        train.extend(env.load(part))
    if config.train_items:
        train = train[:config.train_items]
    held = env.load(config.eval_split) if config.eval_split else []
    ids, questions = {it.id for it in train}, {it.question for it in train}
    shared = [it.id for it in held if it.id in ids or it.question in questions]
    if shared:
        raise ValueError(f"warmstart: {len(shared)} item(s) of eval_split={config.eval_split!r} "
                         f"are in train_split={config.train_split!r} (e.g. {shared[0]!r}); "
                         "traces are never built from evaluation items")
    return train, held[:config.eval_items]


def read_record(out_dir: str | Path) -> dict[str, Any] | None:
    path = Path(out_dir) / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def _holds(directory: Path, digest: str) -> bool:
    record = read_record(directory) if directory.is_dir() else None
    return record is not None and record.get("input_hash") == digest


def warmstart_policy(config: WarmstartConfig, out_dir: str | Path, *,
                     cache_dir: str | Path | None = None, workdir: str | Path | None = None,
                     engine: str = "auto", show_progress: bool = False) -> Path:
    """Build (or reuse) the warm-started policy of ``config`` in ``out_dir``; return it.

    With ``cache_dir`` it is built once per machine (``cache_dir/policies/warmstart-<family>-
    <hash>``, under a file lock) and copied into ``out_dir``. With ``workdir`` the build is an
    MLflow run there (experiment ``warmstart``). ``engine``: the measurement's rollout engine."""
    from trace_rl.policy.named import resolve_policy

    out = Path(out_dir)
    base_dir = Path(resolve_policy(config.base))
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"warmstart: base={config.base!r} is not a Hugging Face model directory "
                         "or a named policy")
    env = make_env(config.family, **dict(config.env_args))
    train, eval_items = load_split_items(config, env)
    digest = input_hash(config, base_dir, env, train, eval_items)
    if _holds(out, digest):
        return out
    if cache_dir is None:
        _build(config, base_dir, env, train, eval_items, digest, out, workdir, engine,
               show_progress)
        return out
    from trace_rl.policy.bootstrap import build_once

    cached = Path(cache_dir) / "policies" / f"warmstart-{config.family}-{digest[:16]}"
    return build_once(cached, out, lambda d: _holds(d, digest),
                      lambda d: _build(config, base_dir, env, train, eval_items, digest, d,
                                       workdir, engine, show_progress),
                      "warmstart" if show_progress else None)


def _build(config: WarmstartConfig, base_dir: Path, env: Environment, train: list[TaskItem],
           eval_items: list[TaskItem], digest: str, out: Path, workdir: str | Path | None,
           engine: str, show_progress: bool) -> None:
    from trace_rl.policy.bootstrap import _replace_dir
    from trace_rl.progress import Progress, Silent

    tracker = None
    if workdir is not None:
        from trace_rl.storage.tracking import Tracker

        tracker = Tracker(workdir, experiment="warmstart")
        tracker.start_or_resume(f"warmstart-{config.family}-{digest[:10]}")
        tracker.log_config({**config.to_json(), "base_dir": str(base_dir)})
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as work, \
                (Progress(f"warmstart {config.family}", 0) if show_progress else Silent()) as progress:
            staged = Path(work) / "policy"
            record = _train(config, base_dir, env, train, eval_items, staged, progress, tracker,
                            engine)
            record["input_hash"] = digest
            (staged / RECORD).write_text(json.dumps(record, indent=2) + "\n")
            _replace_dir(staged, out, Path(work))
    except BaseException:
        if tracker is not None:
            tracker.end("FAILED")
        raise
    if tracker is not None:
        tracker.end("FINISHED")


# ------------------------------------------------------------------------------------ SFT
def _freeze_lower_layers(model: Any, trainable_layers: int) -> int:
    """Leave only the top ``trainable_layers`` decoder layers and the final norm trainable;
    return the number of trainable parameters."""
    import torch

    if trainable_layers > 0:
        layers = model.model.layers
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in list(layers)[-trainable_layers:]:
            for p in layer.parameters():
                p.requires_grad_(True)
        for p in model.model.norm.parameters():
            p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad and
               isinstance(p, torch.nn.Parameter))


def _train(config: WarmstartConfig, base_dir: Path, env: Environment, train: list[TaskItem],
           eval_items: list[TaskItem], staged: Path, progress: Any, tracker: Any,
           engine: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace_rl.policy.bootstrap import (_Scripted, auto_threads, episode_example, sft_batch,
                                           sft_loss, shared_prefix_len)
    from trace_rl.rollout.react import expert_episode

    t_start = time.perf_counter()
    torch.manual_seed(config.seed)
    threads = auto_threads()
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rng = random.Random(f"warmstart:{config.family}:{config.seed}")
    progress.note(f"writing ReAct traces of {len(train)} {config.family}/{config.train_split} "
                  "items (real BM25 observations)")
    examples, kinds, too_long, trace_reward = [], {}, 0, {}
    thought_counts: dict[str, int] = {}
    for item, actions, thoughts, kind in build_traces(config, env, train, rng):
        with_thought = "with" if any(thoughts) else "without"
        key = f"{item.meta.get('type') or 'item'}_{with_thought}"
        thought_counts[key] = thought_counts.get(key, 0) + 1
        ep = expert_episode(_Scripted(env, actions), item, tokenizer, thoughts=thoughts)
        ex = episode_example(ep)
        if len(ex.token_ids) > config.max_tokens:
            too_long += 1
            continue
        examples.append(ex)
        kinds[kind] = kinds.get(kind, 0) + 1
        trace_reward[kind] = trace_reward.get(kind, 0.0) + float(ep.reward or 0.0)
    if not examples:
        raise ValueError(f"warmstart: no trace of {config.family}/{config.train_split} fits "
                         f"max_tokens={config.max_tokens}")
    lengths = sorted(len(e.token_ids) for e in examples)
    record: dict[str, Any] = {
        "config": config.to_json(), "recipe_version": RECIPE_VERSION, "base_dir": str(base_dir),
        "traces": kinds, "traces_too_long": too_long,
        "trace_success": {k: trace_reward[k] / kinds[k] for k in kinds},
        "trace_tokens": {"median": lengths[len(lengths) // 2], "max": lengths[-1]},
        "threads": threads, "train_items": len(train),
        "train_ids": sorted({it.id for it in train}),
        "bridge_thoughts": thought_counts,
        "eval_split": config.eval_split, "eval_items": len(eval_items),
        "eval_ids": [it.id for it in eval_items],
        "eval_samples": config.eval_samples,
    }
    if eval_items and config.measure_base:
        progress.note(f"measuring the base model on {len(eval_items)} {config.eval_split} items")
        t0 = time.perf_counter()
        record["before"] = measure(config, env, base_dir, eval_items, engine,
                                   config.eval_temperature)
        record["before"]["seconds"] = time.perf_counter() - t0
        _log(tracker, 0, {f"eval/before_{k}": v for k, v in record["before"].items()
                          if isinstance(v, float)})
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.config.use_cache = False
    trainable = _freeze_lower_layers(model, config.trainable_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    steps_per_epoch = math.ceil(len(examples) / config.batch_size)
    total = steps_per_epoch * config.epochs
    opt = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, config.warmup_steps))
        * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen = torch.Generator().manual_seed(config.seed)
    progress.note(f"SFT of {base_dir.name}: {len(examples)} traces ({kinds}), median "
                  f"{record['trace_tokens']['median']} tokens, {config.epochs} epochs, "
                  f"{total} steps, {trainable:,} trainable parameters, {threads} threads")
    progress.total = total
    history, t_sft, step = [], time.perf_counter(), 0
    model.train()
    for epoch in range(1, config.epochs + 1):
        order = torch.randperm(len(examples), generator=gen).tolist()
        losses = []
        for s in range(steps_per_epoch):
            chunk = [examples[i] for i in order[s * config.batch_size:(s + 1) * config.batch_size]]
            loss = sft_loss(model, sft_batch(chunk, pad), shared_prefix_len(chunk))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            _log(tracker, step, {"loss/sft": losses[-1]})
            step += 1
            progress.advance(epoch=f"{epoch}/{config.epochs}", loss=round(losses[-1], 4))
        history.append({"epoch": epoch, "loss": sum(losses) / len(losses),
                        "seconds": time.perf_counter() - t_sft})
    record["sft_seconds"] = time.perf_counter() - t_sft
    record["history"] = history
    model.eval()
    model.config.use_cache = True
    model.save_pretrained(staged, safe_serialization=True)
    tokenizer.save_pretrained(staged)
    if eval_items:
        progress.note(f"measuring the warm-started policy on {len(eval_items)} "
                      f"{config.eval_split} items")
        t0 = time.perf_counter()
        record["after"] = measure(config, env, staged, eval_items, engine,
                                  config.eval_temperature)
        record["after"]["seconds"] = time.perf_counter() - t0
        if config.eval_temperature != 1.0:
            record["after_t1"] = measure(config, env, staged, eval_items, engine, 1.0)
            _log(tracker, step, {f"eval/t1_{k}": v for k, v in record["after_t1"].items()
                                 if isinstance(v, float)})
        _log(tracker, step, {f"eval/after_{k}": v for k, v in record["after"].items()
                             if isinstance(v, float)})
        if config.measure_greedy:
            record["after_greedy"] = measure(config, env, staged, eval_items, engine, 0.0)
            _log(tracker, step, {f"eval/greedy_{k}": v for k, v in record["after_greedy"].items()
                                 if isinstance(v, float)})
    record["total_seconds"] = time.perf_counter() - t_start
    record["torch"] = torch.__version__
    return record


def _log(tracker: Any, step: int, metrics: Mapping[str, float]) -> None:
    if tracker is not None and metrics:
        tracker.log_metrics(step, metrics)


def measure(config: WarmstartConfig, env: Environment, policy_dir: Path,
            items: Sequence[TaskItem], engine: str = "auto",
            temperature: float = 1.0) -> dict[str, Any]:
    """Sampled success (``temperature``, ``eval_samples`` per item) of ``policy_dir`` through the
    real ReAct loop: overall, per question type (``item.meta["type"]``), with the verifier's
    metrics and the share of episodes that answered at all."""
    import numpy as np

    from trace_rl.engines import context_limit, default_engine_kind, make_engine
    from trace_rl.rollout.format import TurnFormat
    from trace_rl.rollout.react import Start, run_episodes
    from trace_rl.rollout.types import SamplingSettings

    kind = default_engine_kind() if engine == "auto" else engine
    eng = make_engine(kind, policy_dir, seed=config.seed)
    try:
        limit = context_limit(policy_dir)
        fmt = TurnFormat(eng.tokenizer)
        system = env.system_prompt()
        fits = [it for it in items if len(fmt.prompt_ids(system, env.user_prompt(it)))
                + config.max_new_tokens <= limit]
        t0 = time.perf_counter()
        episodes = run_episodes(eng, env, [Start(it, (), config.eval_samples) for it in fits],
                                sampling=SamplingSettings(max_tokens=config.max_new_tokens,
                                                          temperature=temperature),
                                max_turns=config.max_turns, seed=config.seed, max_context=limit)
        wall = time.perf_counter() - t0
    finally:
        eng.close()
    n = config.eval_samples
    rewards = np.array([float(ep.reward or 0.0) for ep in episodes]).reshape(len(fits), n)
    per_item = rewards.mean(axis=1)
    out: dict[str, Any] = {"engine": kind, "temperature": temperature, "items": len(fits), "skipped_overlong":
                           len(items) - len(fits), "success": float(per_item.mean()),
                           "rollout_seconds": wall}
    from trace_core.stats import mean_interval

    if len(fits) >= 2:
        ci = mean_interval(per_item.tolist())
        out["ci_low"], out["ci_high"] = float(ci.low), float(ci.high)
    for t in sorted({str(it.meta.get("type") or "") for it in fits} - {""}):
        mask = np.array([str(it.meta.get("type") or "") == t for it in fits])
        out[f"success_{t}"] = float(per_item[mask].mean())
        out[f"items_{t}"] = int(mask.sum())
        if mask.sum() >= 2:
            ci = mean_interval(per_item[mask].tolist())
            out[f"ci_low_{t}"], out[f"ci_high_{t}"] = float(ci.low), float(ci.high)
    answered = [ep for ep in episodes if ep.turns and ep.turns[-1].action.kind == "answer"]
    out["answered"] = len(answered) / max(1, len(episodes))
    out["searches_per_episode"] = float(np.mean([sum(t.action.kind == "tool" for t in ep.turns)
                                                 for ep in episodes])) if episodes else 0.0
    for key in ("em", "f1", "strict"):
        out[key] = float(np.mean([float(ep.metrics.get(key, 0.0)) for ep in episodes])) \
            if episodes else 0.0
    return out
