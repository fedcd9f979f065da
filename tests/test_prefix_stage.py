"""Stage 2 in the pipeline (tasks/prefixes.py) on a hand-built step in a real DuckDB store: which
prefixes are offered (the root of an agreeing tree, for TRACE) and that every tree spends m_i N."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from tasks import correlation, prefixes
from tasks.runtime import Paths, StepRef, allocator_for
from trace_core.allocators import root_prefix
from trace_rl.config import config_from_mapping
from trace_rl.rollout.types import Action
from trace_rl.storage import TreeStore
from trace_rl.storage.schema import NODE_INPUT, NODE_INPUT_SCHEMA

RUN = "stage2"


def node(tree, slot, parent, depth, leaf=False, reward=None, **extra):
    row = {c: None for c in NODE_INPUT}
    row.update(tree_id=tree, local_index=slot, parent_index=parent, depth=depth, item_id=f"q{tree}",
               is_leaf=leaf, reward=reward, family="synthetic", text=f"turn {slot}",
               gen_token_ids=[100 + slot], gen_logprobs=[-0.5], obs_token_ids=[] if leaf else [300])
    action = (Action(kind="answer", answer="7") if leaf
              else Action(kind="tool", tool="calculator", arguments={"expression": f"{slot} + 1"}))
    row.update(action_json=json.dumps(action.to_json()), observation=None if leaf else str(slot + 1))
    if parent == -1:
        row.update(gen_token_ids=[], gen_logprobs=[], obs_token_ids=[1, 2, 3], action_json=None,
                   observation=None, text=f"question {tree}", predicted_v=0.5, allocated_k=2)
    row.update(extra)
    return row


# Tree 0: two two-turn bare rollouts, one success and one failure (already mixed).
# Tree 1: two two-turn bare rollouts, both failures (they agree).
# Tree 2: two one-turn bare rollouts (no non-leaf prefix: the fallback spends at the root).
LEVEL0 = [node(0, 0, -1, 0), node(0, 1, 0, 1), node(0, 2, 1, 2, True, 1.0),
          node(0, 3, 0, 1), node(0, 4, 3, 2, True, 0.0),
          node(1, 0, -1, 0), node(1, 1, 0, 1), node(1, 2, 1, 2, True, 0.0),
          node(1, 3, 0, 1), node(1, 4, 3, 2, True, 0.0),
          node(2, 0, -1, 0), node(2, 1, 0, 1, True, 0.0), node(2, 2, 0, 1, True, 0.0)]


@pytest.fixture
def workdir(tmp_path):
    store = TreeStore(Paths(tmp_path).db)
    store.init_run(RUN, {"allocator": "trace"})
    store.write_level(RUN, 0, 0, pa.Table.from_pylist(LEVEL0, schema=NODE_INPUT_SCHEMA), None,
                      dict(method="trace", trajectories=6, prompt_tokens=18, generated_tokens=10,
                           tool_calls=4, wall_seconds=0.1))
    return str(tmp_path)


def _cfg(**over):
    return config_from_mapping({"allocator": "trace", "root_budget": 6, "multiplier": 1,
                                "pool_size": 4, **over})


def _offered(table: pa.Table) -> set[tuple[int, int, float]]:
    return {(r["tree_id"], r["local_index"], -1.0 if math.isnan(r["observed"]) else r["observed"])
            for r in table.to_pylist()}


def test_trace_offers_the_root_of_an_agreeing_tree_only(workdir):
    scored = prefixes.score_prefixes(_cfg(), allocator_for(_cfg().allocation), StepRef(workdir, RUN, 0))
    assert _offered(scored) == {(0, 1, 1.0), (0, 3, 0.0),  # mixed tree: its depth-1 prefixes
                                (1, 1, 0.0), (1, 3, 0.0), (1, 0, 0.0),  # + the agreeing root
                                (2, 0, 0.0)}  # fallback: the root (its rollouts agree)
    chosen = prefixes.allocate_prefixes.fn(_cfg(), allocator_for(_cfg().allocation),
                                           StepRef(workdir, RUN, 0), _roots(), [2, 2, 2, 0]
                                           )[0]  # the task: the scores above, then Stage 2
    assert chosen.drop_columns(["k"]).equals(scored)
    chosen = chosen.to_pylist()
    for t in (0, 1, 2):  # every tree spends exactly m_i N = 2 continuations
        assert sum(r["k"] for r in chosen if r["tree_id"] == t) == 2
    assert [r["k"] for r in chosen if r["tree_id"] == 2] == [2]


def test_the_root_is_not_offered_when_switched_off_or_for_random_prefix(workdir):
    for cfg in (_cfg(branch_from_root=False), _cfg(allocator="random_prefix")):
        scored = prefixes.score_prefixes(cfg, allocator_for(cfg.allocation), StepRef(workdir, RUN, 0))
        assert _offered(scored) == {(0, 1, 1.0), (0, 3, 0.0), (1, 1, 0.0), (1, 3, 0.0), (2, 0, 0.0)}
        chosen = prefixes.choose_prefixes(cfg, allocator_for(cfg.allocation), StepRef(workdir, RUN, 0), scored,
                                              _roots(), [2, 2, 2, 0])[0].to_pylist()
        assert [r["k"] for r in chosen if r["tree_id"] == 2] == [2]  # the fallback spends m_i N


def test_root_prefix():
    assert root_prefix([0.0, 0.0, 0.0]) == 0.0
    assert root_prefix([1, 1]) == 1.0
    assert root_prefix([1.0, 0.0]) is None
    with pytest.raises(ValueError, match="0 or 1"):
        root_prefix([0.5, 0.5])
    assert np.isfinite(root_prefix([1]))


def _continue_tree0(workdir: str) -> TreeStore:
    """Stage 2 of step 0: tree 0's turn-1 node after the success (slot 1, scored 0.8) gets two
    continuations that both fail. Returns the store."""
    from pathlib import Path

    from trace_rl.storage.schema import ALLOCATION_INPUT
    from trace_rl.storage.store import make_node_id

    store = TreeStore(Paths(Path(workdir)).db)
    conts = [node(0, 5, 1, 2, True, 0.0), node(0, 6, 1, 2, True, 0.0)]
    alloc = pa.Table.from_pylist(
        [{"node_id": make_node_id(RUN, 0, 0, 1), "allocator": "trace", "k": 2, "item_id": "q0",
          "predicted_v": 0.8, "true_v": None, "gain": None}],
        schema=pa.schema([(k, t) for k, (t, _) in ALLOCATION_INPUT.items()]))
    store.write_level(RUN, 0, 1, pa.Table.from_pylist(conts, schema=NODE_INPUT_SCHEMA), alloc,
                      dict(method="trace", trajectories=2, prompt_tokens=6, generated_tokens=2,
                           tool_calls=0, wall_seconds=0.1))
    return store


def test_outcome_correlation_reads_the_stored_window(workdir):
    """Step 0 plus Stage 2 of tree 0: its turn-1 node after the success (slot 1, scored 0.8) got
    two continuations that both failed. At step 1 the estimate reads step 0: roots 1 - (1 + 0 + 0)
    / (3 x 0.5) = 1/3 (tree 0 mixed, trees 1 and 2 agree); the prefix 1 - 2 / (2 x 0.2) < 0 -> 0."""
    _continue_tree0(workdir)
    on = {"correlation_window": 4}
    rho = correlation.outcome_correlation(_cfg(**on, correlation_min_terms=1), allocator_for(_cfg(**on, correlation_min_terms=1).allocation), workdir, RUN, 1)
    assert rho.at(0) == pytest.approx(1 / 3)
    assert rho.at(1) == 0.0 and rho.evidence == {0: 3, 1: 1}
    # Off, at step 0 (nothing stored before it) and for a method without a predictor: no estimate.
    for cfg, step in ((_cfg(correlation_window=0), 1), (_cfg(**on), 0), (_cfg(**on, allocator="grpo"), 1)):
        assert correlation.outcome_correlation(cfg, allocator_for(cfg.allocation), workdir, RUN, step).evidence == {}
    # Too little evidence for the default minimum: 0 (the paper's formulas).
    assert correlation.outcome_correlation(_cfg(**on), allocator_for(_cfg(**on).allocation), workdir, RUN, 1).at(0) == 0.0


def test_a_thin_window_is_widened_not_dropped(workdir):
    """Step 0 holds the only continued prefix; steps 1-4 hold bare rollouts only. At step 5 a
    window of 2 steps has no prefix evidence: it is widened (2 -> 4 -> 8 steps, capped at step 0)
    until it reaches step 0's, instead of reading rho = 0 for the prefixes."""
    store = _continue_tree0(workdir)
    ledger = dict(method="trace", trajectories=6, prompt_tokens=6, generated_tokens=2, tool_calls=0,
                  wall_seconds=0.1)
    for step in range(1, 5):
        store.write_level(RUN, step, 0, pa.Table.from_pylist(LEVEL0, schema=NODE_INPUT_SCHEMA), None,
                          ledger)
    cfg = _cfg(correlation_window=2, correlation_min_terms=1)
    rho = correlation.outcome_correlation(cfg, allocator_for(cfg.allocation), workdir, RUN, 5)
    assert rho.evidence[1] == 1 and rho.evidence[0] == 15  # 5 steps x 3 roots
    # Prompt-level allocation never branches: its window is not widened for prefix evidence.
    rho = correlation.outcome_correlation(_cfg(allocator="prompt_only", correlation_window=2,
                                               correlation_min_terms=1), allocator_for(_cfg(allocator="prompt_only", correlation_window=2,
                                               correlation_min_terms=1).allocation), workdir, RUN, 5)
    assert rho.evidence == {0: 6}


