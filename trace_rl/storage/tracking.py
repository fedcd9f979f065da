"""MLflow tracking for a TRACE run: a local store in the work dir, namespaced metrics, artifacts.

One MLflow run per training flow run (docs/architecture.md). The default store needs no server:
``sqlite:///<workdir>/mlflow.db`` for runs and the model registry, ``<workdir>/mlruns`` for
artifacts; ``mlflow ui --workers 1 --backend-store-uri sqlite:///<workdir>/mlflow.db`` shows it.

Everything goes through an ``MlflowClient`` with an explicit run id rather than the fluent
``mlflow.start_run`` API, whose active run is global per thread: Prefect runs tasks in worker
threads, and a resumed flow must write to the run it had, not to whatever run is active.

Checkpoints and the model registry (``log_checkpoint``, ``promote``, ``champion``) are
``Tracker``'s methods too, written in ``trace_rl.storage.model_registry``.
"""

from __future__ import annotations

import math
import os
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow import MlflowClient  # noqa: E402  (telemetry must be off before mlflow is imported)
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402

from trace_rl.storage import background  # noqa: E402
from trace_rl.storage.locks import file_lock  # noqa: E402
from trace_rl.storage.model_registry import (CANDIDATE, CHAMPION,  # noqa: E402,F401 (re-exported)
                                             CHECKPOINT_KINDS, MODEL_DESCRIPTIONS, RUN_TAG,
                                             ModelRegistry, TrackingError)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NAMESPACES = ("rollout/", "alloc/", "tree/", "predictor/", "loss/", "ledger/", "time/", "eval/")
