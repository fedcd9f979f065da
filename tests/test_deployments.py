"""Deployments against a real Prefect server on 127.0.0.1, and the
latest-checkpoint lookup behind the scheduled retraining deployment.

The integration test starts ``prefect server start`` (its own PREFECT_HOME, so its own SQLite
database) and ``prefect worker start --pool trace-cpu`` as subprocesses in their own process
groups, registers the deployments with ``python -m deployments.deploy``, triggers ``train/cpu`` and
then ``retrain-latest/cpu`` through the API, and checks the flow runs and the DuckDB rows they
left. Only the process groups it started are stopped, always.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from deployments.deploy import CPU_POOL, DEFAULT_CRON
from servers import prefect_server, start, stop, tail
from trace_rl.config import TrainConfig, fields
from trace_rl.storage.store import TreeStore

REPO = Path(__file__).resolve().parents[1]


def test_retrain_latest_refuses_a_pinned_run_id(tmp_path: Path) -> None:
    from deployments.retrain import retrain_latest

    with pytest.raises(ValueError, match="run_id"):
        retrain_latest.fn(config=TrainConfig(run_id="pinned"), workdir=str(tmp_path))


def test_train_deployment_form_is_typed_with_a_description_per_field() -> None:
    """The parameter schema the deployments send to the server (what the UI's run form renders
    and the server enforces) has, for every TrainConfig field, a typed property with the first
    sentence of its docstring as help (not the measurements behind the default), and refuses
    unknown fields; every parameter of the flows has help."""
    from deployments.deploy import deployments, deployment_specs

    by_flow = {d.flow_name: d for d in deployments(deployment_specs(), [CPU_POOL])}
    assert {"train", "retrain-latest", "evaluate"} <= set(by_flow)
    for name in ("train", "retrain-latest", "evaluate"):
        deployment = by_flow[name]
        assert deployment.enforce_parameter_schema
        schema = deployment._parameter_openapi_schema.model_dump()
        assert schema["properties"]["config"]["$ref"] == "#/definitions/TrainConfig"
        form = schema["definitions"]["TrainConfig"]
        assert set(form["properties"]) == set(fields())  # every family's options too
        for field, prop in form["properties"].items():
            assert prop.get("type") in ("integer", "number", "string", "boolean", "object"), field
            doc = " ".join(fields()[field].description.split())
            shown = " ".join(prop["description"].split())
            assert shown and doc.startswith(shown), field
            assert "+-" not in shown, (field, shown)  # no measurements in the help
        for name_, prop in schema["properties"].items():
            assert prop.get("description"), (name, name_)
        assert form["properties"]["allocator"]["enum"] == [
            "grpo", "dapo", "prompt_only", "random_prefix", "trace", "trace_cover"]
        assert form["properties"]["exploration"]["allOf"] == [{"maximum": 1, "minimum": 0}]
        assert form["properties"]["advantage"]["description"] == (
            "Tree advantage estimator (trace_core.advantages): branch, treepo, tree_grpo, "
            "segment, grpo.")
    assert set(by_flow["train"]._parameter_openapi_schema.properties) == {
        "config", "workdir", "wait"}


def test_a_refused_run_names_the_field_as_the_form_does() -> None:
    """The worker checks a flow run's parameters (those of a run whose form check was unticked)
    with the flow's own validation: a bad field is named ``config.steps``, as the form and the
    server name it, whether it was given flat or under its concern."""
    from prefect.exceptions import ParameterTypeError

    from flows.train import train

    for config in ({"steps": 0}, {"run": {"steps": 0}}, {"run.steps": 0}):
        with pytest.raises(ParameterTypeError) as err:
            train.validate_parameters({"config": config})
        assert re.search(r"^ - config\.steps: Input should be greater than or equal to 1$",
                         str(err.value), re.M), str(err.value)


FORM_KEEPS = {"position", "block_type_slug", "$ref", "anyOf", "allOf", "example", "default",
              "const", "description", "enum", "format", "items", "prefixItems", "properties",
              "required", "title", "type", "maxItems", "minItems", "definitions"}
"""What the pinned Prefect UI's run form keeps of each schema object it walks (prefect-ui-library's
schema mapper); tests/test_ui.py checks the real form."""


def _as_the_form_reads_it(node: dict) -> dict:
    out = {k: v for k, v in node.items() if k in FORM_KEEPS}
    for group in ("properties", "definitions"):
        if group in out:
            out[group] = {k: _as_the_form_reads_it(v) for k, v in out[group].items()}
    return out


def test_the_run_form_checks_every_constraint_the_server_enforces() -> None:
    """Every deployment's parameter schema refuses the same values as the flow's own (pydantic's)
    schema, each at its field, also as the run form reads it (without the keywords its mapper
    drops: ``minimum``, ``pattern``, ``additionalProperties``); the flow's own, so read, passes
    them all."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import validate

    from deployments.deploy import deployments, deployment_specs
    from flows.train import train

    deps = {d.flow_name: d for d in deployments(deployment_specs(), [CPU_POOL])}
    bad = [({"steps": 0}, ["config", "steps"]), ({"exploration": 2}, ["config", "exploration"]),
           ({"run_name": "bad name!"}, ["config", "run_name"]),
           ({"chain_hops": "2:x"}, ["config", "chain_hops"]),
           ({"learning_rate": 0}, ["config", "learning_rate"]),
           ({"policy": ""}, ["config", "policy"]), ({"stepz": 3}, ["config"]),
           ({"family": "nope"}, ["config", "family"])]
    original = parameter_schema(train).model_dump()
    for name in ("train", "retrain-latest", "evaluate"):
        schema = deps[name]._parameter_openapi_schema.model_dump()
        values = {"policy_dir": "p"} if name == "evaluate" else {}
        for config, where in bad:
            errors = [list(e.path) for e in validate({**values, "config": config}, schema)]
            form = [list(e.path) for e in validate({**values, "config": config},
                                                   _as_the_form_reads_it(schema))]
            assert errors == form == [where], (name, config, errors, form)
        assert validate({**values, "config": {"steps": 3, "extra": {"any": 1}}}, schema) == []
    for config, where in bad:
        assert [list(e.path) for e in validate({"config": config}, original)] == [where]
    # the flow's own schema, as the form reads it, lets every one through but the unknown family
    passed = [c for c, _ in bad if not validate({"config": c}, _as_the_form_reads_it(original))]
    assert passed == [c for c, _ in bad if "family" not in c]


# ------------------------------------------------------------------ a real server and worker

TINY = {"engine": "hf", "steps": 1, "root_budget": 4, "pool_size": 4, "max_turns": 2,
        "max_new_tokens": 16, "multiplier": 1, "eval_items": 4, "eval_samples": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str], Path]]:
    """A Prefect server on 127.0.0.1 with its own PREFECT_HOME; yields (api url, env, log dir)."""
    home = tmp_path_factory.mktemp("prefect_home")
    with prefect_server(home) as (api, env):
        yield api, env, home


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two flow runs through a worker; 480 s ran out on a loaded 2-core box
def test_deploy_and_run_through_a_real_server(server: tuple[str, dict[str, str], Path],
                                              tiny_model_dir: Path, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api, env, logs = server
    with temporary_settings(updates={PREFECT_API_URL: api}):
        deployed = _deploy_here()  # as its own process: the next test and test_ui's fixture
    assert "work pool trace-cpu: created" in deployed
    assert "deployment retrain-latest/cpu" in deployed
    assert "gpu" not in deployed  # only the pool asked for

    worker_log = logs / "worker.log"
    worker = start([sys.executable, "-m", "prefect", "worker", "start", "--pool", CPU_POOL],
                    env, worker_log)
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}):
            with get_client(sync_client=True) as client:
                pool = client.read_work_pool(CPU_POOL)
                assert pool.type == "process" and pool.concurrency_limit == 1
                assert pool.base_job_template["variables"]["properties"]["env"]["default"][
                    "CUDA_VISIBLE_DEVICES"] == ""
                scheduled = client.read_deployment_by_name("retrain-latest/cpu")
                assert [(s.schedule.cron, s.active) for s in scheduled.schedules] == [
                    (DEFAULT_CRON, False)]  # paused until someone resumes it
                assert scheduled.pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                                 {"directory": str(REPO)}}]
                # Values a user once typed into the form are refused by the server: no flow run is created.
                train_cpu = client.read_deployment_by_name("train/cpu")
                for bad in ({"family": "nope"}, {"steps": -1}, {"allocator": "trace2"},
                            {"exploration": 2}, {"stepz": 3}):
                    with pytest.raises(Exception, match="Validation failed") as refused:
                        client.create_flow_run_from_deployment(
                            train_cpu.id, parameters={"config": bad, "workdir": str(tmp_path)})
                    assert next(iter(bad)) in str(refused.value), str(refused.value)
                assert client.read_flow_runs() == []
            workdir = str(tmp_path / "wd")
            config = {**TINY, "policy": str(tiny_model_dir)}
            # on vLLM where installed: its engine processes must end with the flow run's process
            first_config = {**config, "engine": "vllm" if HAS_VLLM else "hf"}
            run = run_deployment("train/cpu", parameters={"config": first_config,
                                                          "workdir": workdir},
                                 timeout=600, poll_interval=2)
            assert run.state is not None and run.state.is_completed(), (
                f"train/cpu ended {run.state}:\n{tail(worker_log)}")
            assert _flow_run_processes_end(worker) == [], tail(worker_log)
            store = TreeStore(workdir, create=False)
            first = store.query("SELECT run_id FROM runs").column("run_id").to_pylist()
            assert len(first) == 1
            levels = store.query("SELECT level, count(*) AS n FROM nodes WHERE run_id = $r "
                                 "GROUP BY level ORDER BY level", {"r": first[0]}).to_pylist()
            assert [r["level"] for r in levels] == [0, 1] and all(r["n"] > 0 for r in levels)
            assert store.get_run(first[0])["status"] == "complete"
            _check_names_and_artifacts(run, first[0])

            # the scheduled deployment, triggered by hand: it must start from train's checkpoint
            again = run_deployment("retrain-latest/cpu",
                                   parameters={"config": config, "workdir": workdir},
                                   timeout=600, poll_interval=2)
            assert again.state is not None and again.state.is_completed(), (
                f"retrain-latest/cpu ended {again.state}:\n{tail(worker_log)}")
            # readable names, the train subflow's tracking task run's too
            assert re.fullmatch(r"retrain-latest trace-default \d{4}-\d\d-\d\d \d\d:\d\d UTC",
                                again.name), again.name
            with get_client(sync_client=True) as client:
                made_up = [t.name for t in client.read_task_runs()
                           if t.name.endswith(f"-{t.dynamic_key[:3]}")]
            assert made_up == []
        runs = {r["run_id"]: json.loads(r["config_json"]) for r in
                store.query("SELECT run_id, config_json FROM runs").to_pylist()}
        (second,) = set(runs) - set(first)
        # started from the registry's champion: the first run's policy, evaluated after training
        assert runs[second]["policy"] == str(Path(workdir) / "registry" / "trace-policy-v1" / "model")
        levels = store.query("SELECT DISTINCT level FROM nodes WHERE run_id = $r ORDER BY level",
                             {"r": second}).column("level").to_pylist()
        assert levels == [0, 1]
    finally:
        stop(worker, signal.SIGINT)  # Ctrl-C; a SIGTERM once left it running for over 8 s


HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _flow_run_processes_end(worker: subprocess.Popen, within: float = 60.0) -> list[str]:
    """The worker's descendants (its flow-run process, the engines it started) still running
    ``within`` seconds after the flow run completed: a flow run shuts its engines down
    (flows.common.RELEASES_ENGINES) and its process exits."""
    import psutil

    deadline = time.monotonic() + within
    while True:
        try:
            left = [p for p in psutil.Process(worker.pid).children(recursive=True)
                    if p.status() != psutil.STATUS_ZOMBIE]
        except psutil.Error:
            return []
        if not left or time.monotonic() > deadline:
            return [f"{p.pid} {p.name()}" for p in left if p.is_running()]
        time.sleep(1)


def _check_names_and_artifacts(run, run_id: str) -> None:
    """Read back from the server: the flow run is named by its run id and
    step range, its task runs by phase, step and wave, and it left a Markdown artifact
    per step, a table of the root allocation and the run's summary."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from tasks.track import _slug

    assert run.name == f"{run_id} step 0"
    with get_client(sync_client=True) as client:
        tasks = {t.name for t in client.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[run.id])))}
        artifacts = {a.key: a for a in client.read_artifacts() if a.flow_run_id == run.id and a.key}
    for name in ("allocate-roots step 0", "expand-roots step 0 wave 0", "expand-prefixes step 0",
                 "policy-update step 0", "log-step step 0"):
        assert any(t.startswith(name) for t in tasks), (name, sorted(tasks))
    slug = _slug(run_id)
    step = artifacts[f"view-{slug}-step-0"]
    assert step.type == "markdown"
    for text in ("| reward | effective ratio | leaves |", "Root allocation:", "MLflow run:",
                 "view/step_0000.html"):
        assert text in step.data, (text, step.data)
    table = artifacts[f"allocation-{slug}-0"]
    assert table.type == "table"
    rows = json.loads(table.data)
    assert 1 <= len(rows) <= TINY["pool_size"] and sum(r["bare rollouts"] for r in rows) > 0
    summary = artifacts[f"summary-{slug}"]
    assert "champion" in summary.data and "models:/trace-policy@champion" in summary.data


def _deploy(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "deployments.deploy", "--pools", CPU_POOL, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _deploy_here(*args: str) -> str:
    """``_deploy`` in this process (``PREFECT_API_URL`` already set to the server): the command's
    ``main``, without a new interpreter importing every flow again (30-60 s each when loaded)."""
    import contextlib
    import io

    from deployments.deploy import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--pools", CPU_POOL, *args]) == 0, out.getvalue()
    return out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a deploy imports every flow (over 3 min for four on a loaded 2-core box)
def test_deploy_again_keeps_what_the_user_switched(server: tuple[str, dict[str, str], Path]) -> None:
    """A user resumes the retrain schedule and pauses the train deployment in
    the UI; deploying again (the same command, or with new options) updates the deployments but
    leaves both switches as the user set them, and creates nothing twice. The first deploy is the
    command in a process of its own; the three after it run its ``main`` in this one."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api, env, _ = server
    _deploy(env)
    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        retrain = client.read_deployment_by_name("retrain-latest/cpu")
        (schedule,) = retrain.schedules
        assert schedule.slug == "At 03:00 every day (UTC)"  # the UI's schedule card shows it
        client.update_deployment_schedule(retrain.id, schedule.id, active=True)  # the UI toggle
        client.pause_deployment(client.read_deployment_by_name("train/cpu").id)
        before = {d.name + str(d.flow_id): d.id for d in client.read_deployments()}

        out = _deploy_here()
        _deploy_here("--cron", "0 4 * * *")  # new options: the schedule's cron changes, not its switch
        assert "exists, left as is" in out
        after = client.read_deployment_by_name("retrain-latest/cpu")
        assert [(s.id, s.schedule.cron, s.active, s.slug) for s in after.schedules] == [
            (schedule.id, "0 4 * * *", True, "At 04:00 every day (UTC)")]
        assert client.read_deployment_by_name("train/cpu").paused is True
        assert {d.name + str(d.flow_id): d.id for d in client.read_deployments()} == before

        # and the other way round: a schedule the user paused stays paused under
        # --activate-schedules, which only sets the state of a schedule that is new
        client.update_deployment_schedule(after.id, schedule.id, active=False)
        _deploy_here("--activate-schedules")
        again = client.read_deployment_by_name("retrain-latest/cpu")
        assert [s.active for s in again.schedules] == [False]
        client.resume_deployment(client.read_deployment_by_name("train/cpu").id)