def test_scored_prefixes_carry_rho_and_what_was_seen(workdir):
    rows = prefixes.score_prefixes(_cfg(), allocator_for(_cfg().allocation), StepRef(workdir, RUN, 0)).to_pylist()
    assert {r["correlation"] for r in rows} == {0.0}  # step 0: nothing stored before it
    seen = {(r["tree_id"], r["local_index"]): r["seen"] for r in rows}
    assert seen[(1, 0)] == 2  # the agreeing root: both bare rollouts failed
    assert seen[(0, 1)] == seen[(1, 3)] == 1  # a prefix: the one bare rollout through it


def _roots(n=4, v=0.5):
    return pa.table({"item_id": [f"q{i}" for i in range(n)], "predicted_v": [v] * n,
                     "staleness": [0.0] * n, "correlation": [0.0] * n})


def test_joint_split_spends_the_rest_of_the_budget_on_prefixes_or_fresh_prompts(workdir):
    """Six leaves left after the bare rollouts of trees 0-2 (pool candidates 0-2); candidate 3 is
    fresh. Read as independent draws, the prefixes' flip chances (all predicted 0.5 by the
    untrained predictor) win; when the store says prefix outcomes are correlated, the fresh
    prompt takes a pair. Either way the six leaves are spent and used candidates get nothing."""
    cfg = _cfg(joint_split=True)
    scored = prefixes.score_prefixes(cfg, allocator_for(cfg.allocation), StepRef(workdir, RUN, 0))
    chosen, fresh = prefixes.choose_prefixes(cfg, allocator_for(cfg.allocation), StepRef(workdir, RUN, 0), scored, _roots(), [2, 2, 2, 0])
    k = {(r["tree_id"], r["local_index"]): r["k"] for r in chosen.to_pylist()}
    m = fresh.column("m").to_pylist()
    assert sum(k.values()) + sum(m) == 6 and m[:3] == [0, 0, 0]
    assert m[3] == 0  # q = 0.5 per prefix: a continuation flips with chance 1/2 > 1/4 per leaf
    correlated = scored.set_column(scored.schema.get_field_index("correlation"), "correlation",
                                   pa.array([0.0 if d == 0 else 0.9 for d in
                                             scored.column("depth").to_pylist()], pa.float64()))
    chosen, fresh = prefixes.choose_prefixes(cfg, allocator_for(cfg.allocation), StepRef(workdir, RUN, 0), correlated, _roots(), [2, 2, 2, 0])
    k = {(r["tree_id"], r["local_index"]): r["k"] for r in chosen.to_pylist()}
    m = fresh.column("m").to_pylist()
    assert sum(k.values()) + sum(m) == 6 and m[3] >= 2
    assert k[(0, 1)] == k[(0, 3)] == 0  # depth-1 prefixes repeat their outcome 95% of the time


