"""trace_rl.rollout.treeio: episodes written as columns (LevelBatch) into a real DuckDB store and
read back as columns (StepTrees): the trees, paths, histories and replayed turns must be exactly
what went in, and malformed input is refused with the tree or row named."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from trace_rl.rollout.treeio import LevelBatch, StepTrees, history_text
from trace_rl.rollout.types import Action, Episode, Turn
from trace_rl.storage import TreeStore

RUN = "treeio"
LEDGER = dict(method="trace", trajectories=1, prompt_tokens=1, generated_tokens=1, tool_calls=0,
              wall_seconds=0.0)


def turn(n: int, final: bool = False) -> Turn:
    """Turn ``n``: a calculator call observed as ``n + 1``, or (final) the answer ``n``."""
    if final:
        return Turn(gen_ids=[500 + n], gen_logprobs=[-0.25], text=f"answer {n}",
                    action=Action(kind="answer", answer=str(n)), obs_text=None, obs_ids=[])
    return Turn(gen_ids=[100 + n, 101 + n], gen_logprobs=[-0.5, -1.5], text=f"call {n}",
                action=Action(kind="tool", tool="calculator", arguments={"expression": f"{n}+1"}),
                obs_text=str(n + 1), obs_ids=[300 + n], tool_called=True, error=n == 7)


def episode(turns: list[Turn], reward: float, prefix: int = 0) -> Episode:
    return Episode(item_id="q", prompt_ids=[1, 2, 3], turns=turns, done=True, reward=reward,
                   prefix_turns=prefix)


@pytest.fixture
def store(tmp_path):
    s = TreeStore(tmp_path)
    s.init_run(RUN, {})
    return s


def level0(store: TreeStore) -> LevelBatch:
    """Tree 3: rollouts (call 1, answer 2) -> 1.0 and (call 7, call 8, answer 9) -> 0.0.
    Tree 5: one rollout (answer 4) -> 0.0. Written in the order 5, 3 (the batch sorts)."""
    batch = LevelBatch("synth_arith", "trace")
    batch.open_tree(5, "q5")
    batch.add_root(5, [9, 9], "question five", 0.25, 1)
    assert batch.add_episode(5, 0, 0, episode([turn(4, True)], 0.0)) == 1
    batch.open_tree(3, "q3")
    assert batch.add_root(3, [1, 2, 3], "question three", 0.5, 2) == 0
    assert batch.add_episode(3, 0, 0, episode([turn(1), turn(2, True)], 1.0)) == 2
    assert batch.add_episode(3, 0, 0, episode([turn(7), turn(8), turn(9, True)], 0.0)) == 5
    store.write_level(RUN, 0, 0, batch.table(), ledger=LEDGER)
    return batch


def test_a_level_is_written_as_columns_and_read_back_as_trees(store):
    batch = level0(store)
    table = batch.table()
    assert table.column("tree_id").to_pylist() == [3] * 6 + [5] * 2
    assert table.column("local_index").to_pylist() == [0, 1, 2, 3, 4, 5, 0, 1]
    trees = StepTrees(store.read_step(RUN, 0))
    assert trees.tree_ids.tolist() == [3, 5] and trees.offsets.tolist() == [0, 6, 8]
    tree = trees.batch.select([0])
    assert tree.parent.tolist() == [-1, 0, 1, 0, 3, 4]
    assert tree.depth.tolist() == [0, 1, 2, 1, 2, 3]
    np.testing.assert_array_equal(tree.reward, [np.nan, np.nan, 1.0, np.nan, np.nan, 0.0])
    assert trees.batch.select([1]).parent.tolist() == [-1, 0]
    # Rows keep what the episodes said: tokens, log-probs, the action, the root's prompt.
    assert trees.column("obs_token_ids")[0] == [1, 2, 3] and trees.column("gen_token_ids")[0] == []
    assert trees.column("gen_logprobs")[4] == [-0.5, -1.5] and trees.column("error")[3]
    assert trees.column("allocated_k")[0] == 2 and trees.floats("predicted_v")[6] == 0.25
    assert trees.column("item_id")[7] == "q5" and trees.column("family")[7] == "synth_arith"


def test_paths_histories_and_replayed_turns_come_from_the_parent_array(store):
    level0(store)
    trees = StepTrees(store.read_step(RUN, 0))
    assert trees.batch.path(5) == [0, 3, 4, 5] and trees.batch.path(7) == [6, 7]
    assert trees.batch.leaf_below().tolist() == [2, 2, 2, 5, 5, 5, 7, 7]
    assert trees.history(4) == history_text("question three", [turn(7), turn(8)])
    assert trees.history(4) == "Q: question three\ncall 7\nObs: 8\ncall 8\nObs: 9"
    assert trees.history(6) == "Q: question five"
    assert trees.turns(4) == [turn(7), turn(8)] and trees.turns(0) == []


def test_a_continuation_appends_after_the_stored_rows(store):
    level0(store)
    trees = StepTrees(store.read_step(RUN, 0))
    batch = LevelBatch("synth_arith", "trace")
    batch.open_tree(3, "q3", first_index=len(trees.rows(0)))
    # Two continuations from node 3 (depth 1): the replayed turn is not written again.
    assert batch.add_episode(3, 3, 1, episode([turn(7), turn(5, True)], 1.0, prefix=1)) == 6
    assert batch.add_episode(3, 3, 1, episode([turn(7), turn(6), turn(2, True)], 1.0, 1)) == 8
    store.write_level(RUN, 0, 1, batch.table())
    grown = StepTrees(store.read_step(RUN, 0))
    tree = grown.batch.select([0])
    assert tree.parent.tolist() == [-1, 0, 1, 0, 3, 4, 3, 3, 7]
    assert grown.level[:9].tolist() == [0] * 6 + [1] * 3
    value, n = tree.backup()
    assert value[3] == pytest.approx(2 / 3) and n[3] == 3 and value[0] == pytest.approx(3 / 4)


def test_predictor_examples_are_the_backed_up_internal_nodes(store):
    level0(store)
    trees = StepTrees(store.read_step(RUN, 0))
    ids = trees.table.column("node_id")
    # Back up tree 3 only: tree 5's nodes keep a null value and give no example.
    value, n = trees.batch.select([0]).backup()
    store.update_values(RUN, 0, pa.table({"node_id": ids.slice(0, 6), "value": value,
                                          "n_leaves": n}))
    hist, y, w = StepTrees(store.read_step(RUN, 0)).predictor_examples()
    assert hist == [trees.history(r) for r in (0, 1, 3, 4)]
    assert y.tolist() == [0.5, 1.0, 0.0, 0.0] and w.tolist() == [2, 1, 1, 1]


def test_allocation_scores_read_roots_from_stage1_and_prefixes_from_stage2(store):
    level0(store)
    trees = StepTrees(store.read_step(RUN, 0))
    node = trees.table.column("node_id").to_pylist()
    scores = pa.table({"node_id": [node[3], node[1]], "predicted_v": [0.75, None]})
    got = trees.allocation_scores(scores)
    np.testing.assert_array_equal(got, [0.5, np.nan, np.nan, 0.75, np.nan, np.nan, 0.25, np.nan])


def test_bad_input_is_refused_naming_it(store):
    batch = LevelBatch("f", "trace")
    with pytest.raises(ValueError, match="tree 4 is not open"):
        batch.add_episode(4, 0, 0, episode([turn(1, True)], 1.0))
    batch.open_tree(4, "q")
    with pytest.raises(ValueError, match="tree 4 is already open"):
        batch.open_tree(4, "q")
    with pytest.raises(ValueError, match="no new turns below node 0 of tree 4"):
        batch.add_episode(4, 0, 0, episode([turn(1, True)], 1.0, prefix=1))
    batch.add_root(4, [1], "q", None, 1)
    with pytest.raises(ValueError, match="the root is node 0"):
        batch.add_root(4, [1], "q", None, 1)
    level0(store)
    rows = store.read_step(RUN, 0)
    with pytest.raises(ValueError, match="ordered by tree_id, then local_index"):
        StepTrees(rows.take([1, 0, 2, 3, 4, 5, 6, 7]))
    with pytest.raises(ValueError, match="ordered by tree_id"):
        StepTrees(rows.take([6, 7, 0, 1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match=r"no stored tree has id \[4\]"):
        StepTrees(rows).positions(np.array([5, 4, 3]))
