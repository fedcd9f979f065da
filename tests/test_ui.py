"""The Prefect and MLflow UIs as their users meet them, in a real headless chromium.

Two module fixtures do what docs/deployments.md tells a user to do. ``ui_server``: a Prefect server
with its UI on 127.0.0.1, ``python -m deployments.deploy`` and a process worker (each in its own
process group); the run form's tests need only this. ``ui_run`` adds a 1-step ``train/cpu`` run
created through the API the UI's Run form calls (``POST /deployments/{id}/create_flow_run``) with
the default policy, so the flow runs the ``bootstrap-policy`` subflow and passes its policy on to
its tasks. Then ``mlflow ui`` and ``trace view`` serve the work dir. The tests read the runs back
through the API and open the pages a user opens, driving chromium over the DevTools protocol
(tests/browser.py): the UIs are single-page apps whose tabs render after their data arrives.
Every process the fixtures started is stopped."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from browser import Page, chromium_or_skip
from deployments.deploy import CPU_POOL
from servers import REPO, free_port, prefect_server, start, stop, tail, wait_until_up

# The bootstrap of the default policy is most of the fixture's time: 673 s beside other work on
# the 2-core machine (load 5-8); the run's one step and two evaluations took under a minute. In the
# full suite the worker's cache already holds that policy (test_exit's bootstrap test runs just
# before this module, tests/scheduling.py): the subflow runs and copies it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]

SMALL = {"run_name": "ui", "engine": "hf", "steps": 1, "root_budget": 4, "pool_size": 4,
         "max_turns": 2, "max_new_tokens": 16, "multiplier": 1, "eval_items": 4,
         "eval_samples": 2}
"""The default config (so the default ``tiny`` policy, bootstrapped by the subflow) made small."""

GENERATED = re.compile(r"[a-z]+(-[a-z]+)+")
"""A flow run name Prefect made up: adjective-animal (``rough-shrimp``)."""


@dataclass
class UiServer:
    api: str
    ui: str
    workdir: Path
    """The deployments' default work dir."""
    env: dict[str, str]
    """The environment of the server's processes."""
    worker_log: Path


@dataclass
class UiRun:
    api: str
    ui: str
    workdir: Path
    flow_run_id: str
    mlflow: str
    view: str
    flow_runs: list[Any]
    task_runs: list[Any]
    flows: dict[Any, str]
    artifacts: list[Any]


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiServer]:
    """The Prefect server with its UI, the deployments of the CPU pool and a worker."""
    home = tmp_path_factory.mktemp("ui_prefect_home")
    wd = tmp_path_factory.mktemp("ui") / "wd"
    with prefect_server(home, PREFECT_UI_ENABLED="true") as (api, env):
        deployed = subprocess.run([sys.executable, "-m", "deployments.deploy", "--pools",
                                   CPU_POOL, "--workdir", str(wd)], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=400)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        worker_log = home / "worker.log"
        worker = start([sys.executable, "-m", "prefect", "worker", "start", "--pool", CPU_POOL],
                       env, worker_log)
        try:
            yield UiServer(api, api.removesuffix("/api"), wd, env, worker_log)
        finally:
            stop(worker, signal.SIGINT)