def test_joint_split_never_offers_a_mixed_root(workdir):
    """A tree with no prefix whose bare rollouts are mixed (observed NaN) gets nothing jointly:
    more rollouts from it cannot make it mixed."""
    cfg = _cfg(joint_split=True)
    scored = prefixes.score_prefixes(cfg, allocator_for(cfg.allocation), StepRef(workdir, RUN, 0))
    mixed = scored.set_column(scored.schema.get_field_index("observed"), "observed",
                              pa.array([float("nan") if t == 2 else o for t, o in zip(
                                  scored.column("tree_id").to_pylist(),
                                  scored.column("observed").to_pylist())], pa.float64()))
    chosen, _ = prefixes.choose_prefixes(cfg, allocator_for(cfg.allocation), StepRef(workdir, RUN, 0), mixed, _roots(), [2, 2, 2, 0])
    assert [r["k"] for r in chosen.to_pylist() if r["tree_id"] == 2] == [0]


def test_tree_advantages_count_a_continued_turn_once_when_asked(workdir):
    """After Stage 2 tree 0's turn 1 (slot 1) lies on three paths (its bare rollout's success and
    two failed continuations): with ``count_turns_once`` each of its pushes is a third of what it
    is without; turns on one path, and trees without continuations, are unchanged."""
    from tasks import learn

    _continue_tree0(workdir)
    rows = {}
    for once in (False, True):
        table = learn.tree_advantages.fn(_cfg(count_turns_once=once), StepRef(workdir, RUN, 0)).to_pylist()
        rows[once] = {r["leaf_id"]: (r["path"], r["advantages"]) for r in table}
    assert rows[False].keys() == rows[True].keys() and len(rows[True]) == 8
    sharing = Counter(path[1] for path, _ in rows[False].values())  # paths through each turn 1
    assert sorted(sharing.values()) == [1, 1, 1, 1, 1, 3]  # tree 0's slot 1 carries three paths
    for leaf, (path, plain) in rows[False].items():
        _, once = rows[True][leaf]
        assert len(plain) == len(path) - 1
        assert once[0] == pytest.approx(plain[0] / sharing[path[1]])
        assert once[1:] == pytest.approx(plain[1:])  # turn 2 lies on one path
