"""tasks/expand.py with the tiny test policy on the HF engine and a real DuckDB store: bare
rollouts grow one tree per allocated candidate with exactly m_i leaves, refill waves number their
trees after the earlier waves', continuations hang K leaves below the chosen stored prefix, and
persisting a level twice leaves one copy."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from tasks import expand, runtime
from tasks.runtime import StepRef
from trace_rl.config import TrainConfig
from trace_rl.rollout.treeio import StepTrees

RUN = "expand"


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return TrainConfig(engine="hf", family="synth_arith", difficulty=1, max_turns=2,
                       max_new_tokens=16, pool_size=4, root_budget=4, multiplier=1,
                       policy=str(tiny_model_dir), run_name=RUN, plot_every=0, eval_items=0)


@pytest.fixture(scope="module")
def level0(cfg, tmp_path_factory):
    """Step 0's bare rollouts: candidates 0 and 2 get 2 and 3 rollouts, candidate 1 none."""
    items = sorted(runtime.items_for(cfg, cfg.train_split))[:3]
    allocation = pa.table({"item_id": items, "m": [2, 0, 3], "predicted_v": [0.5, 0.1, 0.9]})
    workdir = str(tmp_path_factory.mktemp("expand"))
    out = expand.roots_level(cfg, StepRef(workdir, RUN, 0), cfg.policy, allocation)
    runtime.store(workdir).init_run(RUN, {})
    return workdir, items, out


def test_bare_rollouts_grow_one_tree_of_m_leaves_per_candidate(cfg, level0):
    _, items, out = level0
    trees = StepTrees(out["nodes"].append_column("level", pa.array([0] * out["nodes"].num_rows)))
    assert trees.tree_ids.tolist() == [0, 2]
    leaves = np.bincount(trees.tree_of_row[trees.batch.leaves]).tolist()
    assert leaves == [2, 3]
    roots = trees.offsets[:-1]
    assert [trees.column("allocated_k")[r] for r in roots] == [2, 3]
    assert trees.floats("predicted_v")[roots].tolist() == [0.5, 0.9]
    questions = runtime.items_for(cfg, cfg.train_split)
    assert [trees.column("text")[r] for r in roots] == [questions[items[0]].question,
                                                        questions[items[2]].question]
    # Leaves carry 0/1 rewards, internal nodes none; no episode is longer than max_turns.
    reward = out["nodes"].column("reward").to_pylist()
    assert all((r in (0.0, 1.0)) == leaf for r, leaf in zip(reward, trees.is_leaf))
    assert trees.depth.max() <= cfg.max_turns
    # The whole Stage 1 decision is stored, the filtered candidate with k = 0.
    a = out["allocations"]
    assert a.column("tree_id").to_pylist() == [0, 2, 1] and a.column("k").to_pylist() == [2, 3, 0]
    assert a.column("item_id").to_pylist() == [items[0], items[2], items[1]]
    assert out["ledger"]["trajectories"] == 5 and out["ledger"]["method"] == "trace"


def test_a_refill_wave_numbers_its_trees_after_the_pool(cfg, level0):
    workdir, items, _ = level0
    allocation = pa.table({"item_id": items[:2], "m": [0, 2], "predicted_v": [0.5, None]})
    out = expand.roots_level(cfg, StepRef(workdir, RUN, 0), cfg.policy, allocation, wave=1)
    assert set(out["nodes"].column("tree_id").to_pylist()) == {cfg.pool_size + 1}
    assert out["allocations"].column("tree_id").to_pylist() == [cfg.pool_size + 1]
    assert out["ledger"]["method"] == "trace:refill1" and out["ledger"]["trajectories"] == 2


def test_persist_then_continue_from_stored_prefixes(cfg, level0):
    workdir, _, out = level0
    assert expand.persist(StepRef(workdir, RUN, 0), 0, out) == out["nodes"].num_rows
    assert expand.persist(StepRef(workdir, RUN, 0), 0, out) == 0  # a retry adds nothing
    store = runtime.store(workdir)
    stored = store.query("SELECT node_id, k FROM allocations WHERE run_id = $r ORDER BY node_id",
                         {"r": RUN}).to_pylist()
    assert stored == [{"node_id": f"{RUN}/s0/t{t}/n0", "k": k} for t, k in ((0, 2), (1, 0), (2, 3))]
    trees = StepTrees(store.read_step(RUN, 0))
    # Continue tree 2 from its root (K = 2) and, where its first rollout has a first turn that
    # is not the leaf, from that turn too (K = 1); tree 0 is chosen with K = 0.
    first = int(trees.offsets[1]) + 1
    picks = [(2, 0, 0, 2)] + ([(2, 1, 1, 1)] if not trees.is_leaf[first] else []) + [(0, 0, 0, 0)]
    chosen = pa.table({"tree_id": [p[0] for p in picks], "local_index": [p[1] for p in picks],
                       "depth": [p[2] for p in picks], "item_id": [trees.column("item_id")[
                           trees.offsets[0 if p[0] == 0 else 1]] for p in picks],
                       "predicted_v": [0.4] * len(picks), "k": [p[3] for p in picks]})
    level1 = expand.prefixes_level(cfg, StepRef(workdir, RUN, 0), cfg.policy, chosen)
    new = level1["nodes"]
    size = len(trees.rows(1))
    assert set(new.column("tree_id").to_pylist()) == {2}
    assert new.column("local_index").to_pylist() == list(range(size, size + new.num_rows))
    assert level1["ledger"]["trajectories"] == sum(p[3] for p in picks)
    expand.persist(StepRef(workdir, RUN, 0), 1, level1)
    grown = StepTrees(store.read_step(RUN, 0))
    tree = grown.batch.select([1])
    below = np.zeros(len(tree.parent), dtype=np.int64)  # new leaves under each chosen node
    for leaf in np.flatnonzero(tree.is_leaf & (grown.level[grown.rows(1)] == 1)):
        path = grown.batch.path(int(grown.offsets[1] + leaf))
        assert grown.level[path[-1]] == 1
        for r in path:
            below[r - grown.offsets[1]] += 1
        # A continuation's first new node hangs on a chosen prefix at depth + 1.
        start = next(r for r in path if grown.level[r] == 1) - grown.offsets[1]
        assert (tree.parent[start], tree.depth[start]) in {(p[1], p[2] + 1) for p in picks[:-1]}
    assert below[0] == sum(p[3] for p in picks) and (len(picks) == 2 or below[1] == 1)
    assert len(grown.rows(0)) == len(trees.rows(0))  # K = 0: tree 0 is untouched
    with pytest.raises(ValueError, match=r"no stored tree has id \[3\]"):
        expand.prefixes_level(cfg, StepRef(workdir, RUN, 0), cfg.policy,
                              chosen.set_column(0, "tree_id", pa.array([3] * len(picks))))
