"""The model registry side of a TRACE run's MLflow store: checkpoints as registered model
versions, the ``candidate`` and ``champion`` aliases, and promotion on a held-out score.

Checkpoints are plain Hugging Face / torch directories, not MLflow flavours: they are logged as
run artifacts and registered with ``MlflowClient.create_model_version`` on their ``runs:/`` URI
(the registry accepts any artifact URI as a version's source). A policy is saved as an MLflow
``transformers`` model so that ``mlflow.pyfunc.load_model`` of its version generates; a predictor
as a pyfunc model (``trace_rl.storage.models``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from mlflow.exceptions import MlflowException

CHECKPOINT_KINDS = ("policy", "predictor")
RUN_TAG = "trace.run_id"
"""The tag naming the TRACE run of an MLflow run and of a model version."""
CHAMPION, CANDIDATE = "champion", "candidate"
"""Registry aliases: ``candidate`` is the newest registered policy, ``champion`` the one that did
best on the held-out split (moved only by ``Tracker.promote``)."""
MODEL_DESCRIPTIONS = {
    "policy": "TRACE policies: one version per registered training checkpoint (an MLflow "
              "transformers text-generation model). Alias `candidate`: the newest; `champion`: "
              "the best on the held-out split, which scheduled retraining starts from.",
    "predictor": "TRACE's value predictor (hashed n-gram features and an MLP head) as a pyfunc "
                 "model: histories in, predicted success probabilities out; one version per "
                 "training step, and refits that beat the run's predictor (retrain-predictor).",
}


def _requirements(packages: Sequence[str]) -> list[str]:
    """Pinned requirements of installed ``packages`` (no inference: MLflow's would load the
    model in a subprocess)."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for p in packages:
        try:
            out.append(f"{p}=={version(p)}")
        except PackageNotFoundError:
            continue
    return out


class TrackingError(ValueError):
    """A metric, param or checkpoint that the tracker refuses; the message says what to fix.
    (Declared here, the module ``trace_rl.storage.tracking`` builds on, and re-exported there.)"""


