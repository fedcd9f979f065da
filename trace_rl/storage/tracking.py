"""MLflow tracking for a TRACE run: a local store in the work dir, namespaced metrics, checkpoints.

One MLflow run per training flow run (DESIGN.md §2). The default store needs no server:
``sqlite:///<workdir>/mlflow.db`` for runs and the model registry, ``<workdir>/mlruns`` for
artifacts; ``mlflow ui --backend-store-uri sqlite:///<workdir>/mlflow.db`` shows it.

Everything goes through an ``MlflowClient`` with an explicit run id rather than the fluent
``mlflow.start_run`` API, whose active run is global per thread: Prefect runs tasks in worker
threads, and a resumed flow must write to the run it had, not to whatever run is active.

Checkpoints are plain Hugging Face / torch directories, not MLflow flavours: they are logged as
run artifacts and registered with ``MlflowClient.create_model_version`` on their ``runs:/`` URI
(the registry accepts any artifact URI as a version's source), which keeps logging a
checkpoint to a file copy plus two registry rows.
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mlflow import MlflowClient  # noqa: E402  (telemetry must be off before mlflow is imported)
from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402

from trace_rl.storage.locks import file_lock  # noqa: E402

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NAMESPACES = ("rollout/", "alloc/", "tree/", "predictor/", "loss/", "ledger/", "time/", "eval/")
CHECKPOINT_KINDS = ("policy", "predictor")
END_STATUSES = ("FINISHED", "FAILED", "KILLED")
RUN_TAG = "trace.run_id"
PARAM_VALUE_LIMIT = 6000  # MLflow's limit on one param value, in characters
_BATCH = 1000  # MLflow's limit on metrics per log_batch call
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class TrackingError(ValueError):
    """A metric, param or checkpoint that the tracker refuses; the message says what to fix."""


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


class Tracker:
    """The MLflow side of one work dir. Call ``start_or_resume`` before logging."""

    def __init__(self, workdir: str | Path, experiment: str = "trace",
                 tracking_uri: str | None = None):
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = tracking_uri or f"sqlite:///{self.workdir / 'mlflow.db'}"
        self.artifact_root = self.workdir / "mlruns"
        self.experiment = experiment
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        # The first use of a new sqlite store runs MLflow's schema migrations; two processes doing
        # that at once corrupt it (issue 24: "no such column: spans.dimension_attributes"), so
        # processes of one work dir take their first look at the store one at a time.
        with file_lock(self.workdir / ".mlflow-setup.lock", 600, "MLflow store set-up"):
            self.relocated = self._relocate()
            self.experiment_id = self._experiment_id()
        self.run_id: str | None = None
        self.trace_run_id: str | None = None

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
            return exp.experiment_id
        try:
            return self.client.create_experiment(self.experiment,
                                                 artifact_location=self.artifact_root.as_uri())
        except MlflowException:  # another process created it between our two calls
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                raise
            return exp.experiment_id

    @property
    def ui_command(self) -> str:
        """The command that shows this store in a browser."""
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"

    def _run(self) -> str:
        if self.run_id is None:
            raise TrackingError("no MLflow run: call Tracker.start_or_resume first")
        return self.run_id

    # ---------------------------------------------------------------- run lifecycle

    def start_or_resume(self, trace_run_id: str, run_name: str | None = None,
                        mlflow_run_id: str | None = None) -> str:
        """Continue the MLflow run of this TRACE run if there is one, else start it; return its id.

        The run is found by ``mlflow_run_id`` when given (e.g. from the DuckDB runs table), else
        by the tag ``trace.run_id``. A resumed run is set RUNNING again.
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
        if run is None:
            run = self.client.create_run(self.experiment_id, run_name=run_name or trace_run_id,
                                         tags={RUN_TAG: trace_run_id})
        elif run.info.status != "RUNNING":
            self.client.update_run(run.info.run_id, status="RUNNING")
        _forget_artifact_repo(run.info.run_id, run.info.artifact_uri)
        self.run_id = run.info.run_id
        self.trace_run_id = trace_run_id
        return self.run_id

    def end(self, status: str = "FINISHED") -> None:
        """Close the run as FINISHED, FAILED or KILLED."""
        if status not in END_STATUSES:
            raise TrackingError(f"end status {status!r} is not one of {END_STATUSES}")
        self.client.set_terminated(self._run(), status=status)

    # ---------------------------------------------------------------- params and metrics

    def log_config(self, config: Mapping[str, Any]) -> int:
        """Log the full config as params (nested keys dotted). Returns how many were new.

        Params are immutable in MLflow: on resume, keys already logged must keep their values;
        a changed value is an error naming the keys rather than a silently mixed run.
        """
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
        for i in range(0, len(new), 100):  # MLflow's limit on params per batch
            self.client.log_batch(self._run(), params=new[i:i + 100])
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
        for i in range(0, len(batch), _BATCH):
            self.client.log_batch(self._run(), metrics=batch[i:i + _BATCH])

    def _has_step(self, key: str, step: int) -> bool:
        return any(m.step == step for m in self.client.get_metric_history(self._run(), key))

    # ---------------------------------------------------------------- artifacts

    def log_checkpoint(self, kind: str, path: str | Path, step: int,
                       exclude: Sequence[str] = ()) -> str:
        """Log a checkpoint directory (or file) as artifacts and register it as a model version.
        Files of the directory named in ``exclude`` (e.g. an optimiser state) are left out.

        The registered model is ``<experiment>-<kind>``; the version carries the step and TRACE
        run id as tags. Logging the same run's checkpoint for a step again (a retried task)
        returns the existing version. Returns the version number.
        """
        if kind not in CHECKPOINT_KINDS:
            raise TrackingError(f"checkpoint kind {kind!r} is not one of {CHECKPOINT_KINDS}")
        path = Path(path)
        if not path.exists():
            raise TrackingError(f"checkpoint path {path} does not exist")
        run_id = self._run()
        name = f"{self.experiment}-{kind}"
        for mv in self.client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
            if mv.tags.get("step") == str(step):
                return mv.version
        artifact_path = f"checkpoints/{kind}/step_{step:06d}"
        if path.is_dir() and exclude:
            for f in sorted(path.rglob("*")):
                if f.is_file() and f.name not in exclude:
                    sub = f.parent.relative_to(path).as_posix()
                    self.client.log_artifact(run_id, str(f), artifact_path
                                             + ("" if sub == "." else f"/{sub}"))
        elif path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)
        try:
            self.client.create_registered_model(name, tags={"kind": kind})
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        mv = self.client.create_model_version(
            name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id,
            tags={"step": str(step), RUN_TAG: self.trace_run_id or ""})
        return mv.version

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
