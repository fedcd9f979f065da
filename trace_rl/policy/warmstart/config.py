"""What determines a warm-started policy: ``WarmstartConfig`` (all of it enters the input hash),
read from ``key=value`` arguments by ``config_from_args``, and the record's name and version."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Sequence

from trace_rl.envs.registry import families, spec

RECORD = "warmstart.json"
"""Name of the record written next to the weights."""
RECIPE_VERSION = 3
"""Part of the input hash: bump when the recipe changes so cached policies are rebuilt."""


@dataclass(frozen=True)
class WarmstartConfig:
    """Everything that determines a warm-started policy (all of it enters the input hash)."""

    family: str = "hotpotqa"
    """Task family that registered a trace builder (``trace_rl.envs.registry.Warmstart``)."""
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
    training trace comes from (``trace_rl.envs.hotpotqa.env.BLOCKS``)."""
    env_args: tuple[tuple[str, Any], ...] = (("top_k", 3), ("max_chars", 400))
    """Family settings for the traces and the measurement; ``trace train``/``trace eval`` of the
    warm-started directory take them (``extra``) from its record. Top 3 x 400 characters: one
    search of the question shows a quotable answer for 67 of the 100 held-out items (45 with
    recipe 3's top 2 x 200), at a median trace of 616 tokens."""
    recovery: float = 0.2
    """Share of training items that also get a recovery trace (a bad search first)."""
    bridge_thoughts: bool = True
    """Write thoughts that teach the bridge step: before the second search of a bridge question
    the thought quotes the span of the first observation that names the second entity, and the
    query is that name; before the answer it quotes the observation's span holding the answer.
    False: empty thoughts and the gold titles as queries (recipe 2)."""
    question_first: bool = True
    """Recipe 4 (false: recipe 3): the first search of every trace is the question itself (one search puts a
    quotable answer among the top 3 x 400 characters for 67 of the 100 held-out items), then the
    thought quotes the span holding the answer; the entities are searched only when those results
    hold neither the answer nor (yes/no questions) every supporting paragraph. Implies thoughts."""
    epochs: int = 2
    """Passes over the traces. 2 for HotpotQA's recipe 4: 0.200 on the held-out items at
    temperature 0.7 against 0.140 after one pass (docs/results.md, recipe 4)."""
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
    threads: int = 0
    """Torch threads of the SFT; 0 = the cores idle when it starts (``auto_threads``). The weights
    depend on it (the order of the sums), so a build that later runs must pair with, such as the
    RL comparison's start (``bench/rl_real.sh``), gives it: the same number repeats the same
    policy. Enters the input hash when set (0 leaves earlier hashes as they were)."""

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "max_tokens", "eval_samples", "max_turns",
                     "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"warmstart: {name}={getattr(self, name)} must be >= 1")
        for name in ("train_items", "eval_items", "trainable_layers", "warmup_steps", "seed",
                     "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"warmstart: {name}={getattr(self, name)} must be >= 0")
        if not 0.0 <= self.recovery <= 1.0:
            raise ValueError(f"warmstart: recovery={self.recovery} must be in [0, 1]")
        if not 0.0 < self.eval_temperature <= 2.0:
            raise ValueError(f"warmstart: eval_temperature={self.eval_temperature} must be in "
                             "(0, 2] (greedy is measured anyway, measure_greedy)")
        if self.learning_rate <= 0:
            raise ValueError(f"warmstart: learning_rate={self.learning_rate} must be > 0")
        if self.family not in warmstart_families():
            raise ValueError(f"warmstart: no trace builder for family {self.family!r}; "
                             f"families: {', '.join(warmstart_families())}")
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
        if not self.threads:
            del d["threads"]
        return d


def warmstart_families() -> list[str]:
    """The families that registered a trace builder, sorted."""
    return [f for f in families() if spec(f).warmstart is not None]


def family_settings(family: str) -> dict[str, Any]:
    """The ``WarmstartConfig`` fields whose defaults (HotpotQA's recipe) do not fit ``family``,
    as it registered them (``Warmstart.settings``); {} for a family without a trace builder."""
    if family not in warmstart_families():
        return {}
    return dict(spec(family).warmstart.settings)


def config_from_args(args: Sequence[str]) -> WarmstartConfig:
    """``key=value`` arguments (``family=hotpotqa epochs=1``) as a ``WarmstartConfig``; values
    read as JSON when they parse (``env_args={"top_k": 3}``); the family's own settings
    (``family_settings``) fill the fields not given. ``ValueError`` names a bad one."""
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
    family = values.get("family", known["family"].default)
    return WarmstartConfig(**{**family_settings(family), **values})
