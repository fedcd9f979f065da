"""The DuckDB tree store: idempotent level writes, input validation, views, export, concurrency."""

from __future__ import annotations

import errno
import json
import logging
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trace_rl.storage import StoreError, TreeStore, make_node_id
from trace_rl.storage.schema import NODE_INPUT, NODE_INPUT_SCHEMA

REPO = Path(__file__).resolve().parents[1]


def node(tree, slot, parent, depth, leaf=False, reward=None, **extra):
    row = {c: None for c in NODE_INPUT}
    row.update(tree_id=tree, local_index=slot, parent_index=parent, depth=depth, item_id=f"q{tree}",
               is_leaf=leaf, reward=reward, family="synthetic", text=f"turn {slot}",
               gen_token_ids=[100 + slot, 200 + slot], gen_logprobs=[-0.5, -0.25],
               obs_token_ids=[] if leaf else [300 + slot])
    if parent == -1:  # the root holds the prompt as non-generated tokens
        row.update(gen_token_ids=[], gen_logprobs=[], obs_token_ids=[1, 2, 3], text=None)
    row.update(extra)
    return row


def table(rows):
    return pa.Table.from_pylist(rows, schema=NODE_INPUT_SCHEMA)


# Hand-worked tree 0 (slot: parent, reward at leaves):
#   level 0: 0 root; bare rollout A: 1 -> 2 (r=1); bare rollout B: 3 -> 4 (r=0)
#   level 1: continuation of 1: 5 (r=0); continuations of 3: 6 (r=0) and 7 -> 8 (r=1)
# Tree 1: root 0 with two one-turn rollouts 1 (r=1), 2 (r=1): never mixed.
LEVEL0 = [node(0, 0, -1, 0, predicted_v=0.5, allocated_k=2), node(0, 1, 0, 1), node(0, 2, 1, 2, True, 1.0),
          node(0, 3, 0, 1), node(0, 4, 3, 2, True, 0.0),
          node(1, 0, -1, 0), node(1, 1, 0, 1, True, 1.0), node(1, 2, 0, 1, True, 1.0)]
LEVEL1 = [node(0, 5, 1, 2, True, 0.0), node(0, 6, 3, 2, True, 0.0), node(0, 7, 3, 2),
          node(0, 8, 7, 3, True, 1.0)]
LEDGER = dict(method="trace", trajectories=4, prompt_tokens=24, generated_tokens=40, tool_calls=3,
              wall_seconds=1.5)


def nid(slot, tree=0, run="run1", step=0):
    return make_node_id(run, step, tree, slot)


@pytest.fixture
def store(tmp_path):
    s = TreeStore(tmp_path)
    s.init_run("run1", {"lr": 1e-5, "allocator": "trace"})
    alloc = pa.Table.from_pylist([
        {"node_id": nid(0), "allocator": "trace", "k": 2, "predicted_v": 0.5, "gain": 0.5},
        {"node_id": nid(0, tree=1), "allocator": "trace", "k": 2, "predicted_v": 0.9, "gain": 0.18}])
    s.write_level("run1", 0, 0, table(LEVEL0), alloc, LEDGER)
    s.write_level("run1", 0, 1, table(LEVEL1), None, dict(LEDGER, trajectories=3))
    return s


def snapshot(s: TreeStore) -> dict:
    return {t: s.query(f"SELECT * FROM {t} ORDER BY ALL").to_pylist()
            for t in ("nodes", "allocations", "ledger", "runs", "steps")}


def test_node_ids_are_deterministic_and_readable():
    assert make_node_id("run1", 3, 7, 0) == "run1/s3/t7/n0"
    assert make_node_id("run1", 3, 7, 12) == make_node_id("run1", 3, 7, 12)
    with pytest.raises(StoreError, match="run_id"):
        make_node_id("bad/run", 0, 0, 0)
    with pytest.raises(StoreError, match="local_index"):
        make_node_id("run1", 0, 0, -1)


def test_rewriting_a_level_leaves_one_copy(store):
    before = snapshot(store)
    assert len(before["nodes"]) == 12 and len(before["ledger"]) == 2
    # A retried task that re-sampled different text: the stored copy stays, nothing is added.
    resampled = [dict(r, text="another sample") for r in LEVEL1]
    res = store.write_level("run1", 0, 1, table(resampled), None, dict(LEDGER, trajectories=3))
    assert res.inserted_nodes == 0 and res.skipped_trees == (0,) and not res.ledger_written
    res = store.write_level("run1", 0, 0, table(LEVEL0))
    assert res.inserted_nodes == 0 and res.skipped_trees == (0, 1)
    assert snapshot(store) == before
    ids = [r["node_id"] for r in before["nodes"]]
    assert len(set(ids)) == len(ids)


def test_a_new_tree_at_a_written_level_is_added(store):
    res = store.write_level("run1", 0, 0, table([node(2, 0, -1, 0), node(2, 1, 0, 1, True, 0.0)]
                                                + LEVEL0))
    assert res.inserted_nodes == 2 and res.skipped_trees == (0, 1)
    assert store.query("SELECT count(*) AS n FROM nodes").column("n")[0].as_py() == 14


