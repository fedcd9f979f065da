"""What determines a bootstrapped tiny policy: ``BootstrapConfig`` (all of it enters the input
hash), read with a family's own settings (``family_config``: those it registered), and the
names and version of the cached result."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trace_rl.envs.registry import spec
from trace_rl.policy.tiny import PRESETS

RECORD = "bootstrap.json"
"""Name of the record written next to the weights."""
RECIPE_VERSION = 4
"""Part of the input hash: bump when the recipe changes so cached policies are rebuilt."""


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


def family_config(family: str, *, difficulty: int, preset: str, seed: int,
                  sft_examples: int | None, sft_epochs: int | None,
                  target_success: tuple[float, float], **settings: Any) -> BootstrapConfig:
    """The ``BootstrapConfig`` of ``family``: the given settings over those of its variant
    (chosen by ``settings["options"]``) over its own (``Bootstrap.settings`` and ``.variants``,
    registered with the family) over the defaults (``sft_examples``/``sft_epochs`` None: the
    family's, else the default). ``TypeError`` naming the known settings for an unknown one."""
    recipe = spec(family).bootstrap
    own = dict(recipe.settings) if recipe is not None else {}
    given = dict(settings.get("options", ()))
    for needs, extra in recipe.variants if recipe is not None else ():
        if all(given.get(k) == v for k, v in needs.items()):
            own |= extra
    sft_examples = sft_examples or own.get("sft_examples", BootstrapConfig.sft_examples)
    sft_epochs = sft_epochs or own.get("sft_epochs", BootstrapConfig.sft_epochs)
    settings = {k: v for k, v in own.items() if k not in ("sft_examples", "sft_epochs")} | settings
    try:
        return BootstrapConfig(family=family, difficulty=difficulty, preset=preset, seed=seed,
                               sft_examples=sft_examples, sft_epochs=sft_epochs,
                               target_success=tuple(target_success), **settings)
    except TypeError as exc:
        fields = sorted(f.name for f in dataclasses.fields(BootstrapConfig))
        raise TypeError(f"bootstrap_policy: {exc}; known settings: {fields}") from None
