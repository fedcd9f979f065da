"""`trace view` for real: a tiny `trace train` (CLI, Prefect, DuckDB, MLflow), its page written
with `trace view --out` and loaded in headless Debian chromium, the server answering while a
second `trace train` writes, and bad input refused with the store unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow as pa
import pytest

from trace_rl.storage.schema import NODE_INPUT_SCHEMA
from trace_rl.storage.store import TreeStore

REPO = Path(__file__).resolve().parents[1]
TINY = {"engine": "hf", "steps": 2, "root_budget": 4, "pool_size": 4, "max_turns": 2,
        "max_new_tokens": 16, "multiplier": 1, "family": "synth_arith", "difficulty": 1,
        "plot_every": 0, "eval_items": 0}
# A trained run (the module fixture: 62 s here at load 3, with the harness), then servers and
# subprocess trains beside it: up to 39 s each here, 823 s for one at load 45-70.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _trace(*args: str, timeout: float = 120, **popen) -> subprocess.CompletedProcess:
    """The CLI of this tree (``python -m cli``), as a user runs it."""
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO,
                          env=popen.pop("env", _env()), capture_output=True, text=True,
                          timeout=timeout, **popen)


def _sql(workdir: Path, query: str) -> list[dict]:
    out = _trace("sql", "--workdir", str(workdir), "--format", "json", query)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def _train_cmd(workdir: Path, policy: Path, **over: object) -> list[str]:
    cfg = {**TINY, "policy": str(policy), **over}
    return [sys.executable, "-m", "cli", "train", "--workdir", str(workdir),
            *[f"{k}={v}" for k, v in cfg.items()]]


def _digest(workdir: Path) -> dict[str, str]:
    """sha256 of every file of the store (published and private database, WAL, locks)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(workdir.iterdir()) if p.is_file() and "duckdb" in p.name}


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def trained(tiny_model_dir, prefect_harness, tmp_path_factory) -> tuple[Path, str]:
    """A real tiny `trace train steps=2` (the CLI, on the session's Prefect server): its work dir
    and run id."""
    from prefect.settings import PREFECT_API_URL

    wd = tmp_path_factory.mktemp("view") / "wd"
    # a run name of its own: another test trains the same config on the same Prefect server, and
    # the step artifacts' keys follow the run id
    out = subprocess.run(_train_cmd(wd, tiny_model_dir, run_name="view-fixture"), cwd=REPO,
                         capture_output=True, text=True,
                         env=_env(PREFECT_API_URL=PREFECT_API_URL.value()), timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    [run] = _sql(wd, "SELECT run_id FROM runs")
    return wd, run["run_id"]


# ------------------------------------------------------------------ the page in a browser


def _shown(dom: str) -> dict[str, int]:
    """What the loaded page shows: its counters and the tree nodes it drew."""
    counts = {m[0]: int(m[1]) for m in re.findall(r'id="count-([a-z]+)" data-n="(\d+)"', dom)}
    counts["drawn_nodes"] = len(re.findall(r'<g class="tnode[ "]', dom))
    counts["drawn_leaves"] = len(re.findall(r'<g class="tnode tleaf[ "]', dom))
    return counts


def _step_counts(wd: Path, run_id: str, step: int) -> dict[str, int]:
    [row] = _sql(wd, f"SELECT count(*) AS nodes, count(*) FILTER (WHERE is_leaf) AS leaves, "
                     f"count(DISTINCT tree_id) AS trees FROM nodes WHERE run_id = '{run_id}' "
                     f"AND step = {step}")
    [mixed] = _sql(wd, f"SELECT count(*) AS n FROM mixed_anchors WHERE run_id = '{run_id}' AND "
                       f"step = {step}")
    [pairs] = _sql(wd, f"SELECT count(*) AS n FROM contrast_pairs WHERE run_id = '{run_id}' AND "
                       f"step = {step}")
    return {**row, "anchors": mixed["n"], "pairs": pairs["n"]}


def _assert_page_matches(dom: str, console: list[str], want: dict[str, int]) -> None:
    assert console == [], console  # the page logs nothing unless something went wrong
    assert 'data-rendered="1"' in dom
    assert re.search(r'<div id="errors"></div>', dom), "the page reported an error"
    shown = _shown(dom)
    assert want["nodes"] > 0 and want["leaves"] > 0
    assert (shown["nodes"], shown["leaves"], shown["trees"]) == (want["nodes"], want["leaves"],
                                                                 want["trees"]), shown
    assert (shown["drawn_nodes"], shown["drawn_leaves"]) == (want["nodes"], want["leaves"]), shown
    assert (shown["anchors"], shown["pairs"]) == (want["anchors"], want["pairs"]), shown


def test_page_of_a_real_run_in_headless_chromium(trained, chromium, tmp_path):
    wd, run_id = trained
    before = _digest(wd)
    out = _trace("view", "--workdir", str(wd), "--out", str(tmp_path / "t.html"))
    assert out.returncode == 0, out.stdout + out.stderr
    page = (tmp_path / "t.html").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing from the network
    dom, console = chromium.load((tmp_path / "t.html").as_uri())
    _assert_page_matches(dom, console, _step_counts(wd, run_id, TINY["steps"] - 1))
    # The file holds every step: step 0 is one link away, with its own counts.
    dom, console = chromium.load((tmp_path / "t.html").as_uri() + "#step-0")
    _assert_page_matches(dom, console, _step_counts(wd, run_id, 0))
    assert _digest(wd) == before


def test_each_step_logs_its_page_to_mlflow_and_a_link_to_prefect(trained, chromium):
    """Each step's page in MLflow says the step is complete (it is logged as the step's last act
    and cannot change later); the step's Prefect artifact links to it over http (a browser does
    not open a file:// link from a web page): the live link opens the page on `trace view`, the
    MLflow link names the artifact in MLflow's classic view; the allocation table has the
    realised V of every prompt given bare rollouts; the served page logs no error."""
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    wd, run_id = trained
    [run] = _sql(wd, f"SELECT mlflow_run_id FROM runs WHERE run_id = '{run_id}'")
    client = MlflowClient(tracking_uri=f"sqlite:///{wd / 'mlflow.db'}")
    pages = sorted(a.path for a in client.list_artifacts(run["mlflow_run_id"], "view"))
    assert pages == [f"view/step_{s:04d}.html" for s in range(TINY["steps"])]
    for step, path in enumerate(pages):
        local = Path(client.download_artifacts(run["mlflow_run_id"], path, str(wd / "dl")))
        assert _data(local.read_text())["details"][str(step)]["status"] == "complete", path
    dom, console = chromium.load(local.as_uri())
    _assert_page_matches(dom, console, _step_counts(wd, run_id, TINY["steps"] - 1))
    slug = run_id.lower()
    with get_client(sync_client=True) as prefect:
        links = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=[f"view-{slug}-step-{s}" for s in range(TINY["steps"])])))
        tables = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=[f"allocation-{slug}-{s}" for s in range(TINY["steps"])])))
    assert len(links) == len(tables) == TINY["steps"]
    server, url = _start_server(wd)
    try:
        for a in links:
            step = int(a.key.rsplit("-", 1)[1])
            assert a.flow_run_id and "file://" not in a.data, a.data
            mlflow_link = re.search(r"\[in MLflow\]\((http://127\.0\.0\.1:5000/[^)]+)\)",
                                    a.data).group(1)
            assert mlflow_link.endswith(f"/runs/{run['mlflow_run_id']}/artifactPath/view/"
                                        f"step_{step:04d}.html?workflowType=machine_learning")
            live = re.search(r"\[live\]\((http://127\.0\.0\.1:8765/[^)]+)\)", a.data).group(1)
            assert f"trace view --workdir {wd}" in a.data
            # the link, on the port this test's `trace view` serves: the step's page, and
            # nothing on the console (no 404 for a favicon either)
            dom, console = chromium.load(live.replace("127.0.0.1:8765", url.split("/")[2]))
            assert console == [], console
            assert re.search(rf'<h2>Step {step} <span class="badge">complete</span>', dom), live
            _assert_page_matches(dom, console, _step_counts(wd, run_id, step))
    finally:
        _stop(server)
    for t in tables:
        step = int(t.key.rsplit("-", 1)[1])
        realised = {r["item_id"]: f"{r['value']:.3f}" for r in _sql(
            wd, f"SELECT item_id, value FROM nodes WHERE run_id = '{run_id}' AND step = {step} "
                f"AND depth = 0")}
        rows = json.loads(t.data)
        assert any(r["bare rollouts"] for r in rows)
        for r in rows:
            if r["bare rollouts"]:
                assert r["realised V"] == realised[r["item"]], (r, realised)