def test_a_level_that_reuses_another_levels_slot_is_refused_whole(store):
    """Tree 1 has no level-1 rows, but its slot 2 is a level-0 leaf: the write names the clash
    and stores nothing (a retry's skip is per tree and level; a clash is a bug, not a retry)."""
    before = snapshot(store)
    with pytest.raises(StoreError, match="'tree_id', 'local_index' name a node already stored"):
        store.write_level("run1", 0, 1, table([node(1, 3, 0, 1, True, 0.0),
                                               node(1, 2, 0, 1, True, 1.0)]))
    assert snapshot(store) == before


BAD_INPUTS = [
    ("tree_id", lambda rows: table(rows).drop_columns(["tree_id"])),
    ("depth", lambda rows: table(rows).set_column(
        list(NODE_INPUT).index("depth"), "depth", pa.array(["x"] * len(rows)))),
    ("predicted_v", lambda rows: table([dict(rows[0], predicted_v=1.5)] + rows[1:])),
    ("rewards", lambda rows: table(rows).append_column("rewards", pa.array([1.0] * len(rows)))),
    ("reward", lambda rows: table([dict(rows[0], reward=None)] + rows[1:])),
    ("parent_index", lambda rows: table([dict(rows[0], parent_index=9)] + rows[1:])),
    ("parent_index", lambda rows: table([dict(rows[0], depth=5)] + rows[1:])),
    ("parent_index", lambda rows: table([dict(rows[0], parent_index=2)] + rows[1:])),  # a leaf
    ("gen_logprobs", lambda rows: table([dict(rows[0], gen_logprobs=[-1.0])] + rows[1:])),
    ("node_id", lambda rows: table(rows).append_column("node_id", pa.array(["x"] * len(rows)))),
    ("allocated_k", lambda rows: table([dict(rows[0], allocated_k=-1)] + rows[1:])),
]


@pytest.mark.parametrize("column,corrupt", BAD_INPUTS, ids=[f"{c}-{i}" for i, (c, _) in
                                                             enumerate(BAD_INPUTS)])
def test_bad_nodes_are_rejected_naming_the_column(store, column, corrupt):
    before = snapshot(store)
    new_level = [node(0, 9, 7, 3, True, 1.0), node(0, 10, 1, 2, True, 0.0)]
    with pytest.raises(StoreError, match=f"'{column}'|\\['{column}'\\]"):
        store.write_level("run1", 0, 2, corrupt(new_level))
    assert snapshot(store) == before


def test_bad_allocations_and_ledger_are_rejected(store):
    before = snapshot(store)
    good = table([node(0, 9, 7, 3, True, 1.0)])
    with pytest.raises(StoreError, match="'k'"):
        store.write_level("run1", 0, 2, good, pa.table({"node_id": [nid(2)], "allocator": ["t"]}))
    with pytest.raises(StoreError, match="wall_seconds"):
        store.write_level("run1", 0, 2, good, None, dict(LEDGER, wall_seconds=-1.0))
    assert snapshot(store) == before


def test_a_failure_inside_the_transaction_rolls_the_level_back(store):
    before = snapshot(store)
    # Passes the Python checks but overflows BIGINT inside DuckDB, after the nodes were inserted.
    with pytest.raises(Exception, match="(?i)out of range|overflow|convert"):
        store.write_level("run1", 0, 2, table([node(0, 9, 7, 3, True, 1.0)]), None,
                          dict(LEDGER, trajectories=2**70))
    assert snapshot(store) == before
    assert not store.has_level("run1", 0, 2)


def test_a_held_block_shares_one_connection_publishes_writes_and_lets_go(store, monkeypatch):
    """Inside ``held`` the reads and writes of a thread share one connection (opened at the first
    use); each write is published as at a close; ``released`` closes it and the next use opens
    another; another thread's use runs between the block's uses, on its connection; a failed use
    closes the connection."""
    import duckdb

    from trace_rl.storage import published

    opened = []
    real = duckdb.connect
    monkeypatch.setattr(published.duckdb, "connect",
                        lambda *a, **k: opened.append(a) or real(*a, **k))
    reader = TreeStore(store.path, create=False)
    other: list[int] = []
    with store.held():
        assert opened == []
        assert store.read_step("run1", 0).num_rows == 12
        store.update_values("run1", 0, pa.table({"node_id": [nid(2)], "value": [1.0]}))
        store.mark_step("run1", 0, "complete", {"x": 1.0})
        assert store.last_complete_step("run1") == 0 and len(opened) == 1
        assert published.PublishedDatabase._pending.get(store.path) in (None, store)
        store.flush()
        opened.clear()
        assert reader.query("SELECT value FROM nodes WHERE node_id = $n",
                            {"n": nid(2)}).to_pylist() == [{"value": 1.0}]  # published
        opened.clear()
        between = threading.Thread(target=lambda: other.append(store.read_step("run1", 0).num_rows))
        between.start()
        between.join(30)
        assert other == [12] and opened == []  # between the block's uses, on its connection
        with published.released():
            with store.snapshot() as con:  # suspended, but nobody else asked: the kept connection
                con.execute("SELECT * FROM nodes")  # a result left unfinished
            assert store.read_step("run1", 0).num_rows == 12 and opened == []
        with store.snapshot() as con:  # each use of the block's connection is its own cursor,
            con.execute("SELECT * FROM nodes")  # so a result left unfinished is no one else's
        assert store.read_step("run1", 0).num_rows == 12
        assert store.get_run("run1") is not None and opened == []  # still the same one
        with pytest.raises(StoreError, match="only SELECT"):
            store.query("DELETE FROM nodes")
        assert store.get_run("run1") is not None and len(opened) == 1  # the failed one closed
    assert published.PublishedDatabase._holds.files == {}
    assert store.query("SELECT value FROM nodes WHERE node_id = $n",
                       {"n": nid(2)}).to_pylist() == [{"value": 1.0}]


