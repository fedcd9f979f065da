"""What determines a warm-started policy: ``WarmstartConfig`` (all of it enters the input hash),
read from ``key=value`` arguments by the config loader (``trace_rl.config.warmstart_config``), and
the record's name and version."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from trace_rl.envs.registry import families, spec
from trace_rl.settings import Settings

RECORD = "warmstart.json"
"""Name of the record written next to the weights."""
RECIPE_VERSION = 3
"""Part of the input hash: bump when the recipe changes so cached policies are rebuilt."""


class WarmstartConfig(Settings):
    """Everything that determines a warm-started policy (all of it enters the input hash): a
    ``trace_rl.settings.Settings`` model, as ``trace_rl.config.TrainConfig``'s sections are. Why
    its defaults are what they are: docs/results.md ("Why the defaults are what they are")."""

    family: str = "hotpotqa"
    """Task family that registered a trace builder (``trace_rl.envs.registry.Warmstart``)."""
    base: str = Field("smollm2", min_length=1)
    """Hugging Face causal-LM directory, or a named policy (``trace_rl.policy.named``)."""
    train_split: str = "train+dev_rest"
    """Splits (or files) the traces are built from, joined by ``+`` (HotpotQA's 100 training
    questions and the 400 ``dev_rest`` dev items), none of whose items may be in ``eval_split``
    (checked by id before anything is built)."""
    train_items: int = Field(0, ge=0)
    """Training items the traces come from (the first ones; 0 = all of ``train_split``)."""
    eval_split: str = "dev_heldout"
    """Held-out split the policy is measured on (the first 100 dev items, which no training trace
    comes from: ``trace_rl.envs.hotpotqa.env.BLOCKS``)."""
    env_args: tuple[tuple[str, Any], ...] = (("top_k", 3), ("max_chars", 400))
    """Family settings of the traces and the measurement, which ``trace train`` and ``trace
    eval`` of the warm-started directory take (as ``extra``) from its record."""
    recovery: float = Field(0.2, ge=0, le=1)
    """Share of training items that also get a recovery trace (a bad search first)."""
    bridge_thoughts: bool = True
    """Thoughts that teach the bridge step (before the second search of a bridge question, the
    span of the first observation naming the second entity, which is the query; before the
    answer, the span holding it); off: empty thoughts and the gold titles as queries (recipe 2)."""
    question_first: bool = True
    """Recipe 4 (off: recipe 3): every trace searches the question itself first and quotes the
    span holding the answer, searching the entities only when those results hold neither the
    answer nor (yes/no questions) every supporting paragraph; implies thoughts."""
    epochs: int = Field(2, ge=1)
    """Passes over the traces."""
    batch_size: int = Field(4, ge=1)
    """Traces per optimiser step."""
    learning_rate: float = Field(3e-4, gt=0)
    """Peak AdamW learning rate (of the top layers only, by default)."""
    warmup_steps: int = Field(5, ge=0)
    """Steps of linear warm-up before the cosine decay."""
    trainable_layers: int = Field(6, ge=0)
    """Decoder layers the SFT trains, from the top, as ``UpdateSettings.trainable_layers``."""
    max_tokens: int = Field(1024, ge=1)
    """Traces longer than this (prompt included) are left out of the SFT (and counted)."""
    eval_items: int = Field(100, ge=0)
    """Held-out items measured before and after SFT (0 = no measurement)."""
    eval_samples: int = Field(1, ge=1)
    """Sampled rollouts per held-out item."""
    max_turns: int = Field(5, ge=1)
    """Turn cap of a measured episode."""
    max_new_tokens: int = Field(128, ge=1)
    """Token cap of one measured turn."""
    eval_temperature: float = Field(1.0, gt=0, le=2)
    """Sampling temperature of the measurement (the one to give RL as ``temperature``); any other
    than 1.0 is measured at 1.0 as well, reported beside it (``after_t1``)."""
    measure_base: bool = True
    """Also measure the base model before SFT, on the same items and seeds."""
    measure_greedy: bool = True
    """Also measure the warm-started policy greedily (temperature 0), beside the sampled run."""
    seed: int = Field(0, ge=0)
    """Seeds the trace draws, the batch order and the measurement's sampling."""
    threads: int = Field(0, ge=0)
    """Torch threads of the SFT, 0 = the cores idle when it starts (``auto_threads``); the
    weights depend on it (the order of the sums), so a build that another must pair with gives
    it, and it enters the input hash only when set."""

    @field_validator("env_args", mode="before")
    @classmethod
    def _pairs(cls, v: Any) -> Any:
        """A mapping (JSON's form) or a list of pairs as the sorted tuple the input hash reads."""
        if isinstance(v, dict):
            return tuple(sorted(v.items()))
        return tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _consistent(self) -> "WarmstartConfig":
        if self.family not in warmstart_families():
            raise ValueError(f"warmstart: no trace builder for family {self.family!r}; "
                             f"families: {', '.join(warmstart_families())}")
        if self.eval_split in self.train_splits:
            raise ValueError("warmstart: train_split and eval_split must differ (traces are "
                             "never built from evaluation items)")
        return self

    @property
    def train_splits(self) -> list[str]:
        """``train_split`` as its ``+``-joined parts."""
        parts = [p.strip() for p in self.train_split.split("+")]
        if not all(parts):
            raise ValueError(f"warmstart: train_split={self.train_split!r} has an empty part")
        return parts

    def to_json(self) -> dict[str, Any]:
        d = self.model_dump()
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