@pytest.fixture(scope="module")
def ui_run(ui_server: UiServer) -> Iterator[UiRun]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api, wd, env, worker_log = (ui_server.api, ui_server.workdir, ui_server.env,
                                ui_server.worker_log)
    home = worker_log.parent
    procs: list[subprocess.Popen] = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: api}), \
                get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("train/cpu")
            run = client.create_flow_run_from_deployment(deployment.id,
                                                          parameters={"config": SMALL})
            deadline = time.monotonic() + 2700
            while not (state := client.read_flow_run(run.id).state).is_final():
                assert time.monotonic() < deadline, f"train/cpu still {state}:\n" \
                                                    f"{tail(worker_log)}"
                time.sleep(5)
            assert state.is_completed(), f"train/cpu ended {state}:\n{tail(worker_log)}"
            flow_runs = client.read_flow_runs()
            task_runs = client.read_task_runs()
            flows = {f.id: f.name for f in client.read_flows()}
            artifacts = [a for a in client.read_artifacts() if a.key]
        ports = free_port(), free_port()
        mlflow_log, view_log = home / "mlflow.log", home / "view.log"
        procs.append(start([sys.executable, "-m", "mlflow", "ui", "--workers", "1",  # ui_command's
                            "--backend-store-uri", f"sqlite:///{wd / 'mlflow.db'}", "--host", "127.0.0.1",
                            "--port", str(ports[0])], env, mlflow_log))
        procs.append(start([sys.executable, "-m", "cli", "view", "--workdir", str(wd),
                            "--port", str(ports[1])], env, view_log))
        mlflow, view = (f"http://127.0.0.1:{p}" for p in ports)
        wait_until_up(f"{mlflow}/health", procs[-2], mlflow_log, within=300)
        wait_until_up(f"{view}/healthz", procs[-1], view_log)
        yield UiRun(api, ui_server.ui, wd, str(run.id), mlflow, view, flow_runs, task_runs,
                    flows, artifacts)
    finally:
        for proc in reversed(procs):
            stop(proc, signal.SIGINT)


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    """A fresh browser (its own new profile): what a first visit sees."""
    with Page(chromium_or_skip(), tmp_path / "profile") as p:
        yield p


def _artifact(run: UiRun, prefix: str) -> Any:
    [found] = [a for a in run.artifacts if a.key.startswith(prefix)]
    return found


# ------------------------------------------------------------------ read back through the API


def test_no_task_run_records_a_subflow_result_as_input(ui_run: UiRun) -> None:
    """The bootstrap subflow's policy directory reaches the tasks as a plain value, so no
    task run records a ``flow_run`` input (which the pinned UI cannot render)."""
    boot = [r for r in ui_run.flow_runs if ui_run.flows[r.flow_id] == "bootstrap-policy"]
    assert len(boot) == 1 and boot[0].parent_task_run_id, boot  # the subflow did run
    [update] = [t for t in ui_run.task_runs if t.name.startswith("policy-update")]
    assert "policy_dir" in update.task_inputs  # inputs are recorded, the policy's among them
    inputs = [(t.name, key, i.input_type) for t in ui_run.task_runs
              for key, given in t.task_inputs.items() for i in given]
    assert [i for i in inputs if i[2] == "flow_run"] == []


def test_every_flow_run_and_task_run_has_a_readable_name(ui_run: UiRun) -> None:
    """No name Prefect made up (``rough-shrimp``, ``log-datasets-c70``,
    ``bootstrap-policy-0``); phases read ``<phase> step N``; a one-step run is ``step 0``."""
    flow_names = {r.name for r in ui_run.flow_runs}
    task_names = {t.name for t in ui_run.task_runs}
    made_up = [r.name for r in ui_run.flow_runs if GENERATED.fullmatch(r.name)] + \
              [t.name for t in ui_run.task_runs if t.name.endswith(f"-{t.dynamic_key[:3]}")]
    assert made_up == [], (made_up, flow_names, task_names)
    [train] = [r for r in ui_run.flow_runs if str(r.id) == ui_run.flow_run_id]
    assert re.fullmatch(r"ui-[0-9a-f]{10} step 0", train.name), train.name
    boot = "bootstrap-policy synth_arith d1 seed 0"
    assert boot in flow_names and boot in task_names
    assert {"log-datasets", "log-summary", "evaluate-policy step 0", "evaluate-policy step 1",
            "sync-weights step 0", "policy-update step 0"} <= task_names, task_names