def test_a_page_of_a_step_still_being_written_with_hostile_text(chromium, tmp_path):
    """A step with only its bare rollouts (no backup yet) of a family with long observations, and
    text that would end a <script> block: the page loads, folds, and counts right."""
    store = TreeStore(tmp_path)
    store.init_run("qa-run", {"family": "hotpotqa", "allocator": "trace"})
    store.mark_step("qa-run", 0, "running")
    out = _trace("view", "--workdir", str(tmp_path), "--out", str(tmp_path / "empty.html"))
    assert out.returncode == 0, out.stdout + out.stderr
    dom, console = chromium.load((tmp_path / "empty.html").as_uri())  # a run with no tree yet
    assert console == [] and "No trees yet" in dom and 'data-rendered="1"' in dom
    long_obs = "paragraph " * 2000
    rows = [dict(tree_id=3, local_index=0, parent_index=-1, depth=0, item_id="q1", is_leaf=False,
                 family="hotpotqa", text="Who? </script><script>alert(1)</script><!--",
                 predicted_v=0.4, allocated_k=2)]
    for j, reward in ((1, 1.0), (3, 0.0)):
        rows += [dict(tree_id=3, local_index=j, parent_index=0, depth=1, item_id="q1",
                      is_leaf=False, family="hotpotqa", text='<think>search</think>',
                      action_json='{"tool": "search", "args": {"q": "</script>"}}',
                      observation=long_obs),
                 dict(tree_id=3, local_index=j + 1, parent_index=j, depth=2, item_id="q1",
                      is_leaf=True, family="hotpotqa", text="answer", reward=reward)]
    store.write_level("qa-run", 0, 0, pa.Table.from_pylist(rows, schema=NODE_INPUT_SCHEMA),
                      allocations=pa.table({"node_id": ["qa-run/s0/t3/n0"], "allocator": ["trace"],
                                            "k": pa.array([2], pa.int64()),
                                            "predicted_v": [0.4]}))
    out = _trace("view", "--workdir", str(tmp_path), "--out", str(tmp_path / "t.html"))
    assert out.returncode == 0, out.stdout + out.stderr
    dom, console = chromium.load((tmp_path / "t.html").as_uri())
    _assert_page_matches(dom, console, {"nodes": 5, "leaves": 2, "trees": 1, "anchors": 1,
                                        "pairs": 1})
    assert "<script>alert(1)" not in dom  # the text is shown, never run