END_STATUSES = ("FINISHED", "FAILED", "KILLED")
MLFLOW_UI = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` serves unless told otherwise."""
EXPERIMENT_KIND = "mlflow.experimentKind"
"""The experiment tag MLflow 3's UI reads to choose its view; unset, it guesses, and guessed the
GenAI view for TRACE's experiment."""
CLASSIC_ML = "custom_model_development"
"""Its value for the classic view: runs, metrics charts, models."""
PARAM_VALUE_LIMIT = 6000  # MLflow's limit on one param value, in characters
_BATCH = 1000  # MLflow's limit on metrics per log_batch call
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _forget_artifact_repo(run_id: str, artifact_uri: str) -> None:
    """Drop MLflow's process-wide cached artifact repository of ``run_id`` if it points elsewhere
    than ``artifact_uri``. MLflow caches it by run id alone, so in a process that logged to a
    work dir and then opens a copy of it (the same run ids), the copy's artifacts would go to
    the original."""
    from mlflow.tracking._tracking_service import utils

    cache = getattr(utils, "_artifact_repos_cache", None)
    repo = cache.get(run_id) if cache is not None else None
    if repo is not None and getattr(repo, "artifact_uri", None) != artifact_uri:
        cache.pop(run_id, None)


def empty_store() -> Path:
    """An MLflow sqlite store with MLflow's tables and nothing logged, made once per MLflow version
    under ``environ.cache_dir()/mlflow`` (one process at a time; written whole, then renamed)."""
    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from trace_rl.environ import cache_dir

    folder = cache_dir() / "mlflow"
    path = folder / f"empty-{mlflow.__version__}.db"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / ".empty-store.lock", 600, "MLflow empty store"):
        if not path.exists():
            part = folder / f".empty-{os.getpid()}.part"
            part.unlink(missing_ok=True)
            store = SqlAlchemyStore(f"sqlite:///{part}", str(folder / "mlruns"))
            store.engine.dispose()
            os.replace(part, path)
    return path


class Tracker(ModelRegistry):
    """The MLflow side of one work dir. Call ``start_or_resume`` before logging."""

    def __init__(self, workdir: str | Path, experiment: str = "trace",
                 tracking_uri: str | None = None):
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = tracking_uri or f"sqlite:///{self.workdir / 'mlflow.db'}"
        self.artifact_root = self.workdir / "mlruns"
        self.experiment = experiment
        # The first use of a new sqlite store runs MLflow's schema migrations; two processes doing
        # that at once corrupt it ("no such column: spans.dimension_attributes"), so
        # processes of one work dir take their first look at the store one at a time.
        with file_lock(self.workdir / ".mlflow-setup.lock", 600, "MLflow store set-up"):
            self._seed_new_store()
            self.client = MlflowClient(tracking_uri=self.tracking_uri,
                                       registry_uri=self.tracking_uri)
            self.relocated = self._relocate()
            self.experiment_id = self._experiment_id()
        self.run_id: str | None = None
        self.trace_run_id: str | None = None
        self.finished_at: int | None = None  # the end time of a resumed FINISHED run
        self.logged_new = False  # whether this session logged a metric or a model

    def _seed_new_store(self) -> None:
        """Give a new work dir's own ``mlflow.db`` MLflow's tables by copying an empty store that
        ``empty_store`` makes once per MLflow version: MLflow's schema migrations take 3-6 s of
        CPU for every new store. The copy's Default experiment is pointed at this work dir's
        ``mlruns``. On any failure the store is left to MLflow, which creates it as before."""
        import shutil
        import sqlite3

        db = self.workdir / "mlflow.db"
        if self.tracking_uri != f"sqlite:///{db}" or db.exists():
            return
        part = db.with_name(f".mlflow.db.{os.getpid()}.part")
        try:
            shutil.copyfile(empty_store(), part)
            con = sqlite3.connect(part)
            try:
                with con:
                    now = int(time.time() * 1000)
                    con.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, "
                                "last_update_time = ? WHERE experiment_id = 0",
                                (str(self.artifact_root / "0"), now, now))
            finally:
                con.close()
            os.replace(part, db)
        except (OSError, sqlite3.Error, MlflowException) as exc:
            part.unlink(missing_ok=True)
            warnings.warn(f"MLflow store {db}: no empty store to copy ({exc}); MLflow creates it",
                          stacklevel=2)

    def _relocate(self) -> str | None:
        """Point the store's artifact locations at this work dir if it was copied or moved.

        MLflow records absolute artifact locations (the experiment's, each run's, each logged
        model's and model version's), so a copied work dir would log its artifacts into the
        original. When the store is the work dir's own ``mlflow.db`` and its experiment's
        location is another folder's ``mlruns``, every location under that folder is rewritten
        to the same place under this one (one transaction). MLflow's API cannot change an
        experiment's artifact location, so this is done in the store's tables. Returns the old
        work dir's URI, or None when nothing was moved.
        """
        import sqlite3
        from urllib.parse import unquote, urlparse

        db = self.workdir / "mlflow.db"
        if self.tracking_uri != f"sqlite:///{db}" or not db.exists():
            return None
        new = self.artifact_root.as_uri()
        con = sqlite3.connect(db, timeout=60)
        try:
            try:
                row = con.execute("SELECT artifact_location FROM experiments WHERE name = ?",
                                  (self.experiment,)).fetchone()
            except sqlite3.OperationalError:  # a store MLflow has not set up yet
                return None
            old = row[0] if row else None
            if not old or old == new or not old.startswith("file://") \
                    or not old.rstrip("/").endswith("/mlruns"):
                return None
            old_root, new_root = old.rstrip("/")[:-len("mlruns")], new[:-len("mlruns")]
            prefixes = [(old_root, new_root),  # URIs, and the same as plain paths
                        (unquote(urlparse(old_root).path), unquote(urlparse(new_root).path))]
            columns = [("experiments", "artifact_location"), ("runs", "artifact_uri"),
                       ("logged_models", "artifact_location"), ("model_versions", "source"),
                       ("model_versions", "storage_location")]
            have = {t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            with con:
                for table, col in columns:
                    if table not in have:
                        continue
                    for a, b in prefixes:
                        con.execute(f"UPDATE {table} SET {col} = ? || substr({col}, ?) "
                                    f"WHERE substr({col}, 1, ?) = ?", (b, len(a) + 1, len(a), a))
            return old_root
        finally:
            con.close()

    def _experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            if exp.tags.get(EXPERIMENT_KIND) is None:  # a store made before the tag was set
                self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, CLASSIC_ML)
            return exp.experiment_id
        try:
            return self.client.create_experiment(self.experiment,
                                                 artifact_location=self.artifact_root.as_uri(),
                                                 tags={EXPERIMENT_KIND: CLASSIC_ML})
        except MlflowException:  # another process created it between our two calls
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    @property
    def ui_command(self) -> str:
        """The command that shows this store in a browser. One worker process: MLflow's default of
        four, each importing MLflow, crash-looped on a 2-core machine busy training (uvicorn's
        supervisor restarts a worker that misses its ping while it starts), and one serves one
        user."""
        return f"mlflow ui --workers 1 --backend-store-uri {self.tracking_uri}"

    def ui_url(self, run_id: str | None = None, artifact: str | None = None) -> str:
        """Where ``ui_command``'s server (its default address) shows a run of this store (default:
        the current one), or one of its artifacts, in MLflow's classic view. The UI keeps a
        per-browser switch between its GenAI and classic views that defaults to GenAI whatever
        the experiment's tag says; the URL's ``workflowType`` sets it."""
        run = run_id or self._run()
        page = f"experiments/{self.experiment_id}/runs/{run}"
        page += f"/artifactPath/{artifact}" if artifact else ""
        return f"{MLFLOW_UI}/#/{page}?workflowType=machine_learning"

    def _run(self) -> str:
        if self.run_id is None:
            raise TrackingError("no MLflow run: call Tracker.start_or_resume first")
        return self.run_id

    # ---------------------------------------------------------------- run lifecycle

    def start_or_resume(self, trace_run_id: str, run_name: str | None = None,
                        mlflow_run_id: str | None = None,
                        tags: Mapping[str, str] | None = None) -> str:
        """Continue the MLflow run of this TRACE run if there is one, else start it (named
        ``run_name``, with ``tags``); return its id.

        The run is found by ``mlflow_run_id`` when given (e.g. from the DuckDB runs table), else
        by the tag ``trace.run_id``. A resumed run is set RUNNING again; if it had FINISHED and
        this session logs nothing new, ``end`` gives it back its old end time.
        """
        if not isinstance(trace_run_id, str) or not _RUN_ID.match(trace_run_id):
            raise TrackingError(f"trace_run_id {trace_run_id!r} must match {_RUN_ID.pattern}")
        run = None
        if mlflow_run_id is not None:
            run = self.client.get_run(mlflow_run_id)
            tag = run.data.tags.get(RUN_TAG)
            if tag != trace_run_id:
                raise TrackingError(f"MLflow run {mlflow_run_id} belongs to TRACE run {tag!r}, "
                                    f"not {trace_run_id!r}")
        else:
            found = self.client.search_runs(
                [self.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{trace_run_id}'",
                order_by=["attributes.start_time ASC"], max_results=1)
            run = found[0] if found else None
        self.finished_at = None
        self.logged_new = False
        if run is None:
            run = self.client.create_run(self.experiment_id, run_name=run_name or trace_run_id,
                                         tags={**(tags or {}), RUN_TAG: trace_run_id})
        elif run.info.status != "RUNNING":
            if run.info.status == "FINISHED":
                self.finished_at = run.info.end_time
            self.client.update_run(run.info.run_id, status="RUNNING")
        _forget_artifact_repo(run.info.run_id, run.info.artifact_uri)
        self.run_id = run.info.run_id
        self.trace_run_id = trace_run_id
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        """Close the run as FINISHED, FAILED or KILLED, once the work dir's background logging
        (``trace_rl.storage.background``) has run. An error it raised is raised here before a
        FINISHED run is closed (a run whose logging failed does not end FINISHED); a run that
        ends FAILED or KILLED is closed anyway (its failure is the error to report; the failed
        logging stays in the journal of whoever submitted it)."""
        if status not in END_STATUSES:
            raise TrackingError(f"end status {status!r} is not one of {END_STATUSES}")
        try:
            background.drain(self.workdir)
        except Exception as exc:  # noqa: BLE001 -- a failing run is closed all the same
            if status == "FINISHED":
                raise
            warnings.warn(f"MLflow logging of the failed run also failed: {exc!r}", stacklevel=2)
        # a finished run resumed with nothing to do keeps its end time (a no-op resume
        # once stretched an 8-minute run to 172 minutes)
        keep = status == "FINISHED" and self.finished_at is not None and not self.logged_new
        self.client.set_terminated(self._run(), status=status,
                                   end_time=self.finished_at if keep else None)

    # ---------------------------------------------------------------- params and metrics

    def log_config(self, config: Mapping[str, Any], mutable: Collection[str] = ()) -> int:
        """Log the config as params (nested keys dotted). Returns how many params were new.

        Params are immutable in MLflow: on resume, keys already logged must keep their values;
        a changed value is an error naming the keys rather than a silently mixed run. The
        top-level keys in ``mutable`` (those a run may resume with other values of) go in tags
        ``trace.<key>`` instead, which hold the latest value.
        """
        tags = [RunTag(f"trace.{k}", str(config[k])) for k in mutable if k in config]
        config = {k: v for k, v in config.items() if k not in mutable}
        flat = {k: "None" if v is None else str(v) for k, v in flatten(config).items()}
        long = [k for k, v in flat.items() if len(v) > PARAM_VALUE_LIMIT]
        if long:
            raise TrackingError(f"config value(s) longer than {PARAM_VALUE_LIMIT} characters for "
                                f"{long}: log them as an artifact instead")
        have = self.client.get_run(self._run()).data.params
        changed = sorted(k for k, v in flat.items() if k in have and have[k] != v)
        if changed:
            raise TrackingError(f"config differs from the resumed run's params for {changed} "
                                f"(e.g. {changed[0]}: {have[changed[0]]!r} -> {flat[changed[0]]!r});"
                                f" start a new run to change them")
        new = [Param(k, v) for k, v in sorted(flat.items()) if k not in have]
        # tags only once the params are known to agree, so a refused resume changes nothing
        for i in range(0, max(len(new), 1), 100):  # MLflow's limit on params per batch
            self.client.log_batch(self._run(), params=new[i:i + 100], tags=tags if i == 0 else [])
        return len(new)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Log one step's metrics; every key must start with one of NAMESPACES."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TrackingError(f"step must be a non-negative int, got {step!r}")
        bad = [k for k in metrics if not (isinstance(k, str) and k.startswith(NAMESPACES)
                                          and len(k) > k.index("/") + 1)]
        if bad:
            raise TrackingError(f"metric key(s) {bad} outside the namespaces {list(NAMESPACES)}; "
                                f"name them e.g. 'rollout/reward_mean'")
        values = {}
        for k, v in metrics.items():
            try:
                values[k] = float(v)
            except (TypeError, ValueError):
                raise TrackingError(f"metric {k!r} is not a number: {v!r}") from None
            if math.isinf(values[k]):
                raise TrackingError(f"metric {k!r} is infinite")
        if values and self._has_step(next(iter(values)), step):
            # A step logged before (a run killed after logging it but before the store marked
            # it complete, then resumed): log only the keys that step does not hold yet.
            values = {k: v for k, v in values.items() if not self._has_step(k, step)}
        ts = int(time.time() * 1000)
        batch = [Metric(k, v, ts, step) for k, v in values.items()]
        self.logged_new |= bool(batch)
        for i in range(0, len(batch), _BATCH):
            self.client.log_batch(self._run(), metrics=batch[i:i + _BATCH])

    def _has_step(self, key: str, step: int) -> bool:
        return any(m.step == step for m in self.client.get_metric_history(self._run(), key))

    # ---------------------------------------------------------------- artifacts

    def log_dataset(self, rows: Sequence[Mapping[str, Any]], name: str, context: str,
                    source: Mapping[str, str]) -> str:
        """Log a dataset (its rows; MLflow computes the digest) as an input of the run with the
        context tag (``train``, ``eval``) and ``source`` (where the rows come from: a family and
        split, a file); returns the digest. Logging it again is a no-op."""
        import mlflow.data
        import pandas as pd
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        frame = pd.DataFrame([{k: v if isinstance(v, (str, int, float, bool)) or v is None
                               else str(v) for k, v in r.items()} for r in rows])
        ds = mlflow.data.from_pandas(frame, source=CodeDatasetSource(dict(source)), name=name)
        run = self.client.get_run(self._run())
        if any(i.dataset.digest == ds.digest and i.dataset.name == name
               for i in (run.inputs.dataset_inputs if run.inputs else [])):
            return ds.digest
        self.client.log_inputs(self._run(), datasets=[DatasetInput(
            ds._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, context)])])
        return ds.digest

    def log_step_figure(self, fig: "Figure", key: str, step: int) -> None:
        """A figure of one step as the image ``key`` at ``step`` (MLflow's image history: the
        run's Images tab shows one picture per key with a step slider), then close it."""
        import matplotlib.pyplot as plt
        import numpy as np

        fig.canvas.draw()
        image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
        plt.close(fig)
        self.client.log_image(self._run(), image, key=key, step=step)

    def log_text(self, text: str, path: str) -> str:
        """Save text as an artifact (e.g. 'view/step_0003.html', which the MLflow UI shows as a
        page); return the artifact's URI."""
        run_id = self._run()
        self.client.log_text(run_id, text, path)
        return f"{self.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{path}"

    def log_figure(self, fig: "Figure", path: str) -> None:
        """Save a matplotlib figure as an artifact (e.g. 'figures/tree_step_0003.png'), then close it."""
        import matplotlib.pyplot as plt

        self.client.log_figure(self._run(), fig, path)
        plt.close(fig)
