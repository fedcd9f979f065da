"""``trace_core.replay`` against the simulator's exact process: a replay of stored trees estimates
the contrastive groups each allocator would have found, within a stated tolerance of what the
allocator finds when it really runs on the same prompts."""

from __future__ import annotations

import numpy as np
import pytest

from studies.replay import logged_steps, validate
from trace_core.simulator import SimConfig, Simulator

RUNS = 4  # simulated runs (logging seeds): one run's own sampling noise is ~10-20 %
POOLED, PER_RUN = 0.10, 0.30  # the tolerances: pooled over the runs, and for each run


@pytest.fixture(scope="module")
def runs():
    sim = Simulator(SimConfig())
    return sim, [logged_steps(sim, np.random.default_rng(seed)) for seed in range(RUNS)]


@pytest.mark.slow  # simulated runs replayed (7-22 s each here)
@pytest.mark.parametrize("name", ["trace", "grpo", "prompt_only"])
def test_replay_matches_the_simulator_within_tolerance(runs, name):
    """Replaying each simulated run's stored trees estimates the expected contrastive groups the
    allocator finds when it runs on the simulator itself (same prompts, same Stage 1 scores, the
    exact process): within 10 % pooled over the runs and 30 % for each run."""
    sim, logged_runs = runs
    estimates, truths = validate(sim, logged_runs, [name])[name]
    print(f"\n{name}: replay {np.round(estimates, 1)} truth {np.round(truths, 1)}")
    assert abs(sum(estimates) - sum(truths)) <= POOLED * sum(truths), (estimates, truths)
    for e, t in zip(estimates, truths):
        assert abs(e - t) <= PER_RUN * t, (estimates, truths)


@pytest.mark.slow  # two subprocess CLIs (9 s here)
def test_stored_trees_are_read_back_for_the_replay(tmp_path):
    """The adapter turns a stored step into the replay's input: Stage 1 scores, bare outcomes,
    prefixes with their Stage 2 scores and continuation outcomes, root continuations, and the
    filtered candidates (k = 0) as prompts never sampled; `trace replay` prints a table and
    refuses an unknown run in one line."""
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow as pa

    from trace_rl.storage.replay import stored_steps
    from trace_rl.storage.schema import NODE_INPUT_SCHEMA
    from trace_rl.storage.store import TreeStore

    store = TreeStore(tmp_path)
    store.init_run("r", {"family": "synth_arith", "allocator": "trace", "root_budget": 2,
                         "multiplier": 1, "pool_size": 4, "group_size": 2})
    n = lambda i, p, d, **kw: dict(tree_id=0, local_index=i, parent_index=p, depth=d,  # noqa: E731
                                   item_id="a", is_leaf=False, **kw)
    leaf = lambda i, p, d, r: {**n(i, p, d), "is_leaf": True, "reward": r}  # noqa: E731
    bare = [n(0, -1, 0, predicted_v=0.4), n(1, 0, 1), leaf(2, 1, 2, 1.0), leaf(3, 0, 1, 0.0)]
    store.write_level("r", 0, 0, pa.Table.from_pylist(bare, schema=NODE_INPUT_SCHEMA),
                      allocations=pa.table({"node_id": ["r/s0/t0/n0", "r/s0/t1/n0"],
                                            "allocator": ["trace"] * 2,
                                            "k": pa.array([2, 0], pa.int64()),
                                            "predicted_v": [0.4, 0.7]}))
    cont = [leaf(4, 1, 2, 0.0), leaf(5, 0, 1, 1.0)]
    store.write_level("r", 0, 1, pa.Table.from_pylist(cont, schema=NODE_INPUT_SCHEMA),
                      allocations=pa.table({"node_id": ["r/s0/t0/n1"], "allocator": ["trace"],
                                            "k": pa.array([1], pa.int64()), "predicted_v": [0.6]}))
    steps, [(trees, score)] = stored_steps(TreeStore(tmp_path, create=False), "r")
    assert steps == [0]
    # the sampled tree (bare rollouts 0-1-2: 1 and 0-3: 0, a continuation 1-4: 0, one from the
    # root 0-5: 1), then the never-sampled candidate as a root alone
    assert trees.offsets.tolist() == [0, 6, 7]
    assert trees.parent.tolist() == [-1, 0, 1, 0, 1, 0, -1]
    assert trees.level.tolist() == [0, 0, 0, 0, 1, 1, 0]
    np.testing.assert_array_equal(trees.reward, [np.nan, np.nan, 1.0, 0.0, 0.0, 1.0, np.nan])
    np.testing.assert_array_equal(score, [0.4, 0.6, np.nan, np.nan, np.nan, np.nan, 0.7])
    from trace_core.replay import index_step
    sampled, never = index_step((trees, score)).prompts
    assert (never.predicted, never.bare) == (0.7, [])
    assert sampled.predicted == 0.4 and sampled.root_continuations == (1.0,)
    assert sampled.root_counts() == (2.0, 1.0)
    assert sampled.bare == [(1.0, [1]), (0.0, [])]  # each bare rollout's outcome and prefix rows
    assert index_step((trees, score)).continuations == {1: (0.0,), 0: (1.0,)}

    repo = Path(__file__).resolve().parents[1]
    cli = [sys.executable, "-m", "cli", "replay", "--workdir", str(tmp_path)]
    ok = subprocess.run([*cli, "r", "--replicates", "20"], cwd=repo, capture_output=True,
                        text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "trace: groups" in ok.stdout and "grpo: groups" in ok.stdout and "mean per step" in ok.stdout
    bad = subprocess.run([*cli, "nope"], cwd=repo, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    lines = (bad.stdout + bad.stderr).strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "run 'nope'" in lines[0], lines