class ModelRegistry:
    """``Tracker``'s registry methods; they use its ``client``, ``experiment``, ``workdir``,
    ``trace_run_id``, ``logged_new`` and ``_run()``."""

    def log_checkpoint(self, kind: str, path: str | Path, step: int,
                       exclude: Sequence[str] = (), description: str = "") -> str:
        """Log a checkpoint and register it as a version of the model ``<experiment>-<kind>``.

        A policy (a Hugging Face directory) is logged as an MLflow ``transformers`` model (task
        text-generation, with its signature), so ``mlflow.pyfunc.load_model`` of the version
        generates; its optimiser state is not part of it. A predictor's saved state (a ``.pt``
        file) is logged as a pyfunc model (``trace_rl.storage.models.PredictorModel``: histories
        in, probabilities out); anything else as its files (those of a directory named in
        ``exclude`` left out). The version carries the step
        and TRACE run id as tags and ``description``; a policy version becomes the alias
        ``candidate``. Logging the same run's checkpoint for a step again (a retried task)
        returns the existing version. Returns the version number.
        """
        if kind not in CHECKPOINT_KINDS:
            raise TrackingError(f"checkpoint kind {kind!r} is not one of {CHECKPOINT_KINDS}")
        path = Path(path)
        if not path.exists():
            raise TrackingError(f"checkpoint path {path} does not exist")
        run_id = self._run()
        name = self.model_name(kind)
        for mv in self.client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
            if mv.tags.get("step") == str(step):
                return mv.version
        artifact_path = f"checkpoints/{kind}/step_{step:06d}"
        if kind == "policy":
            self._log_policy_model(path, artifact_path, exclude)
        elif path.is_file() and path.suffix == ".pt":
            self._log_predictor_model(path, artifact_path)
        elif path.is_dir() and exclude:
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
            self.client.create_registered_model(
                name, tags={"kind": kind}, description=MODEL_DESCRIPTIONS[kind])
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        mv = self.client.create_model_version(
            name, source=f"runs:/{run_id}/{artifact_path}", run_id=run_id,
            tags={"step": str(step), RUN_TAG: self.trace_run_id or ""},
            description=description or f"{kind} after step {step} of TRACE run "
                                       f"{self.trace_run_id}")
        if kind == "policy":
            self.client.set_registered_model_alias(name, CANDIDATE, mv.version)
        self.logged_new = True
        return mv.version

    def model_name(self, kind: str) -> str:
        """The registered model of a checkpoint kind: ``<experiment>-<kind>``."""
        return f"{self.experiment}-{kind}"

    def _log_policy_model(self, path: Path, artifact_path: str, exclude: Sequence[str]) -> None:
        """The policy directory as an MLflow transformers model (a text-generation pipeline that
        takes prompts and returns their continuations; ``max_new_tokens`` a parameter), without
        its files named in ``exclude`` (MLflow copies every file of the directory)."""
        import tempfile

        import mlflow.transformers
        from mlflow.models.signature import ModelSignature
        from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

        signature = ModelSignature(inputs=Schema([ColSpec("string")]),
                                   outputs=Schema([ColSpec("string")]),
                                   params=ParamSchema([ParamSpec("max_new_tokens", "long", 64)]))
        with tempfile.TemporaryDirectory(dir=self.workdir, prefix=".model-") as tmp:
            out, src = Path(tmp) / "model", Path(tmp) / "checkpoint"
            src.mkdir()
            for f in path.iterdir():  # links, not copies: the weights are copied once, by MLflow
                if f.name not in exclude:
                    (src / f.name).symlink_to(f.resolve(), target_is_directory=f.is_dir())
            try:
                mlflow.transformers.save_model(
                    str(src), str(out), task="text-generation", signature=signature,
                    pip_requirements=_requirements(("transformers", "torch", "accelerate")))
            except Exception as exc:  # MLflow's own errors do not say which checkpoint
                raise TrackingError(f"policy checkpoint {path} could not be saved as an MLflow "
                                    f"transformers model ({type(exc).__name__}: {exc}); it must "
                                    f"be a Hugging Face causal-LM directory with its "
                                    f"tokenizer") from exc
            self.client.log_artifacts(self._run(), str(out), artifact_path)

    def _log_predictor_model(self, path: Path, artifact_path: str) -> None:
        """A saved predictor state as an MLflow pyfunc model (``trace_rl.storage.models``)."""
        import tempfile

        import mlflow.pyfunc
        from mlflow.models.signature import ModelSignature
        from mlflow.types.schema import ColSpec, Schema

        from trace_rl.storage.models import PredictorModel

        signature = ModelSignature(inputs=Schema([ColSpec("string")]),
                                   outputs=Schema([ColSpec("double")]))
        with tempfile.TemporaryDirectory(dir=self.workdir, prefix=".model-") as tmp:
            out = Path(tmp) / "model"
            mlflow.pyfunc.save_model(str(out), python_model=PredictorModel(),
                                     artifacts={"state": str(path)}, signature=signature,
                                     pip_requirements=_requirements(("torch", "numpy")))
            self.client.log_artifacts(self._run(), str(out), artifact_path)

    def promote(self, kind: str, score: float, split: str, description: str = "") -> dict[str, Any]:
        """Make this run's newest ``kind`` version the ``champion`` if its held-out ``score``
        (higher is better) on ``split`` beats the champion's; the first version scored becomes
        champion. The version is tagged with its score and split either way. Returns
        ``{"version", "champion", "previous", "previous_score", "reason"}``."""
        name, run_id = self.model_name(kind), self._run()
        mine = [mv for mv in self.client.search_model_versions(
            f"name = '{name}' and run_id = '{run_id}'")]
        if not mine:
            raise TrackingError(f"run {self.trace_run_id} registered no {kind} version to promote")
        mv = max(mine, key=lambda m: int(m.tags.get("step", -1)))
        for k, v in (("eval.score", f"{score:.6f}"), ("eval.split", split)):
            self.client.set_model_version_tag(name, mv.version, k, v)
        try:
            champ = self.client.get_model_version_by_alias(name, CHAMPION)
        except MlflowException:
            champ = None
        prev = None if champ is None else champ.tags.get("eval.score")
        if champ is not None and champ.version == mv.version:
            return {"version": mv.version, "champion": True, "previous": champ.version,
                    "previous_score": prev, "reason": "already the champion"}
        if champ is None:
            win, reason = True, "the first version scored: there was no champion"
        elif prev is None or champ.tags.get("eval.split") != split:
            win, reason = False, (f"champion v{champ.version} has no score on {split!r} to "
                                  f"compare with; move the alias by hand if this one should win")
        else:
            win = score > float(prev)
            reason = (f"held-out score {score:.4f} on {split!r} "
                      f"{'beats' if win else 'does not beat'} champion v{champ.version}'s "
                      f"{float(prev):.4f}")
        if win:
            self.client.set_registered_model_alias(name, CHAMPION, mv.version)
        if description:
            self.client.update_model_version(
                name, mv.version, description=description + f"\n\nPromotion: "
                f"{'made the champion' if win else 'not made the champion'} ({reason}).")
        return {"version": mv.version, "champion": win,
                "previous": None if champ is None else champ.version, "previous_score": prev,
                "reason": reason}

    def champion(self, kind: str = "policy") -> Any:
        """The registry's ``champion`` version of ``kind`` (an MLflow ``ModelVersion``), or None."""
        try:
            return self.client.get_model_version_by_alias(self.model_name(kind), CHAMPION)
        except MlflowException:
            return None