def test_a_released_stretch_keeps_the_connection_until_another_process_asks(store, monkeypatch):
    """Through a ``released`` stretch a writer's held connection stays open while nobody else
    wants the file; once another process waits for the file lock (here a thread, on a descriptor
    of its own: flock sees it as another holder), the connection is closed and the lock let go
    within the poll, the waiter writes, and the block's next use opens a connection that sees it."""
    import duckdb

    from trace_rl.storage import locks, published

    opened = []
    real = duckdb.connect
    monkeypatch.setattr(published.duckdb, "connect",
                        lambda *a, **k: opened.append(a) or real(*a, **k))
    lock = store._lock_file
    assert not locks.waited_on(lock)
    waited: list[float] = []

    def other_process() -> None:
        t0 = time.monotonic()
        with locks.file_lock(lock, 30, "test"):
            waited.append(time.monotonic() - t0)
            con = real(str(store.private))  # it has the file to itself now
            con.execute("UPDATE runs SET status = 'failed' WHERE run_id = 'run1'")
            con.close()

    with store.held():
        assert store.get_run("run1")["status"] != "failed" and len(opened) == 1
        with published.released():
            time.sleep(3 * published.YIELD_POLL_S)
            hold = published.PublishedDatabase._open_holds.get(store.private)
            assert hold is not None and hold.con is not None  # kept: nobody asked
            other = threading.Thread(target=other_process)
            other.start()
            other.join(30)
            # noticed within polls, not at the stretch's end (which would outlast the join's 30 s);
            # 200 polls (10 s) leave a loaded machine room
            assert waited and waited[0] < 200 * published.YIELD_POLL_S
            assert published.PublishedDatabase._open_holds.get(store.private) is None
        assert store.get_run("run1")["status"] == "failed" and len(opened) == 2  # a new one
    assert not locks.waited_on(lock)


def python_paths(rows):
    """Reference: root-to-leaf paths from parent pointers, by walking up from each leaf."""
    parent = {r["node_id"]: r["parent_id"] for r in rows}
    out = {}
    for r in rows:
        if r["is_leaf"]:
            path, cur = [], r["node_id"]
            while cur is not None:
                path.append(cur)
                cur = parent[cur]
            out[r["node_id"]] = (path[::-1], r["reward"])
    return out


def random_tree(rng: random.Random, tree: int):
    """Bare rollouts from the root (level 0), then continuations from random prefixes (level 1)."""
    rows = [node(tree, 0, -1, 0)]
    prefixes = []
    for _ in range(rng.randint(1, 3)):
        parent, depth = 0, 0
        for t in range(rng.randint(1, 4)):
            leaf = t == 3 or rng.random() < 0.3
            rows.append(node(tree, len(rows), parent, depth + 1, leaf, float(rng.random() < 0.5)
                             if leaf else None))
            parent, depth = len(rows) - 1, depth + 1
            if leaf:
                break
            prefixes.append((parent, depth))
    level0, level1 = rows, []
    for parent, depth in rng.sample(prefixes, min(len(prefixes), 2)):
        for _ in range(rng.randint(1, 2)):
            slot = len(level0) + len(level1)
            level1.append(node(tree, slot, parent, depth + 1, True, float(rng.random() < 0.5)))
    return level0, level1


def test_paths_view_matches_a_python_reconstruction(tmp_path):
    rng = random.Random(0)
    s = TreeStore(tmp_path)
    for step in range(2):
        trees = [random_tree(rng, t) for t in range(5)]
        s.write_level("run1", step, 0, table([r for l0, _ in trees for r in l0]))
        level1 = [r for _, l1 in trees for r in l1]
        if level1:
            s.write_level("run1", step, 1, table(level1))
    rows = s.query("SELECT node_id, parent_id, is_leaf, reward FROM nodes").to_pylist()
    expect = python_paths(rows)
    got = {r["leaf_id"]: (r["node_ids"], r["reward"]) for r in
           s.query("SELECT leaf_id, node_ids, reward FROM paths").to_pylist()}
    assert len(expect) > 20
    assert got == expect
    depth = s.query("SELECT p.depth = n.depth AS ok FROM paths p JOIN nodes n "
                    "ON n.node_id = p.leaf_id").column("ok").to_pylist()
    assert all(depth)


