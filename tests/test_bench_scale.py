"""bench/scale.py's routed-prefix count (the prefix-cache figure for engines without counters):
a continuation on the engine that computed its tree hits its whole prompt; on another engine
only what that engine computed of it (here the shared system prompt). No Ray: the routing is
given."""

from __future__ import annotations

from bench.scale import routed_prefix_tokens
from trace_rl.rollout.types import Completion, GenRequest, SamplingSettings

S = SamplingSettings(max_tokens=4)
SYSTEM = (1, 2, 3, 4)


def _trees():
    level0 = [GenRequest(SYSTEM + (10 + t,), 2, S, affinity=f"tree{t}") for t in range(2)]
    outs = [[Completion([20 + t, 30 + j], [0.0, 0.0], "", "stop") for j in range(2)]
            for t in range(2)]
    cont = [GenRequest(r.prompt_ids + tuple(c.token_ids), 1, S, affinity=r.affinity)
            for r, cs in zip(level0, outs) for c in cs]
    return level0, outs, cont


def test_sticky_routing_hits_whole_prompts_and_round_robin_the_shared_part():
    level0, outs, cont = _trees()
    lengths = [len(r.prompt_ids) for r in cont]
    assert lengths == [7, 7, 7, 7]
    # Sticky: tree t on engine t, its continuations too: every prompt token was computed there.
    assert routed_prefix_tokens(2, level0, [0, 1], outs, cont, [0, 0, 1, 1]) == 28
    # Round-robin: continuation 1 of tree 0 lands on engine 1, which computed tree 1: only the
    # shared system prompt (4 tokens) hits; continuation 0 of tree 1 on engine 0 likewise.
    assert routed_prefix_tokens(2, level0, [0, 1], outs, cont, [0, 1, 0, 1]) == 7 + 4 + 4 + 7
    # One engine holds everything: all hit, whatever the order.
    assert routed_prefix_tokens(1, level0, [0, 0], outs, cont, [0, 0, 0, 0]) == 28
    # An engine that computed nothing hits nothing.
    assert routed_prefix_tokens(2, level0, [0, 0], outs, cont[:1], [1]) == 0
