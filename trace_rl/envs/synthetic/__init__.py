"""Synthetic task families that a model of a few million parameters can learn on a CPU: multi-hop
lookup (``synth_lookup``), arithmetic with a calculator (``synth_arith``) and function calling
against JSON schemas (``synth_fncall``), each with a difficulty knob and seeded train/test splits."""

from trace_rl.envs.synthetic.arith import SynthArith, calculate
from trace_rl.envs.synthetic.common import SynthConfig, SyntheticEnv, check_arguments
from trace_rl.envs.synthetic.fncall import SynthFncall
from trace_rl.envs.synthetic.lookup import SynthLookup

FAMILIES: dict[str, type[SyntheticEnv]] = {
    SynthLookup.family: SynthLookup, SynthArith.family: SynthArith, SynthFncall.family: SynthFncall}

__all__ = ["FAMILIES", "SynthArith", "SynthConfig", "SynthFncall", "SynthLookup", "SyntheticEnv",
           "calculate", "check_arguments"]
