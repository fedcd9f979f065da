"""Synthetic task families that a model of a few million parameters can learn on a CPU: multi-hop
lookup (``synth_lookup``), arithmetic with a calculator (``synth_arith``) and function calling
against JSON schemas (``synth_fncall``), each with a difficulty knob and seeded train/test splits,
and relation chains with per-item hazards (``synth_chain``, its own generator options)."""

from trace_rl.envs.synthetic.arith import SynthArith, calculate
from trace_rl.envs.synthetic.chain import ChainConfig, SynthChain
from trace_rl.envs.synthetic.common import SynthConfig, SyntheticEnv, check_arguments
from trace_rl.envs.synthetic.fncall import SynthFncall
from trace_rl.envs.synthetic.lookup import SynthLookup

FAMILIES: dict[str, type[SyntheticEnv]] = {
    SynthLookup.family: SynthLookup, SynthArith.family: SynthArith, SynthFncall.family: SynthFncall,
    SynthChain.family: SynthChain}

__all__ = ["ChainConfig", "FAMILIES", "SynthArith", "SynthChain", "SynthConfig", "SynthFncall", "SynthLookup", "SyntheticEnv",
           "calculate", "check_arguments"]