def test_a_deep_tree_stays_inside_its_box_at_1400_px(chromium, tmp_path):
    """A depth-4 tree (three levels of branch points, leaves at depth 4) fits its
    box at a 1400 px wide window, its columns narrowed; nothing runs under the node panel."""
    import shutil as _shutil

    from browser import Page

    store = TreeStore(tmp_path)
    store.init_run("deep", {"family": "synth_arith", "allocator": "trace"})
    rows, frontier = [], [None]
    for depth in range(5):
        nxt = []
        for parent in frontier:
            for _ in (1,) if parent is None else (0, 1):
                rows.append(dict(tree_id=0, local_index=len(rows), is_leaf=depth == 4,
                                 parent_index=-1 if parent is None else parent, depth=depth,
                                 item_id="q1", family="synth_arith", text=f"turn {depth}",
                                 reward=float(len(rows) % 2) if depth == 4 else None))
                nxt.append(len(rows) - 1)
        frontier = nxt
    store.write_level("deep", 0, 0, pa.Table.from_pylist(rows, schema=NODE_INPUT_SCHEMA))
    out = _trace("view", "--workdir", str(tmp_path), "--out", str(tmp_path / "deep.html"))
    assert out.returncode == 0, out.stdout + out.stderr
    with Page(_shutil.which("chromium"), tmp_path / "profile", width=1400, height=900) as page:
        page.goto((tmp_path / "deep.html").as_uri())
        page.wait_for("document.documentElement.dataset.rendered === '1'")
        box, svg, aside = (page.eval(f"(() => {{ const r = document.querySelector({sel!r})"
                                     ".getBoundingClientRect(); return [r.left, r.right]; })()")
                           for sel in (".tree", ".treesvg", "aside"))
        overflow = page.eval("document.querySelector('main').scrollWidth - "
                             "document.querySelector('main').clientWidth")
        assert page.errors == [], page.errors
    assert len(rows) == 1 + 2 + 4 + 8 + 16
    assert svg[1] <= box[1] <= aside[0], (svg, box, aside)
    assert overflow <= 0, overflow