def test_the_allocation_table_has_a_realised_v_for_every_prompt_rolled_out(ui_run: UiRun) -> None:
    """The allocation table reads the realised success rate from the nodes (``allocations.true_v``
    exists only in simulations)."""
    rows = json.loads(_artifact(ui_run, "allocation-").data)
    rolled = [r for r in rows if r["bare rollouts"]]
    assert rolled and all(re.fullmatch(r"[01]\.\d{3}", r["realised V"]) for r in rolled), rows


def test_the_champion_says_what_its_promotion_did(ui_run: UiRun) -> None:
    """The champion's description: "made the champion (...)", not the state before ("no champion yet"); "1 step"."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{ui_run.workdir / 'mlflow.db'}")
    champ = client.get_model_version_by_alias("trace-policy", "champion")
    assert champ.description.startswith("Policy after 1 step of TRACE run "), champ.description
    assert "Promotion: made the champion (the first version scored" in champ.description


# ------------------------------------------------------------------ in the browser


def test_task_runs_tab_lists_every_task_run_and_their_pages_render(ui_run: UiRun,
                                                                   page: Page) -> None:
    """The flow run's Task Runs tab lists every task run (it said "No
    task runs"), the policy-update task run's page shows its name (it was blank), and neither
    page logs an error (it logged ``Invalid TaskInputResponse``)."""
    subflows = {r.parent_task_run_id for r in ui_run.flow_runs}  # listed as Subflow Runs
    mine = [t for t in ui_run.task_runs
            if str(t.flow_run_id) == ui_run.flow_run_id and t.id not in subflows]
    page.goto(f"{ui_run.ui}/runs/flow-run/{ui_run.flow_run_id}")
    page.wait_for("document.body && document.body.innerText.includes('Task Runs')")
    page.click_text("Task Runs")
    page.wait_for(f"document.body.innerText.includes('{len(mine)} Task runs')")
    names = sorted(t.name for t in mine)
    page.wait_for(f"{json.dumps(names)}.every(n => document.body.innerText.includes(n))",
                  what=f"every task run listed: {names}")
    assert "No task runs" not in page.text()
    [update] = [t for t in mine if t.name.startswith("policy-update")]
    page.goto(f"{ui_run.ui}/runs/task-run/{update.id}")
    page.wait_for(f"document.body.innerText.includes('{update.name}') && "
                  f"document.body.innerText.includes('Completed')")
    assert page.errors == [], page.errors


def test_step_artifact_links_open(ui_run: UiRun, page: Page) -> None:
    """The step artifact's tree links are http URLs that open: the live one on `trace view`
    (the command that starts it is beside it), the MLflow one on the run's artifact."""
    md = _artifact(ui_run, "view-").data
    assert "file://" not in md, md
    assert f"`trace view --workdir {ui_run.workdir}`" in md
    live = re.search(r"\[live\]\((http://127\.0\.0\.1:8765/[^)]+)\)", md).group(1)
    page.goto(live.replace("http://127.0.0.1:8765", ui_run.view))
    page.wait_for("document.documentElement.dataset.rendered === '1'")
    assert re.search(r"Step 0\s+complete", page.text()), page.text()[:2000]
    assert page.errors == [], page.errors  # no favicon 404 either
    in_mlflow = re.search(r"\[in MLflow\]\((http://127\.0\.0\.1:5000/[^)]+)\)", md).group(1)
    page.goto(in_mlflow.replace("http://127.0.0.1:5000", ui_run.mlflow))
    page.wait_for("document.body.innerText.includes('step_0000.html')", within=120)


def test_the_printed_mlflow_run_url_opens_the_classic_run_page(ui_run: UiRun, page: Page) -> None:
    """The summary's MLflow run URL (what the CLI prints too), in a fresh browser, lands on
    the classic run page (its Model metrics tab), not the GenAI view."""
    summary = _artifact(ui_run, "summary-").data
    url = re.search(r"MLflow run \(on that UI\): <(http://127\.0\.0\.1:5000/[^>]+)>",
                    summary).group(1)
    assert url.endswith("?workflowType=machine_learning"), url
    page.goto(url.replace("http://127.0.0.1:5000", ui_run.mlflow))
    # the run page, with the classic view's navigation (Runs, Models, Model registry), not the
    # GenAI view's (Observability, Judges; the breadcrumb "Evaluations")
    page.wait_for("document.body.innerText.includes('Model metrics')", within=120,
                  what="the run page")
    text = page.text()
    assert "Model registry" in text and "Observability" not in text, text[:1500]


