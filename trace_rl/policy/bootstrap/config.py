"""What determines a bootstrapped tiny policy: ``BootstrapConfig`` (all of it enters the input
hash), read with a family's own settings (``family_config``: those it registered), and the
names and version of the cached result."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from trace_rl.envs.registry import spec
from trace_rl.policy.tiny import PRESETS
from trace_rl.settings import Settings

RECORD = "bootstrap.json"
"""Name of the record written next to the weights."""
RECIPE_VERSION = 4
"""Part of the input hash: bump when the recipe changes so cached policies are rebuilt."""


class BootstrapConfig(Settings):
    """Everything that determines a bootstrapped policy (all of it enters the input hash): a
    ``trace_rl.settings.Settings`` model, as ``trace_rl.config.TrainConfig``'s sections are,
    whose ``family``, ``difficulty`` and generator options the train flow gives from its
    config."""

    family: str
    """Task family name in the environment registry (e.g. ``synth_arith``)."""
    difficulty: int = Field(ge=1)
    """Family difficulty of the SFT traces and the held-out measurement (no default: the caller's
    config says it)."""
    mix: tuple[int, ...] = ()
    """Item difficulties taken in turn (``SynthConfig.mix``); empty = all at ``difficulty``."""
    options: tuple[tuple[str, Any], ...] = ()
    """The family's generator options as (name, value) pairs (``TrainConfig.family_options``);
    empty = the family's defaults."""
    preset: str = "tiny"
    """Model shape, a key of ``trace_rl.policy.tiny.PRESETS``."""
    seed: int = Field(0, ge=0)
    """Seeds item order, corruption draws, model init and the measurement rollouts."""
    sft_examples: int = Field(1600, ge=1)
    """Training traces per epoch (train-split items; clean and noisy together)."""
    sft_epochs: int = Field(8, ge=1)
    """Most SFT epochs; training stops earlier once the measured success is in ``target_success``."""
    target_success: tuple[float, float] = (0.3, 0.7)
    """Sampled success range (temperature 1, held-out) at which SFT stops."""
    noise: float = Field(0.25, ge=0, lt=1)
    """Fraction of SFT traces that are deliberately imperfect (one of ``CORRUPTIONS``)."""
    vocab_size: int = 1024
    """BPE vocabulary size, special and marker tokens included."""
    split_digits: bool = True
    """One token per digit (``build_tokenizer(split_digits=...)``), so numbers copy token by token."""
    split_names: bool = False
    """A space before a capitalised word is a token of its own, so a name is the same tokens in
    the question, a thought, a query and an observation (``build_tokenizer(split_names=...)``)."""
    tokenizer_items: int = Field(500, ge=1)
    """Train items whose expert conversations the tokenizer is trained on."""
    batch_size: int = Field(16, ge=1)
    """Traces per optimiser step."""
    learning_rate: float = Field(2e-3, gt=0)
    """Peak AdamW learning rate (linear warm-up, then cosine decay over all planned steps)."""
    warmup_steps: int = Field(30, ge=0)
    """Steps of linear learning-rate warm-up."""
    eval_items: int = Field(48, ge=1)
    """Held-out test items measured after each epoch to decide when to stop."""
    report_items: int = Field(96, ge=1)
    """Further held-out test items (disjoint from ``eval_items``) for the recorded success rates."""

    @field_validator("mix", "options", "target_success", mode="before")
    @classmethod
    def _tuples(cls, v: Any) -> Any:
        """A list (JSON's form) or a mapping of options as the tuple the input hash reads."""
        if isinstance(v, dict):
            return tuple(v.items())
        return tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _known(self) -> "BootstrapConfig":
        lo, hi = self.target_success
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"BootstrapConfig.target_success={self.target_success}: need "
                             "0 <= low <= high <= 1")
        if self.preset not in PRESETS:
            raise ValueError(f"BootstrapConfig.preset={self.preset!r}: choose one of {sorted(PRESETS)}")
        return self

    def to_json(self) -> dict[str, Any]:
        d = self.model_dump()
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


def family_config(family: str, *, difficulty: int, **settings: Any) -> BootstrapConfig:
    """The ``BootstrapConfig`` of ``family``: the given settings (None: not given) over those of
    its variant (chosen by ``settings["options"]``) over its own (``Bootstrap.settings`` and
    ``.variants``, registered with the family) over the defaults. ``TypeError`` naming the known
    settings for an unknown one."""
    recipe = spec(family).bootstrap
    own = dict(recipe.settings) if recipe is not None else {}
    given = dict(settings.get("options", ()))
    for needs, extra in recipe.variants if recipe is not None else ():
        if all(given.get(k) == v for k, v in needs.items()):
            own |= extra
    own |= {k: v for k, v in settings.items() if v is not None}
    try:
        return BootstrapConfig(family=family, difficulty=difficulty, **own)
    except ValidationError as exc:
        unknown = [str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden"]
        if unknown:
            raise TypeError(f"bootstrap_policy: unknown settings {unknown}; known settings: "
                            f"{sorted(BootstrapConfig.model_fields)}") from None
        raise
