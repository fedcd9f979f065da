"""The one typed, frozen configuration of a training run, and its loading from YAML + overrides.

Every field has a docstring; derived values are properties; ``validate`` says what to fix. The
registry of variants (allocators, advantage estimators, engines) is resolved at this edge by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from trace_core.advantages import ESTIMATORS

ALLOCATORS = ("trace", "grpo", "dapo", "prompt_only", "random_prefix")
ADVANTAGES = tuple(ESTIMATORS)  # the registry's names
ENGINES = ("auto", "hf", "vllm")


@dataclass(frozen=True)
class TrainConfig:
    """A TRACE training run. ``trace train`` with no config runs these defaults: 20 steps of
    the tiny CPU policy on a synthetic family, evaluated on held-out items before and after, small
    enough for a 2-core machine (docs/results.md, "The default run")."""

    run_name: str = "trace-default"
    """Human name; the run id is ``<run_name>-<config hash>`` unless ``run_id`` is set."""
    run_id: str = ""
    """Explicit run id (re-using one resumes that run); empty = derived from name + config hash."""
    family: str = "synth_arith"
    """Task family (``trace_rl.envs.registry``): synth_arith, synth_lookup, synth_fncall,
    hotpotqa, math, bfcl."""
    difficulty: int = 1
    """Difficulty knob of a synthetic family (ignored by real families). At 1 the bootstrapped
    tiny policy starts at ~51% sampled success on synth_arith (docs/results.md), so groups mix."""
    train_split: str = "train"
    """Split (or data file, for real families) that roots are drawn from."""
    eval_split: str = "test"
    """Held-out split for ``evaluate`` and the train flow's before/after evaluation."""
    eval_items: int = 200
    """Held-out items the train flow evaluates the policy on before the first step and after the
    last (paired: same items, same sampling seeds; 0 = no evaluation). A bootstrapped policy's
    own selection and report items are skipped. The interval of the gain over 200 items x 4
    samples is about +-4 points (docs/results.md, "The default run")."""
    eval_samples: int = 4
    """Rollouts per held-out item, at the training temperature; an item's score is their mean."""
    policy: str = "tiny"
    """A Hugging Face causal LM directory, or ``tiny`` for the project's bootstrapped CPU model."""
    engine: str = "auto"
    """Rollout engine: ``hf`` (transformers), ``vllm``, or ``auto`` (per-device default chosen by
    bench/engines.py)."""
    allocator: str = "trace"
    """Budget allocator: trace, grpo, dapo, prompt_only, random_prefix."""
    advantage: str = "branch"
    """Tree advantage estimator (trace_core.advantages): branch, treepo, tree_grpo, segment, grpo.
    ``branch`` (each turn against the value of the last branch point above it; on a flat group
    r - mean, so the flat baselines are unaffected) by measurement (docs/results.md, "Session 6"):
    TRACE on the pool of uneven prompts 33.2 +- 2.2 with no broken run, against 26.1 +- 8.2 with
    ``treepo``, whose per-leaf average is not zero-sum at a branch point and gave one run's shared
    format tokens a net push until it broke; at d = 1 78.7 +- 1.2 against 79.6 +- 1.9."""
    centre_advantages: bool = False
    """Shift each tree's advantages so that its paths' advantages sum to zero
    (``trace_core.advantages.centred``); a no-op for flat groups and zero-sum estimators."""
    count_turns_once: bool = False
    """Divide each turn's advantage by the number of paths that share the turn
    (``trace_core.advantages.per_node``), so a prefix continued K times weighs once in the loss,
    not K + 1 times; a no-op for flat groups. Off by measurement (docs/results.md, "Session 7"):
    TRACE +0.6 points (inside the seeds' spread), one random_prefix run of three broke."""
    steps: int = 20
    """Training steps (each: roots -> level 0 -> level 1 -> update). 20 by measurement
    (docs/results.md, "The default run"): at 10 one seed's gain of five held zero in its interval."""
    pool_size: int = 32
    """Candidate prompts scored by the predictor per step (Stage 1 pool)."""
    root_budget: int = 16
    """M: bare rollouts per step, shared across the pool by Stage 1."""
    multiplier: int = 2
    """N: continuation multiplier; Stage 2 spends m_i * N continuations on prompt i."""
    min_per_root: int = 2
    """Smallest non-zero root allocation (one rollout can never be mixed)."""
    max_per_root: int = 8
    """Cap on rollouts per prompt."""
    group_size: int = 4
    """n: rollouts per prompt for the flat baselines (grpo, dapo)."""
    tree_group: int = 2
    """Bare rollouts per prompt for random_prefix's uniform roots."""
    branch_from_root: bool = True
    """TRACE's Stage 2 also offers the root of a tree whose bare rollouts all agree (a
    continuation from it is one more bare rollout, scored by the same q^K (1 - q) gain as any
    prefix). Off: only depth >= 1 prefixes, as in the paper's description."""
    joint_split: bool = False
    """TRACE: after the bare rollouts, split the step's M N continuation leaves between
    continuations of any tree's prefixes and bare rollouts of pool prompts not yet rolled out,
    each leaf where it buys the most expected mixed groups (``trace_core.allocation.
    allocate_joint``). False (default): m_i N continuations inside tree i, the paper's split.
    Works with ``correlation_window`` > 0: read as independent draws, continuations look likelier
    to flip than they are. On from session 5 to 7; off again since session 8, by measurement at
    N = 2 (docs/results.md, "Session 8": the paper's split reaches 1.41x and 1.68x GRPO's effective
    ratio against 1.03x, with 30% fewer generated tokens, at accuracy within the seeds' noise)."""
    exploration: float = 0.1
    """Strength of the exploration rule that pulls long-unsampled prompts' predictions toward 0.5."""
    correlation_window: int = 4
    """Stage 1 and Stage 2 (trace, prompt_only) estimate rho, the correlation of a node's rollout
    outcomes given its prediction, from the stored trees of this many previous steps (more if
    they hold too little evidence; ``tasks.correlation``, ``trace_core.calibration``), and
    allocate on the Beta-posterior gains of ``trace_core.allocation``. 0 = off: rollouts read as
    independent Bernoulli(V~) draws, the paper's formulas. Default by measurement
    (docs/results.md, "Session 5")."""
    correlation_min_terms: int = 16
    """Nodes a depth needs in the window before its own rho estimate is used (else the pooled
    prefixes' estimate, else 0)."""
    max_turns: int = 4
    """Turn cap of an episode."""
    max_new_tokens: int = 48
    """Token cap of one turn."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    tool_timeout_s: float = 5.0
    """Wall-clock limit of one tool call."""
    learning_rate: float = 1e-4
    """AdamW learning rate of the policy (suits the tiny CPU policy, whose SFT peaks at 2e-3; use
    about 1e-6 for a multi-billion-parameter model). 1e-4 rather than 2e-4 by the runs that broke
    the tiny policy, counted over every method (docs/results.md, "Session 5")."""
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up over this many RL steps (0 = off): step s (0-based) uses
    ``learning_rate * (s + 1) / lr_warmup_steps`` until the full rate. AdamW's first steps move
    every parameter by about the learning rate whatever its gradient's size (the moment
    estimates hold one or two samples), which is what warm-up tempers (OpenRLHF's
    ``lr_warmup_ratio``, verl's ``lr_warmup_steps``)."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.28
    """PPO ratio clip above 1 (DAPO clip-higher)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the initial policy (0 disables it)."""
    loss_agg: str = "seq-mean-token-sum"
    """How token losses are averaged (trace_core.loss.AGGREGATIONS): token-mean,
    seq-mean-token-sum, seq-mean-token-mean. Default by measurement (docs/results.md, "Learning
    benchmark" and "Session 6"): seq-mean-token-mean gives each token of a short path more weight
    (1/|o|), and a lucky 7-token direct answer once outweighed 30 tool-call paths. With
    seq-mean-token-sum every method of the d = 1 learning benchmark ended higher (no run broke
    against 1 of 15); on the pool of uneven prompts the methods moved -1.7 ... +2.0 points, bar one
    TRACE run that broke there (none had with seq-mean-token-mean). Its gradient norms reach ~130
    (medians 7-12), so ``max_grad_norm`` clips nearly every optimiser step to norm 1. token-mean
    was worst in session 1 (10 steps took the tiny policy from 16.3% to 9.3% / 6.7% greedy
    accuracy)."""
    ppo_epochs: int = 4
    """Passes over a step's paths (each pass: ``mini_batches`` optimiser steps). Default 4 with
    ``mini_batches`` 1, four AdamW steps on the whole batch, by measurement (docs/results.md,
    "Session 9" item 4): with 4 steps on quarters of the batch, TRACE's ~5 mixed trees per step
    gave each step 1.2 prompts; on the whole batch every method's final held-out accuracy rose
    (+0.7 to +5.8 points; mean of the five 80.3 -> 83.4) at 1.4-2.0x a run's training wall time
    (the whole benchmark's: 1.27x)."""
    micro_batch: int = 8
    """Paths per forward/backward pass (memory); gradients are accumulated over micro-batches."""
    mini_batches: int = 1
    """Optimiser steps per PPO epoch (verl's ppo_mini_batch): a step's paths are split into this
    many mini-batches of whole trees (at most one per ``micro_batch`` paths), gradients
    accumulated over their micro-batches. Whole trees keep each step's advantages centred: a
    mini-batch of mostly negative-advantage paths from split groups once moved the KL to 0.16 in
    one step (docs/results.md). What counts is the optimiser steps per RL step
    (``ppo_epochs`` x ``mini_batches``) and the prompts each sees (docs/results.md, synth_arith
    d=1, 10 steps: 4 steps reached 78.0% (GRPO) / 68.2% (TRACE) held-out sampled accuracy from
    48.0%, one step 62.3% / 56.2%; session 9: 4 steps on the whole batch beat 4 on quarters of
    it for every method). Default 1 with ``ppo_epochs`` 4."""
    target_kl: float = 0.1
    """Trust-region guard of the policy update (0 = off): an optimiser step after which the
    approximate KL of the sampling policy from the new one, on the mini-batch it used, exceeds
    this is undone and the step's update ends (``UpdateSettings.target_kl``). A guard against
    the rare catastrophic step, not a tight trust region. Measured on synth_arith d=1 at learning
    rate 2e-4 (docs/results.md): without it one AdamW step moved the KL to 0.16 and broke the
    tiny policy's tool-call format for the rest of the run (TRACE and prompt_only, seed 2); at
    0.1 those runs learn and 0-2 steps of 20 are undone; at 0.02 half of GRPO's steps were cut
    short and it learned far slower (65.0% vs 78.8% after 20 steps)."""
    target_position_kl: float = 0.0
    """Position-wise trust-region guard (0 = off): as ``target_kl``, on the largest KL of the
    next-token distribution at one policy-token position of the mini-batch
    (``trace_rl.policy.update.position_kl``), which catches one likely token moved far (a turn's
    first token collapsing) that the mean over a path's tokens dilutes."""
    predictor_epochs: int = 5
    """Epochs of the predictor's online regression per step."""
    predictor_lr: float = 3e-3
    """Learning rate of the predictor head."""
    seed: int = 0
    """Seed of every random choice (roots, sampling, initialisation)."""
    checkpoint_every: int = 1
    """Register the policy checkpoint in MLflow (artifacts + a model version, weights and
    tokenizer without the optimiser state) every this many steps, and always at the last step.
    Every step's weights stay in the work dir's checkpoints; only the newest keeps its optimiser
    state (for resuming)."""
    plot_every: int = 1
    """Render a rollout tree and a calibration plot every this many steps (0 = never)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Family-specific options passed to the environment factory."""

    @property
    def leaf_budget(self) -> int:
        """Trajectories per step at equal cost: M bare rollouts + M * N continuations."""
        return self.root_budget * (1 + self.multiplier)

    @property
    def config_hash(self) -> str:
        """Stable hash of everything that changes results (not the run name or id)."""
        d = self.to_dict()
        d.pop("run_name")
        d.pop("run_id")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]

    @property
    def resolved_run_id(self) -> str:
        return self.run_id or f"{self.run_name}-{self.config_hash}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["extra"] = dict(self.extra)
        return d

    def validate(self) -> "TrainConfig":
        """Check every field's type, then its range and the registries; raise ``ValueError``
        naming the field, its value and what to fix. Cheap and free of I/O (``check_inputs``
        checks the files a run reads)."""
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name))

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"config: {msg}")

        for name, (test, what) in _RANGES.items():
            v = getattr(self, name)
            need(test(v), f"{name}={v!r}; must be {what}")
        for name, choices in (("allocator", ALLOCATORS), ("advantage", ADVANTAGES),
                              ("engine", ENGINES), ("loss_agg", LOSS_AGGREGATIONS),
                              ("family", _families())):
            v = getattr(self, name)
            need(v in choices, f"{name}={v!r}; choose one of {tuple(choices)}")
        need(_RUN_ID.match(self.resolved_run_id) is not None,
             f"run id {self.resolved_run_id!r} (from run_name={self.run_name!r}, "
             f"run_id={self.run_id!r}) must match {_RUN_ID.pattern}: letters, digits, _ . -")
        need(all(isinstance(k, str) for k in self.extra),
             f"extra={dict(self.extra)!r}; its keys must be strings")
        need(self.max_per_root >= self.min_per_root,
             f"max_per_root={self.max_per_root} < min_per_root={self.min_per_root}")
        need(self.root_budget >= self.min_per_root,
             f"root_budget={self.root_budget}; must be >= min_per_root={self.min_per_root}")
        need(self.pool_size * self.max_per_root >= self.root_budget,
             f"pool_size * max_per_root = {self.pool_size * self.max_per_root} cannot hold "
             f"root_budget={self.root_budget}; raise pool_size or max_per_root")
        return self


LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
"""``trace_core.loss.AGGREGATIONS``' names (not imported: that module pulls in torch, and the
CLI validates a config before importing anything heavy)."""
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # as trace_rl.storage.store and MLflow want
_MAX_SEED = 2**32 - 1  # numpy's legacy seeding and some samplers refuse larger seeds


def _families() -> list[str]:
    from trace_rl.envs.registry import families  # the one registry; factories import lazily

    return families()


def _family_defaults(family: Any) -> dict[str, Any]:
    from trace_rl.envs.registry import family_defaults

    return family_defaults(family) if isinstance(family, str) else {}


def _positive(v: float) -> bool:
    return v > 0


def _at_least(lo: float) -> Any:
    return lambda v: v >= lo


# Range of each field (``bool``: a string field must not be empty); types come from the defaults
# (``_check_type``). A field missing here takes any value of its type; names checked against a
# registry and the cross-field rules are in ``TrainConfig.validate``.
_RANGES: dict[str, tuple[Any, str]] = {
    "run_name": (bool, "a non-empty string"),
    "train_split": (bool, "a non-empty split name or data file"),
    "eval_split": (bool, "a non-empty split name or data file"),
    "policy": (bool, "'tiny' or a Hugging Face model directory"),
    "difficulty": (_at_least(1), ">= 1"),
    "eval_items": (_at_least(0), ">= 0 (0 = no held-out evaluation)"),
    "eval_samples": (_at_least(1), ">= 1"),
    "steps": (_at_least(1), ">= 1"),
    "pool_size": (_at_least(1), ">= 1"),
    "root_budget": (_at_least(1), ">= 1"),
    "multiplier": (_at_least(0), ">= 0"),
    "min_per_root": (_at_least(1), ">= 1"),
    "max_per_root": (_at_least(1), ">= 1"),
    "group_size": (_at_least(1), ">= 1 (rollouts per prompt of grpo and dapo)"),
    "tree_group": (_at_least(1), ">= 1 (bare rollouts per prompt of random_prefix)"),
    "exploration": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "correlation_window": (_at_least(0), ">= 0 (0 = off)"),
    "correlation_min_terms": (_at_least(1), ">= 1"),
    "max_turns": (_at_least(1), ">= 1"),
    "max_new_tokens": (_at_least(1), ">= 1"),
    "temperature": (_at_least(0), ">= 0 (0 = greedy)"),
    "tool_timeout_s": (_positive, "> 0 seconds"),
    "learning_rate": (_positive, "> 0"),
    "lr_warmup_steps": (_at_least(0), ">= 0 (0 = off)"),
    "clip_low": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "clip_high": (_at_least(0), ">= 0"),
    "kl_coef": (_at_least(0), ">= 0 (0 = off)"),
    "ppo_epochs": (_at_least(1), ">= 1"),
    "micro_batch": (_at_least(1), ">= 1"),
    "mini_batches": (_at_least(1), ">= 1"),
    "target_kl": (_at_least(0), ">= 0 (0 = off)"),
    "target_position_kl": (_at_least(0), ">= 0 (0 = off)"),
    "predictor_epochs": (_at_least(0), ">= 0"),
    "predictor_lr": (_positive, "> 0"),
    "seed": (lambda v: 0 <= v <= _MAX_SEED, f"in [0, {_MAX_SEED}]"),
    "checkpoint_every": (_at_least(1), ">= 1"),
    "plot_every": (_at_least(0), ">= 0 (0 = never)"),
}

