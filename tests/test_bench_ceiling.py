"""studies/ceiling.py: the moment fit, the oracle allocations' effective ratios, and the reader on a
real DuckDB store of hand-built GRPO groups."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from studies.ceiling import ceiling, fit_pool, main, pool_shares, read_groups, two_waves
from trace_core.allocation import allocate_roots, root_gain
from tasks.runtime import Paths
from trace_rl.rollout.types import Action
from trace_rl.storage import TreeStore
from trace_rl.storage.schema import NODE_INPUT, NODE_INPUT_SCHEMA
from trace_rl.storage.store import make_node_id


def test_fit_pool_recovers_mean_and_correlation():
    rng = np.random.default_rng(0)
    mu, rho, n = 0.7, 0.3, 4
    p = rng.beta(mu * (1 - rho) / rho, (1 - mu) * (1 - rho) / rho, size=20000)
    values = rng.binomial(n, p) / n
    got_mu, got_rho = fit_pool(values, n)
    assert got_mu == pytest.approx(mu, abs=0.01) and got_rho == pytest.approx(rho, abs=0.02)
    # Groups that vary exactly as binomial noise around one p: rho at its floor.
    assert fit_pool(rng.binomial(n, 0.5, size=20000) / n, n)[1] < 0.01


def test_fit_pool_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="all successes"):
        fit_pool([1.0, 1.0, 1.0], 4)
    with pytest.raises(ValueError, match="groups of >= 2"):
        fit_pool([0.5, 0.5], 1)


def test_pool_shares_on_a_pool_of_coin_flips():
    # Every prompt at p ~ 0.5: GRPO's groups of 4 are mixed 1 - 2 / 16 = 0.875 of the time; the
    # paper's Stage 1 objective spends on pairs and triples (each leaf of a pair and the third
    # leaf buy p (1 - p) = 0.25, the fourth 0.125): 12 expected mixed prompts against GRPO's
    # 12 x 0.875 = 10.5, at a LOWER share (0.5 for pairs, 0.75 for triples); the ratio-chasing
    # oracle with groups of 8 reaches 1 - 2 / 256.
    out = pool_shares(0.5, 1e-4, pool_size=32, leaves=48, group=4, draws=20,
                      rng=np.random.default_rng(1))
    assert out["grpo"]["share"] == pytest.approx(0.875, abs=0.01)
    assert out["grpo"]["mixed"] == pytest.approx(10.5, abs=0.1)
    assert 0.5 - 0.01 <= out["oracle_stage1"]["share"] <= 0.75 + 0.01
    assert out["oracle_stage1"]["mixed"] == pytest.approx(12.0, abs=0.1)
    assert out["oracle_top"]["share"] == pytest.approx(0.875, abs=0.01)
    assert out["oracle_top2"]["share"] == pytest.approx(1 - 2 / 256, abs=0.01)
    assert out["oracle_joint"]["mixed"] > out["oracle_stage1"]["mixed"]
    with pytest.raises(ValueError, match="first=1"):
        pool_shares(0.5, 0.1, pool_size=32, leaves=48, group=4, draws=1, rng=np.random.default_rng(),
                    first=1)
    with pytest.raises(ValueError, match="multiple of group"):
        pool_shares(0.5, 0.1, pool_size=32, leaves=50, group=4, draws=1, rng=np.random.default_rng())


@pytest.mark.slow  # simulated runs (7 s here)
def test_an_oracle_gains_most_on_a_polarised_pool():
    rng = np.random.default_rng(2)
    alike = pool_shares(0.8, 0.05, pool_size=32, leaves=48, group=4, draws=80, rng=rng)
    polar = pool_shares(0.3, 0.6, pool_size=32, leaves=48, group=4, draws=80, rng=rng)
    gain = {k: v["oracle_stage1"]["mixed"] / v["grpo"]["mixed"] for k, v in
            (("alike", alike), ("polar", polar))}
    assert gain["polar"] > 1.5 > gain["alike"] > 1.0
    # An odd number of GRPO groups: the top2 allocation still spends every leaf.
    odd = pool_shares(0.5, 0.2, pool_size=8, leaves=12, group=4, draws=5, rng=rng)
    assert 0.0 < odd["oracle_top2"]["share"] <= 1.0


def test_two_waves_gain_from_seeing_the_first():
    rng = np.random.default_rng(3)
    # Prompts that always or never succeed are never mixed, whatever the waves do.
    mixed, rolled = two_waves(np.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]), 4, 12, rng)
    assert mixed == 0.0 and 1 <= rolled <= 6
    # On coin flips the second wave, chosen after the first, buys more mixed prompts than the
    # same objective spending every leaf at once (12 for 48 leaves, see above; ~13 in two waves:
    # a third rollout of an agreeing pair flips it with 0.5, a fresh pair buys 0.25 per leaf).
    p = np.full(32, 0.5)
    once = root_gain(p, allocate_roots(p, 48)).sum()
    waves = np.mean([two_waves(p, 16, 48, rng)[0] for _ in range(60)])
    assert once == pytest.approx(12.0) and waves > once + 0.4


def test_mixed_probability_by_hand():  # the ceiling reads root_gain at correlation 0
    assert root_gain(np.array([0.5, 0.5, 0.9]), np.array([0, 2, 3])).tolist() == \
        pytest.approx([0.0, 0.5, 1 - 0.729 - 0.001])


def _flat_step(run, step, rewards_per_tree):
    rows = []
    for tree, rewards in enumerate(rewards_per_tree):
        base = {c: None for c in NODE_INPUT}
        root = dict(base, tree_id=tree, local_index=0, parent_index=-1, depth=0,
                    item_id=f"q{step}-{tree}", is_leaf=False, family="synthetic", text="question",
                    gen_token_ids=[], gen_logprobs=[], obs_token_ids=[1], predicted_v=0.5,
                    allocated_k=len(rewards), allocator="grpo")
        rows.append(root)
        for j, r in enumerate(rewards):
            rows.append(dict(base, tree_id=tree, local_index=j + 1, parent_index=0, depth=1,
                             item_id=root["item_id"], is_leaf=True, reward=float(r),
                             family="synthetic", text="answer", gen_token_ids=[5], gen_logprobs=[-1.0],
                             obs_token_ids=[], allocator="grpo",
                             action_json=json.dumps(Action(kind="answer", answer="1").to_json())))
    return rows


def test_reader_and_report_on_a_stored_grpo_run(tmp_path, capsys):
    job = tmp_path / "job-grpo-s0"
    job.mkdir()
    store = TreeStore(Paths(job).db)
    store.init_run("g", {"allocator": "grpo"})
    steps = {0: [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], 1: [[1, 1, 0, 1], [0, 1, 0, 0], [1, 1, 1, 1]]}
    for step, trees in steps.items():
        store.write_level("g", step, 0, pa.Table.from_pylist(_flat_step("g", step, trees),
                                                             schema=NODE_INPUT_SCHEMA), None,
                          dict(method="grpo", trajectories=12, prompt_tokens=3, generated_tokens=12,
                               tool_calls=0, wall_seconds=0.1))
        ids = [make_node_id("g", step, t, 0) for t in range(3)]
        store.update_values("g", step, pa.table({
            "node_id": ids, "value": pa.array([float(np.mean(r)) for r in trees], pa.float64()),
            "n_leaves": pa.array([4, 4, 4], pa.int64())}))
    groups = read_groups(tmp_path)
    assert sorted((s, v, n) for _, s, v, n in groups) == [(0, 0.0, 4), (0, 0.25, 4), (0, 1.0, 4),
                                                           (1, 0.25, 4), (1, 0.75, 4), (1, 1.0, 4)]
    rows = ceiling(groups, window=5, pool_size=8, draws=10, seed=0)
    assert len(rows) == 1 and rows[0]["leaves"] == 12 and rows[0]["observed"] == pytest.approx(3 / 6)
    main(["--workdir", str(tmp_path), "--pool-size", "8", "--draws", "10"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("ceiling: oracle Stage 1 ") and "x GRPO; oracle two waves " in last
    assert "; oracle top-3 " in last
    with pytest.raises(ValueError, match=r"steps 0-4: .*all successes"):
        ceiling([("r", 0, 1.0, 4), ("r", 1, 1.0, 4)], window=5, pool_size=8, draws=1, seed=0)
    with pytest.raises(ValueError, match="no dapo roots"):
        read_groups(tmp_path / "job-grpo-s0", allocator="dapo")
