"""The scale-out end to end: ``trace train cluster=local:2 rollout_engines=2 trainer_ranks=2
engine=hf`` runs end to end (Prefect flow in the driver, engines and trainer ranks as Ray actors
on two simulated nodes) and stores the trees the single-process run stores: the same nodes,
tokens, rewards and values, log-probs within 1e-4. Both runs get the same run id (the cluster
fields are not part of it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.storage.store import TreeStore

# Two `trace train` subprocesses, one on a local Ray cluster (236 s + 71 s set-up at load 20).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness"), pytest.mark.timeout(1800)]
pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
TINY = {"engine": "hf", "steps": 2, "root_budget": 4, "pool_size": 4, "max_turns": 2,
        "max_new_tokens": 16, "multiplier": 1, "family": "synth_arith", "difficulty": 1,
        "plot_every": 0, "eval_items": 4, "eval_samples": 1}
COLUMNS = ("node_id, step, parent_id, tree_id, level, depth, item_id, text, gen_token_ids, "
           "obs_token_ids, gen_logprobs, reward, value, n_leaves, advantage, allocated_k")


def _train(workdir: Path, extra: dict) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, PYTHONPATH=str(REPO), PREFECT_API_URL=PREFECT_API_URL.value(),
               MLFLOW_DISABLE_TELEMETRY="true", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "cli", "train", "--workdir", str(workdir),
           *[f"{k}={v}" for k, v in {**TINY, **extra}.items()]]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)


def _nodes(workdir: Path) -> list[dict]:
    store = TreeStore(workdir / "trace.duckdb")
    return store.query(f"SELECT {COLUMNS} FROM nodes ORDER BY node_id", {}).to_pylist()


@pytest.mark.parametrize("sync", ["broadcast"])
def test_cluster_run_stores_the_single_process_trees(tiny_model_dir, tmp_path, sync):
    policy = {"policy": str(tiny_model_dir)}
    one = _train(tmp_path / "one", policy)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    ray_run = _train(tmp_path / "ray", {**policy, "cluster": "local:2", "rollout_engines": 2,
                                        "trainer_ranks": 2, "weight_sync": sync})
    assert ray_run.returncode == 0, ray_run.stdout[-3000:] + ray_run.stderr[-3000:]
    log = ray_run.stdout + ray_run.stderr
    assert "cluster: starting Ray cluster local:2" in log and "engine pool ready" in log
    a, b = _nodes(tmp_path / "one"), _nodes(tmp_path / "ray")
    assert len(a) == len(b) > 0 and {r["level"] for r in a} == {0, 1}
    for x, y in zip(a, b):
        lx, ly = x.pop("gen_logprobs") or [], y.pop("gen_logprobs") or []
        adv_x, adv_y = x.pop("advantage"), y.pop("advantage")
        assert x == y
        assert len(lx) == len(ly) and all(abs(p - q) <= 1e-4 for p, q in zip(lx, ly))
        assert (adv_x is None) == (adv_y is None) and abs((adv_x or 0) - (adv_y or 0)) < 1e-9
    # Step 1 was rolled out with the weights the two ranks computed: both steps compared.
    assert {r["step"] for r in a} == {0, 1}
