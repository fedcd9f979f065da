"""``synth_lookup``: multi-hop lookup over a knowledge base generated per item (``env``)."""

from trace_rl.envs.registry import Bootstrap, family
from trace_rl.envs.synth_lookup.env import SynthLookup
from trace_rl.envs.synthetic import SynthConfig


@family("synth_lookup", generated=True, bootstrap=Bootstrap())
def make(**kwargs) -> SynthLookup:
    return SynthLookup(SynthConfig(**kwargs))