_DEFAULTS: dict[str, Any] = {}  # the defaults' values, filled on first use


def _kind(name: str) -> type:
    """The type a field holds: that of its default (``extra``: a mapping)."""
    if not _DEFAULTS:
        _DEFAULTS.update(TrainConfig().to_dict())
    d = _DEFAULTS[name]
    return Mapping if isinstance(d, Mapping) else type(d)


def _check_type(name: str, v: Any) -> None:
    kind = _kind(name)
    if kind is bool:
        ok, what = isinstance(v, bool), "true or false"
    elif kind is int:
        ok, what = isinstance(v, int) and not isinstance(v, bool), "an integer"
    elif kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        what = "a finite number"
    elif kind is Mapping:
        ok, what = isinstance(v, Mapping), "a mapping of option: value"
    else:
        ok, what = isinstance(v, kind), f"a {kind.__name__}"
    if not ok:
        raise ValueError(f"config: {name}={v!r} ({type(v).__name__}); must be {what}")


def _normalise(name: str, v: Any) -> Any:
    """A value of a float field given as an int (``lr: 1``) or as YAML 1.1 reads ``1e-4`` (a
    string: PyYAML wants a dot in a float's mantissa) becomes a float, so the config hash does
    not depend on how a number was written. Anything else is left for ``_check_type``."""
    if _kind(name) is float:
        if isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str) and _FLOAT_LITERAL.match(v.strip()):
            return float(v)
    return v


