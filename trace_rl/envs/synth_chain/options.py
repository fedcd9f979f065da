"""synth_chain's own options: its generator's parameters (``ChainOptions``), each declared once.

A train config set to ``family=synth_chain`` takes them by these names (``chain_hops=2:1``,
``synth_chain.chain_hops=2:1``, or a ``synth_chain:`` section of a YAML file), and the family's
factory gets them as keyword arguments; another family refuses them unless at their defaults.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator

from trace_rl.settings import Settings


def parse_hops(text: str) -> dict[int, float]:
    """``"2:0.35,3:0.40,4:0.25"`` -> {2: .35, 3: .40, 4: .25}, normalised to sum 1. Raises
    ``ValueError`` naming ``chain_hops`` and what is wrong."""
    out: dict[int, float] = {}
    for part in str(text).split(","):
        hop, sep, weight = part.strip().partition(":")
        try:
            h, w = int(hop), float(weight)
        except ValueError:
            raise ValueError(f"chain_hops={text!r}: each entry must be HOPS:WEIGHT, e.g. "
                             f"'2:0.35,3:0.40,4:0.25' (bad entry {part.strip()!r})") from None
        if not sep or not 1 <= h <= 8 or not (math.isfinite(w) and w >= 0) or h in out:
            raise ValueError(f"chain_hops={text!r}: entry {part.strip()!r} needs hops in 1..8 "
                             "(each once) and a weight >= 0")
        out[h] = w
    total = sum(out.values())
    if total <= 0:
        raise ValueError(f"chain_hops={text!r}: the weights must not all be 0")
    return {h: w / total for h, w in sorted(out.items())}


class ChainOptions(Settings):
    """synth_chain's generator parameters, which no other family takes."""

    chain_hops: str = Field("2:0.35,3:0.40,4:0.25",
                            pattern=r"^\s*\d+\s*:\s*[0-9.]+\s*(,\s*\d+\s*:\s*[0-9.]+\s*)*$")
    """synth_chain: hop distribution of the items, ``HOPS:WEIGHT`` entries (normalised)."""
    chain_hazard_a: float = Field(0.5, gt=0)
    """synth_chain: a of the Beta(a, b) that draws each item's hazard rate (aliases and
    homonyms along its chain)."""
    chain_hazard_b: float = Field(1.0, gt=0)
    """synth_chain: b of that Beta(a, b)."""
    chain_alias_share: float = Field(0.5, ge=0, le=1)
    """synth_chain: share of the hazards that are aliases (recoverable: a retry costs a turn),
    the rest homonyms (unrecoverable: the wrong copy derails the chain)."""
    chain_train_items: int = Field(256, ge=1)
    """synth_chain: items of the train split that the pool prompts are drawn from."""
    chain_facts: int = Field(2, ge=1, le=2)
    """synth_chain: facts per record, 2 (a record also lists another relation, so the agent must
    pick the question's k-th) or 1 (only the chain's relation; the hazards alone keep the
    outcome open)."""
    chain_syllables: int = Field(2, ge=1, le=2)
    """synth_chain: syllables per name, 2 (256 names like "Kalo", two tokens each for the tiny
    policy) or 1 (the 16 names like "Ka", one token each; an alias is written "Ka-")."""

    @field_validator("chain_hops")
    @classmethod
    def _hops(cls, v: Any) -> Any:
        parse_hops(v)  # hops in 1..8, each once, weights not all 0
        return v