def test_mixed_anchors_and_contrast_pairs_on_a_hand_worked_tree(store):
    mixed = store.query("SELECT node_id, leaves_below, successes FROM mixed_anchors "
                        "ORDER BY node_id").to_pylist()
    assert mixed == [{"node_id": nid(0), "leaves_below": 5, "successes": 2.0},
                     {"node_id": nid(1), "leaves_below": 2, "successes": 1.0},
                     {"node_id": nid(3), "leaves_below": 3, "successes": 1.0}]
    pairs = store.query("SELECT parent_id, better_id, worse_id, round(delta, 6) AS d, pure "
                        "FROM contrast_pairs ORDER BY parent_id, better_id, worse_id").to_pylist()
    assert pairs == [
        {"parent_id": nid(0), "better_id": nid(1), "worse_id": nid(3), "d": round(0.5 - 1 / 3, 6),
         "pure": False},
        {"parent_id": nid(1), "better_id": nid(2), "worse_id": nid(5), "d": 1.0, "pure": True},
        {"parent_id": nid(3), "better_id": nid(7), "worse_id": nid(4), "d": 1.0, "pure": True},
        {"parent_id": nid(3), "better_id": nid(7), "worse_id": nid(6), "d": 1.0, "pure": True},
    ]


def test_update_values_sets_the_backup_and_agrees_with_the_leaves(store):
    # Hand backup of tree 0: V^(1) = 1/2, V^(3) = 1/3, V^(7) = 1, V^(root) = 2/5.
    backup = {0: (0.4, 5), 1: (0.5, 2), 3: (1 / 3, 3), 7: (1.0, 1)}
    leaves = {2: 1.0, 4: 0.0, 5: 0.0, 6: 0.0, 8: 1.0}
    ids = [nid(k) for k in backup] + [nid(k) for k in leaves]
    vals = [v for v, _ in backup.values()] + list(leaves.values())
    ns = [n for _, n in backup.values()] + [1] * len(leaves)
    assert store.update_values("run1", 0, pa.table({"node_id": ids, "value": vals, "n_leaves": ns,
                                                   "advantage": [v - 0.4 for v in vals]})) == 9
    disagree = store.query(
        "SELECT n.node_id FROM nodes n JOIN subtree_stats s USING (node_id) WHERE n.tree_id = 0 "
        "AND (abs(n.value - s.leaf_mean) > 1e-9 OR n.n_leaves <> s.leaves_below)").num_rows
    assert disagree == 0
    assert store.query("SELECT count(*) AS n FROM nodes WHERE value IS NULL").column("n")[0]\
        .as_py() == 3  # tree 1 was not backed up
    before = snapshot(store)
    with pytest.raises(StoreError, match="'node_id'"):
        store.update_values("run1", 0, pa.table({"node_id": [nid(0), "run1/s0/t0/n99"],
                                                 "value": [0.1, 0.2]}))
    with pytest.raises(StoreError, match=f"'value' must lie in \\[0, 1\\]; row {nid(1)} has 2.0"):
        store.update_values("run1", 0, pa.table({"node_id": [nid(0), nid(1)],
                                                 "value": [0.5, 2.0]}))
    with pytest.raises(StoreError, match="'node_id' repeats an id"):
        store.update_values("run1", 0, pa.table({"node_id": [nid(1), nid(1)],
                                                 "value": [0.5, 0.5]}))
    with pytest.raises(StoreError, match="reward"):
        store.update_values("run1", 0, pa.table({"node_id": [nid(0)], "reward": [1.0]}))
    assert snapshot(store) == before


