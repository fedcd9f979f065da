"""``synth_chain``: multi-hop relation chains with per-item hazards (``env``). Its generator's
parameters are its own options (``options.ChainOptions``: ``chain_*``), and it bootstraps the
tiny policy with its own SFT schedule."""

from trace_rl.envs.registry import Bootstrap, family
from trace_rl.envs.synth_chain.env import SynthChain, expert_thoughts
from trace_rl.envs.synth_chain.options import ChainOptions
from trace_rl.envs.synthetic import SynthConfig

BOOTSTRAP = Bootstrap(
    thoughts=expert_thoughts,
    settings={"sft_examples": 800, "sft_epochs": 12, "split_names": True},
    variants=(({"chain_facts": 1, "chain_syllables": 1},
               {"sft_examples": 22400, "sft_epochs": 2}),))
"""The traces are 3-4x longer than arith's: half the traces per epoch measures the policy twice
as often, so SFT stops nearer the first epoch in the target; names are copied from question to
thought to query, so they must be the same tokens everywhere (``split_names``). The variant with
one fact per hop and one-syllable names (``chain_facts=1 chain_syllables=1``) learns to copy
names only after ~700 SFT steps of fresh traces, with the cosine planned over 2,800 (22,400
traces x 2 epochs; measured 2026-12-03: held-out sampled success 0.57-0.60 after epoch 1, where
1,600 traces repeated per epoch stayed at 0.06-0.17 through epoch 9)."""


@family("synth_chain", options=ChainOptions, generated=True, bootstrap=BOOTSTRAP)
def make(**kwargs) -> SynthChain:
    own = {k: kwargs.pop(k) for k in list(kwargs) if k in ChainOptions.model_fields}
    return SynthChain(SynthConfig(**kwargs), ChainOptions(**own))
