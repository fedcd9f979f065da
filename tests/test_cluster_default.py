"""With ``cluster`` empty (the default) a run is the single process it always was: Ray is never
imported, and the cluster fields stay out of the run id (a run resumes on another cluster size)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.config import ConfigError, TrainConfig, config_from_mapping

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a subprocess importing every flow (16-57 s)
@pytest.mark.timeout(600)
def test_ray_is_not_imported_on_the_default(tiny_model_dir):
    """Everything a default `trace train` imports, and the engine it builds, leave Ray out."""
    code = (
        "import sys\n"
        "import cli.app, flows.train, tasks.learn, tasks.expand, tasks.evaluate\n"
        "from tasks import runtime\n"
        "from trace_rl.config import TrainConfig\n"
        "cfg = TrainConfig(engine='hf', policy=sys.argv[1])\n"
        "assert cfg.cluster == ''\n"
        "engine = runtime.engine_for(cfg.engine, cfg.cluster_section, cfg.resolved_run_id,"
        " sys.argv[1])\n"
        "assert engine.name == 'hf', engine.name\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_cluster_fields_do_not_change_the_run_id():
    base = TrainConfig()
    on_ray = config_from_mapping({"cluster": "local:2", "rollout_engines": 2, "trainer_ranks": 2,
                                  "trainer_strategy": "fsdp2", "weight_sync": "broadcast"})
    assert on_ray.resolved_run_id == base.resolved_run_id
    assert config_from_mapping({"cluster": "auto"}).config_hash == base.config_hash


@pytest.mark.parametrize("values, says", [
    ({"cluster": "local:0"}, "cluster='local:0'"),
    ({"cluster": "nowhere"}, "cluster='nowhere'"),
    ({"rollout_engines": 2}, "need a Ray cluster"),
    ({"cluster": "local:2", "trainer_ranks": 0}, "trainer_ranks=0"),
    ({"cluster": "local:2", "weight_sync": "nccl"}, "weight_sync='nccl'"),
    ({"cluster": "local:2", "trainer_strategy": "zero3"}, "trainer_strategy"),
])
def test_bad_cluster_settings_are_named(values, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        config_from_mapping(values)


def test_cluster_addresses_are_accepted():
    for spec in ("", "local:1", "local:16", "auto", "10.0.0.5:6379", "ray://head.example:10001"):
        assert config_from_mapping({"cluster": spec}).cluster == spec


def test_train_cluster_deployment_on_its_own_pool():
    """`train/cluster` (docs/deployments.md): the train flow on the trace-cluster pool, whose
    default config is a valid cluster run."""
    from deployments.deploy import (CLUSTER_CONFIG, CLUSTER_POOL, deployment_specs, deployments,
                                    pool_specs)

    deps = deployments(deployment_specs(), [CLUSTER_POOL])
    assert [(d.flow_name, d.name) for d in deps] == [("train", "cluster")]
    assert deps[0].parameters["config"] == CLUSTER_CONFIG and deps[0].enforce_parameter_schema
    assert config_from_mapping(CLUSTER_CONFIG).cluster == "auto"
    assert "RAY_USAGE_STATS_ENABLED" in pool_specs()[CLUSTER_POOL].env