def test_the_schedule_card_says_when(ui_run: UiRun, page: Page) -> None:
    """The retrain-latest deployment's schedule card reads the time, not the slug ``cron``."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: ui_run.api}), \
            get_client(sync_client=True) as client:
        retrain = client.read_deployment_by_name("retrain-latest/cpu")
    page.goto(f"{ui_run.ui}/deployments/deployment/{retrain.id}")
    page.wait_for("document.body.innerText.includes('Schedules')")
    page.wait_for("document.body.innerText.includes('At 03:00 every day (UTC)')",
                  what="the schedule card's time")
    assert not re.search(r"(?m)^cron$", page.text()), page.text()[:3000]


# ------------------------------------------------------------------ the run form

_FIELD = """(label => [...document.querySelectorAll('.schema-form-property')].find(p => {
    const l = p.querySelector('.schema-form-property__label');
    return l && l.innerText.trim().replace(/ \\(Optional\\)$/, '') === label; }))"""
"""JS: the run form's field whose label reads ``label`` (the config's fields are optional)."""


def _field(page: Page, label: str) -> str:
    """The text of a field of the run form: its label, help and any error under it."""
    return str(page.eval(f"(() => {{ const p = {_FIELD}({json.dumps(label)}); "
                         f"return p ? p.innerText : ''; }})()"))


def _type(page: Page, label: str, text: str) -> None:
    """Replace the value of the run form's field ``label`` by typing ``text``."""
    found = page.eval(f"""(() => {{ const p = {_FIELD}({json.dumps(label)});
        const input = p && p.querySelector('input, textarea');
        if (input) {{ input.focus(); input.select(); }}
        return !!input; }})()""")
    assert found, f"no field {label!r}:\n{page.text()[:2000]}"
    page.call("Input.insertText", text=text)
    time.sleep(2)  # the form passes a value up one debounced level at a time (no DOM sign of it;
    # 2 s, not 1, for a loaded machine whose browser timers run late)


def _open_run_form(ui: UiServer, page: Page) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: ui.api}), \
            get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train/cpu")
    page.goto(f"{ui.ui}/deployments/deployment/{deployment.id}/run")
    page.wait_for("document.body && document.body.innerText.includes('Steps (Optional)')",
                  within=120, what="the run form")
    return deployment


def _flow_runs(ui: UiServer, deployment: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: ui.api}), \
            get_client(sync_client=True) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(
            id=DeploymentFilterId(any_=[deployment.id])))