_FLOAT_LITERAL = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _coerce(name: str, raw: Any, default: Any) -> Any:
    """Parse a command-line override string into the type of the field's default."""
    if not isinstance(raw, str) or isinstance(default, str):
        return raw
    try:
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, Mapping):
            return json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"config: cannot read {name}={raw!r} as {type(default).__name__}") from exc
    return raw


def config_from_mapping(data: Mapping[str, Any], where: str = "config") -> TrainConfig:
    """Defaults updated by ``data``; unknown keys are errors naming ``where`` they came from."""
    known = {f.name for f in fields(TrainConfig)}
    for k in data:
        if k not in known:
            raise ValueError(f"config: unknown field {k!r} in {where}; known: {sorted(known)}")
    values = {k: _normalise(k, v) for k, v in data.items()}
    for k, v in _family_defaults(values.get("family", TrainConfig.family)).items():
        values.setdefault(k, v)  # splits and token caps that suit the family, unless given
    try:
        return dataclasses.replace(TrainConfig(), **values).validate()
    except ValueError as exc:
        raise ValueError(f"{exc} (in {where})") from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults, then a YAML file, then ``key=value`` overrides; unknown keys are errors. The
    result is validated (``TrainConfig.validate``) and its inputs checked (``check_inputs``)."""
    known = {f.name: f for f in fields(TrainConfig)}
    defaults = TrainConfig()
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ValueError(f"config: cannot read {path} as a YAML mapping: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config: {path} must hold a mapping of field: value")
        config_from_mapping(data, str(path))  # names the file in any error
        values.update(data)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"config: override {item!r} must look like key=value")
        k, raw = item.split("=", 1)
        k = k.strip()
        if k not in known:
            raise ValueError(f"config: unknown field {k!r} in override {item!r}; known: {sorted(known)}")
        values[k] = _coerce(k, raw, getattr(defaults, k))
    return check_inputs(config_from_mapping(values, "overrides" if path is None
                                            else f"{path} + overrides"))


def check_inputs(cfg: TrainConfig) -> TrainConfig:
    """Check the files a run reads before any work starts: the policy directory (unless
    ``tiny``) and the training split, which must load through its family (a data file: UTF-8
    text whose every row parses; errors name the file and line) and hold at least
    ``pool_size`` items. Raises ``ValueError`` (``DatasetError`` for a bad row) saying what to fix."""
    from trace_rl.envs.registry import make_env

    check_policy(cfg)
    kwargs = dict(cfg.extra)
    if cfg.family.startswith("synth_"):
        kwargs.setdefault("difficulty", cfg.difficulty)
    try:
        env = make_env(cfg.family, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config: family={cfg.family!r} with extra={dict(cfg.extra)!r}: {exc}") from exc
    # Only the training split: the train flow reads nothing else, and a family's default
    # eval_split ("test") need not exist (hotpotqa names its splits differently).
    split = cfg.train_split
    items = check_split(cfg, split, "train_split", env)
    if len(items) < cfg.pool_size:
        raise ValueError(f"config: train_split={split!r} of family {cfg.family!r} holds "
                         f"{len(items)} items; pool_size={cfg.pool_size} needs as many")
    return cfg


def check_policy(cfg: TrainConfig) -> None:
    """The policy must be ``tiny`` on a synthetic family, a named policy
    (``trace_rl.policy.named``: ``smollm2``) or a Hugging Face model directory; ``ValueError``
    says which to give otherwise."""
    from trace_rl.policy.named import NAMED, check_named

    names = ", ".join(f"{k} ({v[0]})" for k, v in NAMED.items())
    if cfg.policy == "tiny":
        if not cfg.family.startswith("synth_"):
            raise ValueError(f"config: policy=tiny is bootstrapped on the synthetic families only, "
                             f"not on family={cfg.family!r}; give policy=<Hugging Face model "
                             f"directory>, a named policy ({names}), or warm-start one with "
                             f"`trace warmstart family={cfg.family}`")
        return
    if cfg.policy in NAMED:
        check_named(cfg.policy)
        return
    policy = Path(cfg.policy)
    if not (policy / "config.json").is_file():
        raise ValueError(f"config: policy={cfg.policy!r} is not a Hugging Face model directory "
                         f"(no {policy / 'config.json'}); give one, a named policy ({names}), or "
                         f"'tiny' for the bootstrapped CPU policy of a synthetic family")


def check_split(cfg: TrainConfig, split: str, what: str, env: Any = None) -> list[Any]:
    """The items of ``split`` (a split name or a data file) of ``cfg``'s family; raises
    ``ValueError`` in one line naming ``what`` (``train_split``, ``eval_split``, ``--data``) and,
    for a split the family lacks, its valid splits (``DatasetError`` for a bad row)."""
    from trace_rl.envs.base import DatasetError
    from trace_rl.envs.io import check_text_file
    from trace_rl.envs.registry import make_env

    if env is None:
        kwargs = dict(cfg.extra)
        if cfg.family.startswith("synth_"):
            kwargs.setdefault("difficulty", cfg.difficulty)
        env = make_env(cfg.family, **kwargs)
    if Path(split).suffix or Path(split).is_file():  # a data file rather than a split name
        check_text_file(split)
    try:
        return env.load(split)
    except DatasetError:
        raise  # names the file and line already
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise ValueError(f"config: {what}={split!r} of family {cfg.family!r}: {exc}") from exc
