"""``synth_arith``: arithmetic word problems solved with a ``calculator`` (``env``); the default
family of ``trace train``. Its expert restates each step before the call that applies it
(``expert_thoughts``), which the tiny policy's bootstrap writes as its thoughts."""

from trace_rl.envs.registry import Bootstrap, family
from trace_rl.envs.synth_arith.env import SynthArith, expert_thoughts
from trace_rl.envs.synthetic import SynthConfig


@family("synth_arith", generated=True, bootstrap=Bootstrap(thoughts=expert_thoughts))
def make(**kwargs) -> SynthArith:
    return SynthArith(SynthConfig(**kwargs))