def _stop_new_runs(ui: UiServer, deployment: Any, before: set[Any]) -> list[Any]:
    """The deployment's flow runs not in ``before``, any unfinished one cancelled: a run the form
    let through by mistake must not hold the pool (one run at a time) for a default training."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    new = [r for r in _flow_runs(ui, deployment) if r.id not in before]
    with temporary_settings(updates={PREFECT_API_URL: ui.api}), \
            get_client(sync_client=True) as client:
        for r in new:
            if not r.state.is_final():
                client.set_flow_run_state(r.id, Cancelling(), force=True)
    return new


def test_the_run_form_shows_a_bad_value_under_its_field(ui_server: UiServer, page: Page) -> None:
    """A number out of range and a malformed name, typed into the train/cpu form: Submit shows
    each refusal under its field and creates no run (it used to pass the form's check, whose schema
    had lost ``minimum`` and ``pattern``, and came back as a toast from the server). A corrected
    field loses its message without another Submit."""
    deployment = _open_run_form(ui_server, page)
    before = {r.id for r in _flow_runs(ui_server, deployment)}
    try:
        _type(page, "Steps", "0")
        _type(page, "Run Name", "bad name!")
        _type(page, "Exploration", "2")
        page.click_text("Submit")
        page.wait_for(f"{_FIELD}('Steps').innerText.includes('0 is less than the minimum of 1')",
                      what="the error under Steps")
        assert "'bad name!' does not match" in _field(page, "Run Name"), _field(page, "Run Name")
        assert "2 is greater than the maximum of 1" in _field(page, "Exploration")
        _type(page, "Run Name", "fixed")
        page.wait_for(f"!{_FIELD}('Run Name').innerText.includes('does not match')",
                      what="the corrected field's error gone")
        assert "less than the minimum" in _field(page, "Steps")
        assert page.eval("location.pathname").endswith("/run")  # still on the form
        assert page.eval("document.querySelectorAll('.p-toast-container__toast').length") == 0
        assert page.errors == [], page.errors  # no refused request either (it logged a 409)
    finally:
        created = _stop_new_runs(ui_server, deployment, before)
    assert created == []


def _submit_until_created(page: Page, tries: int = 3) -> None:
    """Submit the run form and wait for the run's page. A 503 from ``create_flow_run`` is the
    server's "retry" (Prefect answers it for database errors it deems retryable, SQLite busy for
    one; seen once on a loaded machine, the form left on /run, no run created): the user's next
    Submit, at most ``tries`` in all. Any other outcome fails as before, showing the page."""
    for attempt in range(1, tries + 1):
        seen = len(page.errors)
        page.click_text("Submit")
        try:
            page.wait_for("!location.pathname.endsWith('/run')", what="the run created")
            return
        except AssertionError:
            busy = any("status of 503" in e and "create_flow_run" in e
                       for e in page.errors[seen:])
            if not busy or attempt == tries:
                raise


def test_an_unticked_form_run_fails_before_the_flow_starts_naming_the_field(
        ui_server: UiServer, page: Page) -> None:
    """With "Validate parameters" unticked the form asks the server not to check the run
    (``enforce_parameter_schema: false``, which the pinned server obeys over the deployment's
    setting): the run is created, and fails at the flow's own parameter check, before the flow
    starts, naming the field. Without that override the server refuses it, naming the field."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deployment = _open_run_form(ui_server, page)
    before = {r.id for r in _flow_runs(ui_server, deployment)}
    _type(page, "Steps", "0")
    unticked = page.eval("""(() => {
        const box = [...document.querySelectorAll('input[type=checkbox]')].find(i =>
            i.closest('.p-checkbox, label')?.innerText.includes('Validate parameters'));
        if (box) box.click();
        return box ? !box.checked : null; })()""")
    assert unticked, page.text()[:3000]
    _submit_until_created(page)
    [run] = [r for r in _flow_runs(ui_server, deployment) if r.id not in before]
    if run.parameters["config"]["steps"] != 0:  # not what was typed
        _stop_new_runs(ui_server, deployment, before)
        pytest.fail(f"the form sent {run.parameters}")
    with temporary_settings(updates={PREFECT_API_URL: ui_server.api}), \
            get_client(sync_client=True) as client:
        try:
            deadline = time.monotonic() + 600
            while not (state := client.read_flow_run(run.id).state).is_final():
                assert time.monotonic() < deadline, f"{state}:\n{tail(ui_server.worker_log)}"
                time.sleep(2)
            assert state.is_failed(), state
            # the field as the form names it (tests/test_deployments.py checks the same message)
            assert re.search(r"config\.steps: Input should be greater than or equal to 1",
                             state.message), state.message
            with pytest.raises(Exception, match=r"Validation failed for field 'config\.steps'"):
                client.create_flow_run_from_deployment(deployment.id,
                                                       parameters={"config": {"steps": 0}})
        finally:  # the train run's fixture lists every flow run: leave only its own
            client.delete_flow_run(run.id)