# ------------------------------------------------------------------ serving


def _start_server(wd: Path, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "cli", "view", "--workdir", str(wd),
                             "--port", "0", *args], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:\d+/\S*", line)
    if not found:
        proc.kill()
        raise AssertionError(f"no URL from trace view: {line}{proc.stdout.read()}")
    return proc, found.group(0)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_view_serves_while_a_second_train_writes(trained, tiny_model_dir, prefect_harness):
    from prefect.settings import PREFECT_API_URL

    wd, run_id = trained
    server, url = _start_server(wd)
    base = url.split("?")[0]
    writer = subprocess.Popen(_train_cmd(wd, tiny_model_dir, seed=7, steps=1), cwd=REPO,
                              env=_env(PREFECT_API_URL=PREFECT_API_URL.value()),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen_runs, answers = set(), 0
    try:
        deadline = time.time() + 600
        while writer.poll() is None and time.time() < deadline:
            code, body = _get(base)
            assert code == 200, body[:500]
            if writer.poll() is None:
                seen_runs.add(len(_data(body)["runs"]))
                answers += 1
            time.sleep(0.3)
        assert writer.wait(timeout=60) == 0, writer.stdout.read()[-3000:]
        # Served after it finished: the new run by default, the first run's page as it was.
        code, body = _get(base)
        assert code == 200 and _data(body)["run"] != run_id
        code, body = _get(f"{base}?run={run_id}&step=0")
        assert code == 200 and _data(body)["run"] == run_id
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        _stop(server)
    # Several answers while the second run was alive, and they saw it appear.
    assert answers >= 3 and 2 in seen_runs, (answers, seen_runs)


def _data(page: str) -> dict:
    return json.loads(re.search(r'id="trace-data" type="application/json">(.*?)</script>', page,
                                re.S).group(1))


# ------------------------------------------------------------------ bad input


def _refused(wd: Path, *args: str, out: Path | None = None) -> str:
    """Run `trace view` expecting a refusal: status 2, one line, no page, nothing changed."""
    before = _digest(wd) if wd.is_dir() else {}
    target = out or wd.parent / "never.html"
    res = _trace("view", "--workdir", str(wd), "--out", str(target), *args)
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert not target.exists()
    assert (_digest(wd) if wd.is_dir() else {}) == before
    return lines[0]


def test_bad_input_gets_one_line_and_leaves_the_store_unchanged(trained, tmp_path):
    wd, run_id = trained
    msg = _refused(wd, "no-such-run")
    assert "run 'no-such-run'" in msg and run_id in msg
    msg = _refused(wd, run_id, "--step", "99")
    assert "step 99" in msg and "steps 0-1" in msg
    empty = tmp_path / "empty"
    TreeStore(empty)  # a store with its schema and no run
    assert "no runs" in _refused(empty) and str(empty) in _refused(empty)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "trace.duckdb").write_bytes(os.urandom(1 << 16))
    msg = _refused(corrupt)
    assert "not a readable DuckDB database" in msg and str(corrupt / "trace.duckdb") in msg
    msg = _refused(tmp_path / "nothing-here")
    assert "no TRACE database" in msg
    # Served: the same refusals, before any port opens; a bad request gets the line as a 404.
    res = _trace("view", "--workdir", str(wd), "--port", "0", "no-such-run")
    assert res.returncode == 2 and "run 'no-such-run'" in res.stdout + res.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = _trace("view", "--workdir", str(wd), "--port", str(taken.getsockname()[1]))
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "cannot listen on 127.0.0.1:" in lines[0]
    before = _digest(wd)
    server, url = _start_server(wd, run_id)
    try:
        base = url.split("?")[0]
        code, body = _get(f"{base}?run={run_id}&step=42")
        assert code == 404 and "step 42" in body and len(body.strip().splitlines()) == 1
        code, body = _get(f"{base}?step=x")
        assert code == 400 and "'x'" in body
    finally:
        _stop(server)
    assert _digest(wd) == before