def test_read_prefixes_rebuilds_the_exact_token_history(store):
    t = store.read_prefixes([nid(8), nid(0)]).to_pylist()
    # root prompt | slot 3 gen + obs | slot 7 gen + obs | slot 8 gen
    assert t[0]["token_ids"] == [1, 2, 3, 103, 203, 303, 107, 207, 307, 108, 208]
    assert t[0]["gen_mask"] == [0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert t[1]["token_ids"] == [1, 2, 3] and t[1]["gen_mask"] == [0, 0, 0]
    with pytest.raises(StoreError, match="not stored"):
        store.read_prefixes(["run1/s9/t0/n0"])


def test_tree_reads_map_onto_the_arrays(store):
    tree = store.read_tree("run1", 0, 0)
    assert tree.column("local_index").to_pylist() == list(range(9))
    assert tree.column("parent_index").to_pylist() == [-1, 0, 1, 0, 3, 1, 3, 3, 7]
    assert tree.column("level").to_pylist() == [0] * 5 + [1] * 4
    assert tree.column("gen_tokens").to_pylist()[:2] == [0, 2]
    assert store.read_step("run1", 0).num_rows == 12
    assert store.query("SELECT trajectories FROM step_ledger").column(0).to_pylist() == [7]
    alloc = store.query("SELECT * FROM allocations ORDER BY node_id").to_pylist()
    assert [a["k"] for a in alloc] == [2, 2] and alloc[0]["level"] == 0


def test_runs_and_steps(store):
    assert store.init_run("run1", {"lr": 2.0}) is False  # resume keeps the stored config
    assert store.get_run("run1")["config"] == {"lr": 1e-5, "allocator": "trace"}
    store.set_run("run1", mlflow_run_id="abc")
    assert store.get_run("run1")["mlflow_run_id"] == "abc"
    assert store.last_complete_step("run1") is None
    store.mark_step("run1", 0, "running")
    store.mark_step("run1", 0, "complete", {"rollout/reward": 0.5})
    store.mark_step("run1", 1, "running")
    assert store.last_complete_step("run1") == 0
    row = store.query("SELECT * FROM steps WHERE step = 0").to_pylist()[0]
    assert json.loads(row["metrics_json"]) == {"rollout/reward": 0.5} and row["finished_at"]
    with pytest.raises(StoreError, match="status"):
        store.mark_step("run1", 1, "done")


def test_a_step_end_marks_the_next_start_and_a_failure_spares_complete_steps(store):
    store.mark_step("run1", 0, "running")
    store.mark_step("run1", 0, "complete", {"x": 1.0}, then_running=1)  # one write
    def status() -> dict[int, str]:
        rows = store.query("SELECT step, status FROM steps WHERE run_id = 'run1'").to_pylist()
        return {r["step"]: r["status"] for r in rows}

    assert status() == {0: "complete", 1: "running"}
    store.mark_failed("run1", 0)  # the end's write landed, then failed: 0 stays complete
    assert status() == {0: "complete", 1: "failed"}
    store.mark_failed("run1", 2)  # a step whose running mark was never written
    assert status() == {0: "complete", 1: "failed", 2: "failed"}


def test_query_is_read_only(store):
    with pytest.raises(Exception, match="read-only"):
        store.query("DELETE FROM nodes")
    assert store.read_step("run1", 0).num_rows == 12
    with pytest.raises(FileNotFoundError):
        TreeStore(store.path.parent / "elsewhere", create=False)


def test_parquet_round_trip(store, tmp_path):
    files = store.export_parquet("run1", tmp_path / "export")
    assert set(files) == {"runs", "steps", "nodes", "allocations", "ledger", "evals"}
    back = pq.read_table(files["nodes"])
    assert back.to_pylist() == store.read_step("run1", 0).to_pylist()
    assert back.schema.field("gen_token_ids").type == pa.list_(pa.int32())
    assert pq.read_table(files["ledger"]).num_rows == 2


def _eval_row(step: int, accuracy: float) -> dict:
    return {"run_id": "run1", "step": step, "policy_dir": "/p", "split": "test", "skip": 144,
            "items": 3, "samples": 2, "temperature": 1.0, "accuracy": accuracy,
            "ci_low": accuracy - 0.1, "ci_high": accuracy + 0.1, "per_item": [0.5, 1.0, 0.0],
            "generated_tokens": 40, "tool_calls": 3}


def test_evals_are_stored_once_per_step_and_replaced_on_repeat(store):
    assert store.get_eval("run1", 0) is None
    store.record_eval(_eval_row(0, 0.5))
    store.record_eval(_eval_row(2, 0.6))
    store.record_eval(_eval_row(2, 0.7))  # a repeat of (run, step) replaces, never duplicates
    rows = store.query("SELECT step, accuracy, per_item FROM evals WHERE run_id = 'run1' "
                       "ORDER BY step").to_pylist()
    assert rows == [{"step": 0, "accuracy": 0.5, "per_item": [0.5, 1.0, 0.0]},
                    {"step": 2, "accuracy": 0.7, "per_item": [0.5, 1.0, 0.0]}]
    assert store.get_eval("run1", 2)["ci_high"] == pytest.approx(0.8)
    with pytest.raises(StoreError, match="missing"):
        store.record_eval({"run_id": "run1", "step": 3})


WRITER = textwrap.dedent("""
    import json, sys, time
    import pyarrow as pa
    sys.path.insert(0, {repo!r})
    from trace_rl.storage import TreeStore
    from trace_rl.storage.schema import NODE_INPUT
    schema = pa.schema({{c: t for c, (t, _) in NODE_INPUT.items()}})
    s = TreeStore({path!r})
    s.init_run("live", {{}})
    print("ready", flush=True)
    for step in range({steps}):
        for tree in range(4):
            rows = [dict(tree_id=tree, local_index=0, parent_index=-1, depth=0, item_id="q",
                         is_leaf=False, obs_token_ids=list(range(64)))]
            for i in range(1, 16):
                rows.append(dict(tree_id=tree, local_index=i, parent_index=i - 1, depth=i,
                                 item_id="q", is_leaf=i == 15, reward=1.0 if i == 15 else None,
                                 gen_token_ids=list(range(32)), text="x" * 200))
            rows = [{{c: r.get(c) for c in NODE_INPUT}} for r in rows]
            s.write_level("live", step, 0, pa.Table.from_pylist(rows, schema=schema))
        s.mark_step("live", step, "complete")
        print("step", step, flush=True)
    lock = sorted(s.lock_seconds)
    print(json.dumps({{"max": lock[-1], "median": lock[len(lock) // 2], "n": len(lock)}}), flush=True)
""")


@pytest.mark.slow
def test_queries_answer_while_another_process_writes(tmp_path):
    steps = 15
    db = tmp_path / "trace.duckdb"
    proc = start_writer(db, steps)
    reader = TreeStore(db, create=False, read_timeout_s=20)
    latencies, counts = [], []
    while proc.poll() is None:
        t0 = time.perf_counter()
        counts.append(reader.query("SELECT count(*) AS n FROM paths").column("n")[0].as_py())
        latencies.append(time.perf_counter() - t0)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lock = json.loads(out.strip().splitlines()[-1])
    final = reader.query("SELECT count(*) AS n FROM nodes").column("n")[0].as_py()
    assert final == steps * 4 * 16
    assert reader.last_complete_step("live") == steps - 1
    # Reads kept answering during the write loop and saw it progress.
    assert len(latencies) >= 5
    assert any(0 < c < steps * 4 for c in counts), counts
    assert max(latencies) < 10.0
    print(f"\nreads={len(latencies)} read max={max(latencies):.3f}s "
          f"median={sorted(latencies)[len(latencies) // 2]:.3f}s; writer lock window "
          f"max={lock['max']:.3f}s median={lock['median']:.3f}s over {lock['n']} opens")


def start_writer(db: Path, steps: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(repo=str(REPO), path=str(db),
                                                                 steps=steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


@pytest.mark.slow
def test_a_writer_killed_mid_step_loses_and_duplicates_nothing(tmp_path):
    steps, db = 6, tmp_path / "trace.duckdb"
    proc = start_writer(db, steps)
    while proc.stdout.readline().strip() != "step 1":
        assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGKILL)  # somewhere inside step 2's tree writes
    proc.wait(timeout=30)
    reader = TreeStore(db, create=False)
    per_tree = reader.query("SELECT step, tree_id, count(*) AS n FROM nodes GROUP BY ALL").to_pylist()
    assert {r["n"] for r in per_tree} == {16}  # each tree's level is all there or absent
    assert reader.last_complete_step("live") >= 1
    kept = set(reader.query("SELECT node_id FROM nodes").column(0).to_pylist())
    # The retry re-runs every step from the start: stored trees are skipped, the rest written.
    proc = start_writer(db, steps)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    ids = reader.query("SELECT node_id FROM nodes").column(0).to_pylist()
    assert len(ids) == len(set(ids)) == steps * 4 * 16
    assert kept <= set(ids)


# ------------------------------------------------------------------ readers and writers

def _tree_of_files(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under root (bar lock files) with its size and a hash of its bytes."""
    import hashlib

    return {str(f.relative_to(root)): (f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest())
            for f in sorted(root.rglob("*")) if f.is_file() and not f.name.endswith(".lock")}


def test_trace_sql_can_neither_write_nor_read_outside_the_store(store, tmp_path):
    """Every writing statement a user once tried is refused by `trace sql`, and nothing on disk
    changes: not the store, not the MLflow database next to it, not an attachable file, not a new
    file."""
    from typer.testing import CliRunner

    from cli.app import app

    store.flush()  # the fixture's last level write may still be due to publish (a timer)
    wd = store.path.parent
    (wd / "mlflow.db").write_bytes(b"the MLflow store")
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read me\n")
    other = tmp_path / "other.duckdb"
    import duckdb

    with duckdb.connect(str(other)) as con:
        con.execute("CREATE TABLE t AS SELECT 1 AS x")
    refused = [
        f"COPY (SELECT * FROM nodes) TO '{wd / 'mlflow.db'}'",
        f"COPY nodes TO '{tmp_path / 'out.csv'}'",
        f"ATTACH '{other}' (READ_WRITE)",
        f"ATTACH '{other}' AS o (READ_WRITE); DROP TABLE o.t",
        f"ATTACH '{tmp_path / 'new.duckdb'}' AS n; CREATE TABLE n.t (x INT)",
        f"EXPORT DATABASE '{tmp_path / 'export'}'",
        f"SELECT * FROM read_text('{secret}')",
        "SELECT * FROM read_csv('/etc/passwd')",
        f"SELECT * FROM '{secret}'",
        f"WITH s AS (SELECT * FROM read_text('{secret}')) SELECT count(*) FROM nodes, s",
        "PRAGMA threads=1", "PRAGMA table_info('nodes')", "PRAGMA enable_profiling",
        "SET threads=1", "SET enable_external_access=true", "RESET lock_configuration",
        "CHECKPOINT", "INSTALL httpfs", "LOAD httpfs",
        "INSERT INTO meta VALUES ('x', 'y')", "DELETE FROM nodes", "CREATE TABLE x (a INT)",
        "DROP VIEW paths", "UPDATE nodes SET reward = 0", "SELECT 1; DELETE FROM nodes",
    ]
    before, outside = _tree_of_files(wd), _tree_of_files(tmp_path)
    rows = snapshot(store)
    runner = CliRunner()
    for sql in refused:
        out = runner.invoke(app, ["sql", "--workdir", str(wd), sql])
        assert out.exit_code == 1, f"{sql!r} was not refused: {out.output}"
        assert "query failed" in out.output and "do not read me" not in out.output, out.output
    assert _tree_of_files(wd) == before and _tree_of_files(tmp_path) == outside
    assert snapshot(store) == rows
    # Reading the store is what it is for: SELECT, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN, table
    # functions over the catalogue.
    for sql in ("SELECT count(*) AS n FROM paths", "DESCRIBE nodes", "SHOW TABLES",
                "SUMMARIZE ledger", "EXPLAIN SELECT * FROM nodes",
                "SELECT * FROM pragma_table_info('nodes')", "FROM mixed_anchors"):
        out = runner.invoke(app, ["sql", "--workdir", str(wd), "--format", "json", sql])
        assert out.exit_code == 0, f"{sql!r}: {out.output}"


def test_the_read_connection_itself_refuses_files_and_settings(store, tmp_path):
    """Second layer, under the statement check: the connection's own DuckDB config."""
    import duckdb

    from trace_rl.storage.store import READ_CONFIG

    store.flush()  # a publish due later would change the file under the check (seen under load)
    before = _tree_of_files(tmp_path)
    with duckdb.connect(str(store.path), read_only=True, config=READ_CONFIG) as con:
        for sql in (f"COPY nodes TO '{tmp_path / 'x.csv'}'", "SELECT * FROM read_csv('/etc/passwd')",
                    f"ATTACH '{tmp_path / 'y.duckdb'}'", f"EXPORT DATABASE '{tmp_path / 'e'}'",
                    "SET enable_external_access = true", "SET threads = 1"):
            with pytest.raises(duckdb.Error):
                con.execute(sql)
    assert _tree_of_files(tmp_path) == before


def test_a_reader_holding_the_file_never_blocks_the_writer(store):
    """A separate process holds `duckdb.connect(trace.duckdb, read_only=True)` (what `duckdb
    -readonly` does) for the whole test: writes still go through at once, the reader keeps its
    consistent snapshot, and a fresh reader sees the new rows."""
    hold = textwrap.dedent(f"""
        import duckdb, sys, time
        con = duckdb.connect({str(store.path)!r}, read_only=True)
        print(con.execute("SELECT count(*) FROM nodes").fetchone()[0], flush=True)
        sys.stdin.readline()
        print(con.execute("SELECT count(*) FROM nodes").fetchone()[0], flush=True)
    """)
    store.flush()  # the fixture's last level write may still be due to publish
    reader = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert int(reader.stdout.readline()) == 12
        # Were the writer to need the reader gone, it would wait for good (the reader holds on
        # until told): past its write time-out it raises, however fast the machine.
        writer = TreeStore(store.path, write_timeout_s=60)
        writer.write_level("run1", 1, 0, table(LEVEL0))
        writer.mark_step("run1", 1, "complete")
        assert TreeStore(store.path, create=False).read_step("run1", 1).num_rows == 8
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert int(reader.stdout.readline()) == 12  # its snapshot, untouched by the publish
    finally:
        reader.kill()
        reader.wait()


def test_a_process_on_the_private_file_is_named(store):
    """Nobody but the store should open the writer's private file; if someone does, the write
    that times out names that process."""
    from trace_rl.storage import StoreBusyError

    hold = (f"import duckdb, sys\ncon = duckdb.connect({str(store.private)!r}, read_only=True)\n"
            f"print('held', flush=True)\nsys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(StoreBusyError, match=f"pid {proc.pid}"):
            TreeStore(store.path, write_timeout_s=0.5).mark_step("run1", 3, "running")
    finally:
        proc.kill()
        proc.wait()


def test_a_work_dir_of_the_old_layout_is_adopted(store, tmp_path):
    """The writer once wrote trace.duckdb itself: such a work dir opens as it is, for
    reading and for writing, and keeps its rows."""
    old = tmp_path / "old"
    old.mkdir()
    store.flush()  # the file is copied by hand, not read through a TreeStore that would flush
    (old / "trace.duckdb").write_bytes(store.path.read_bytes())
    assert TreeStore(old, create=False).read_step("run1", 0).num_rows == 12
    writer = TreeStore(old)
    assert writer.private.exists()
    writer.mark_step("run1", 5, "running")
    reader = TreeStore(old, create=False)
    assert reader.read_step("run1", 0).num_rows == 12
    assert reader.query("SELECT max(step) AS s FROM steps").column("s")[0].as_py() == 5
    with pytest.raises(StoreError, match="create=False"):
        reader.mark_step("run1", 6, "running")


def test_the_publish_timer_publishes_a_held_blocks_deferred_write_between_its_uses(
        store, monkeypatch):
    """Inside ``held`` the block keeps its connection and the file lock, not the thread lock: the
    publish timer publishes a deferred write between the block's uses (as readers are promised),
    and the block keeps its connection."""
    import duckdb

    from trace_rl.storage import published

    def raw_count() -> int:  # a plain DuckDB reader: no flush on its behalf
        with duckdb.connect(str(store.path), read_only=True) as con:
            return con.execute("SELECT count(*) FROM nodes WHERE step = 2").fetchone()[0]

    monkeypatch.setattr(published, "PUBLISH_SHARE", 1e-4)  # the timer waits ~10^4 copy times
    with store.held():
        store.mark_step("run1", 2, "running")  # publishes
        store.write_level("run1", 2, 0, table(LEVEL0))  # deferred
        assert raw_count() == 0
        con = published.PublishedDatabase._holds.files[store._file].con
        timer = store._timer
        assert timer is not None and timer.is_alive()
        timer.cancel()  # fired now rather than after its wait, from a thread of its own
        fired = threading.Thread(target=timer.function)
        fired.start()
        fired.join(30)
        assert not fired.is_alive() and raw_count() == 8
        assert published.PublishedDatabase._holds.files[store._file].con is con
    assert published.PublishedDatabase._open_holds == {}


def test_a_deferred_publish_is_never_lost(store, monkeypatch):
    """Level writes right after a publish are deferred (copies capped at PUBLISH_SHARE of the
    wall time); a reader of the same process flushes them first, and otherwise a timer publishes
    them once due, without any later write."""
    import duckdb

    import trace_rl.storage.published as store_mod  # where the publish rule lives

    def raw_count(step: int = 2) -> int:  # a plain DuckDB reader: no flush on its behalf
        with duckdb.connect(str(store.path), read_only=True) as con:
            return con.execute("SELECT count(*) FROM nodes WHERE step = ?", [step]).fetchone()[0]

    monkeypatch.setattr(store_mod, "PUBLISH_SHARE", 1e-4)  # the timer waits ~10^4 copy times
    store.mark_step("run1", 2, "running")  # publishes
    store.write_level("run1", 2, 0, table(LEVEL0))  # deferred
    assert raw_count() == 0
    assert TreeStore(store.path, create=False).read_step("run1", 2).num_rows == 8  # flushed
    assert raw_count() == 8
    # The publish timer fires when the test says it is due, not after its seconds (a wait of
    # ~100 copy times, a fraction of a second, once had to outlast the two writes below).
    timers: list[GatedTimer] = []

    def timer(wait: float, fn: Callable[[], None]) -> GatedTimer:
        timers.append(GatedTimer(fn))
        return timers[-1]

    monkeypatch.setattr(store_mod, "threading", types.SimpleNamespace(
        Timer=timer, Lock=threading.Lock, RLock=threading.RLock,
        current_thread=threading.current_thread))
    store.mark_step("run1", 3, "running")
    try:
        store.write_level("run1", 3, 0, table(LEVEL0))
        store.update_values("run1", 3, pa.table({"node_id": [nid(0, step=3)], "value": [0.5]}))
        assert TreeStore._pending.get(store.path) is store and store._timer is timers[0]
        assert raw_count(step=3) == 0
        timers[0].due.set()  # no later write, no reader: the timer alone publishes
        timers[0].join(120)
        assert not timers[0].is_alive() and TreeStore._pending.get(store.path) is None
    finally:
        for gated in timers:
            gated.due.set()
    with duckdb.connect(str(store.path), read_only=True) as con:
        assert con.execute("SELECT value FROM nodes WHERE node_id = ?",
                           [nid(0, step=3)]).fetchone()[0] == 0.5


def test_a_failed_timer_publish_is_logged_and_retried(store, monkeypatch, caplog):
    """A publish timer whose copy fails (a full disk) logs it and forgets itself: the writes
    stay pending, the next deferred write starts another timer, and nothing is lost (the
    failure used to die with the timer's thread and leave it set, so no timer ever came again)."""
    import duckdb

    import trace_rl.storage.published as store_mod

    timers: list[GatedTimer] = []

    def timer(wait: float, fn: Callable[[], None]) -> GatedTimer:
        timers.append(GatedTimer(fn))
        return timers[-1]

    real_copy, fail = store_mod.shutil.copyfile, [True]

    def copy(src, dst, *args, **kwargs):
        if fail and timers and threading.current_thread() is timers[0]:
            fail.pop()
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(store_mod, "PUBLISH_SHARE", 1e-4)
    monkeypatch.setattr(store_mod, "threading", types.SimpleNamespace(
        Timer=timer, Lock=threading.Lock, RLock=threading.RLock,
        current_thread=threading.current_thread))
    monkeypatch.setattr(store_mod.shutil, "copyfile", copy)
    store.mark_step("run1", 3, "running")  # publishes
    try:
        store.write_level("run1", 3, 0, table(LEVEL0))  # deferred
        with caplog.at_level(logging.WARNING, logger=store_mod.__name__):
            timers[0].due.set()
            timers[0].join(120)
        assert not fail and "No space left" in caplog.text
        assert TreeStore._pending.get(store.path) is store and store._timer is None
        store.update_values("run1", 3, pa.table({"node_id": [nid(0, step=3)], "value": [0.5]}))
        assert len(timers) == 2 and store._timer is timers[1]  # deferred again: a new timer
        timers[1].due.set()
        timers[1].join(120)
        assert TreeStore._pending.get(store.path) is None
    finally:
        for gated in timers:
            gated.due.set()
    with duckdb.connect(str(store.path), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM nodes WHERE step = 3").fetchone()[0] == 8
        assert con.execute("SELECT value FROM nodes WHERE node_id = ?",
                           [nid(0, step=3)]).fetchone()[0] == 0.5


class GatedTimer(threading.Thread):
    """``threading.Timer`` whose wait ends when ``due`` is set rather than after its seconds."""

    def __init__(self, function: Callable[[], None]):
        super().__init__(daemon=True)
        self.function, self.due, self.cancelled = function, threading.Event(), False

    def cancel(self) -> None:
        self.cancelled = True

    def run(self) -> None:
        self.due.wait()
        if not self.cancelled:
            self.function()
