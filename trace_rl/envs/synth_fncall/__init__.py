"""``synth_fncall``: function calling against JSON tool schemas, graded on the final state
(``env``); so ``trace score`` replays a prediction's calls and grades the state they leave."""

from trace_rl.envs.registry import Bootstrap, family
from trace_rl.envs.synth_fncall.env import SynthFncall
from trace_rl.envs.synthetic import SynthConfig


@family("synth_fncall", generated=True, bootstrap=Bootstrap(), score_by_replay=True)
def make(**kwargs) -> SynthFncall:
    return SynthFncall(SynthConfig(**kwargs))