def test_stage2_figures_of_a_prefix_are_rebuilt_from_the_store(tmp_path):
    """q = r p + (1 - r)(1 - p) from the Stage 2 score and the bare rollout's outcome, K from the
    allocation, 1 - q^K; the root's m_i and v; mixed anchors and pairs as the SQL views say."""
    from trace_rl.view import page_data

    store = TreeStore(tmp_path)
    store.init_run("r", {"family": "synth_arith", "allocator": "trace"})
    n = lambda **kw: dict(tree_id=0, item_id="i", family="synth_arith", is_leaf=False, **kw)  # noqa: E731
    bare = [n(local_index=0, parent_index=-1, depth=0, predicted_v=0.3, allocated_k=2),
            n(local_index=1, parent_index=0, depth=1), n(local_index=2, parent_index=1, depth=2),
            {**n(local_index=3, parent_index=2, depth=3), "is_leaf": True, "reward": 1.0},
            {**n(local_index=4, parent_index=0, depth=1), "is_leaf": True, "reward": 1.0}]
    alloc0 = pa.table({"node_id": ["r/s0/t0/n0"], "allocator": ["trace"],
                       "k": pa.array([2], pa.int64()), "predicted_v": [0.3]})
    store.write_level("r", 0, 0, pa.Table.from_pylist(bare, schema=NODE_INPUT_SCHEMA), alloc0)
    cont = [n(local_index=5, parent_index=1, depth=2),
            {**n(local_index=6, parent_index=5, depth=3), "is_leaf": True, "reward": 0.0},
            {**n(local_index=7, parent_index=1, depth=2), "is_leaf": True, "reward": 1.0}]
    alloc1 = pa.table({"node_id": ["r/s0/t0/n1", "r/s0/t0/n2"], "allocator": ["trace"] * 2,
                       "k": pa.array([2, 0], pa.int64()), "predicted_v": [0.2, 0.9]})
    store.write_level("r", 0, 1, pa.Table.from_pylist(cont, schema=NODE_INPUT_SCHEMA), alloc1)
    d = page_data(TreeStore(tmp_path, create=False))["details"]["0"]
    [tree] = d["trees"]
    node = {x["slot"]: x for x in tree["nodes"]}
    assert (tree["m"], tree["v"], tree["leaves"], tree["mixed"]) == (2, 0.3, 4, True)
    assert node[1]["k"] == 2 and node[1]["observed"] == 1.0
    assert node[1]["q"] == pytest.approx(0.2) and node[1]["score"] == pytest.approx(1 - 0.2 ** 2)
    assert node[2]["k"] == 0 and node[2]["q"] == pytest.approx(0.9) and node[2]["score"] == 0.0
    assert node[1]["value"] == pytest.approx(2 / 3) and node[1]["mixed"]  # no backup yet: leaves
    assert node[3]["k"] is None and node[3]["reward"] == 1.0
    views = {k: store.query(f"SELECT count(*) AS n FROM {k}").to_pylist()[0]["n"]
             for k in ("mixed_anchors", "contrast_pairs")}
    assert (d["counts"]["mixed_anchors"], d["counts"]["contrast_pairs"]) == (
        views["mixed_anchors"], views["contrast_pairs"])
    assert d["counts"]["branch_points"] == 1 and d["counts"]["root_budget"] == 2
    assert d["leaves_per_level"] == [{"level": 0, "leaves": 2}, {"level": 1, "leaves": 2}]
