"""Register TRACE's work pools and deployments with the Prefect server in ``PREFECT_API_URL``.

    python -m deployments.deploy                     # every pool, every deployment
    python -m deployments.deploy --pools trace-cpu   # CPU only

Pools are ``process`` pools: a worker on the same machine starts each flow run as a subprocess of
its own Python (so start the worker from the project's virtual environment). The code is not
copied anywhere: each deployment's pull step sets the working directory to this checkout
(``flow.from_source(source=<repo root>, ...)``, Prefect's local storage), so a worker runs the
code as it is on disk when the run starts. No docker, no remote storage.

Deployments (``<flow>/<pool without the trace- prefix>``):

* ``train/cpu``, ``train/gpu``: the train flow; parameters ``config`` (a ``TrainConfig``: the UI
  form is typed, with a description per field; on Submit it shows a bad value's refusal under its
  field, and the server refuses a bad value before a run is created) and ``workdir``; defaults are
  the embedded default config.
* ``train/cluster``: the train flow on a Ray cluster (pool ``trace-cluster``; docs/cluster.md):
  the flow run stays in the worker's process (the only writer of DuckDB and MLflow) and its
  engines and trainer ranks are Ray actors. Default config: ``cluster=auto`` (the cluster this
  machine's ``ray start`` joined, or ``RAY_ADDRESS``), 2 engine actors, 2 trainer ranks; the
  work dir must be on a file system every node sees (checkpoints).
* ``evaluate/cpu``, ``evaluate/gpu``: a checkpoint on a held-out split (``policy_dir`` is required).
* ``retrain-predictor/cpu``: refit the predictor over a run's stored trees (CPU work only).
* ``retrain-latest/cpu``, ``retrain-latest/gpu``: train from the model registry's ``champion``
  policy (deployments/retrain.py), on a cron schedule. The schedule is created **paused**: a schedule
  that starts hours of training on its own would surprise whoever just deployed. Resume it in the
  UI (deployment page, the schedule toggle), with ``prefect deployment schedule resume``, or
  deploy with ``--activate-schedules`` (which sets only schedules that are new).

Existing pools are left as they are (a user may have edited them); existing deployments are updated
in place, keeping what a user switches in the UI: whether the deployment is paused and whether its
schedule is active. Running the command again changes nothing else than what its options say.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU_POOL = "trace-cpu"
GPU_POOL = "trace-gpu"
CLUSTER_POOL = "trace-cluster"
CLUSTER_CONFIG = {"cluster": "auto", "rollout_engines": 2, "trainer_ranks": 2}
"""The default config of ``train/cluster`` (the rest is the embedded default)."""
DEFAULT_CRON = "0 3 * * *"


@dataclass(frozen=True)
class PoolSpec:
    """A process work pool."""

    name: str
    """Pool name that workers pass to ``prefect worker start --pool``."""
    description: str
    """Shown in the UI's work pool list."""
    env: Mapping[str, str]
    """Default environment of every flow run from this pool (a deployment may override keys)."""
    concurrency_limit: int | None = 1
    """Flow runs of this pool at once; 1 because a TRACE run fills a CPU box or its GPU."""


@dataclass(frozen=True)
class DeploymentSpec:
    """One flow, deployed once per pool in ``pools``."""

    flow_name: str
    """Prefect flow name (the ``name=`` of its ``@flow``), for messages."""
    entrypoint: str
    """``<path relative to the repo root>:<function>``."""
    pools: tuple[str, ...]
    """Pools this flow is deployed to; the deployment is named after the pool."""
    description: str
    """Shown on the deployment's page."""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    """Default parameters (the UI's Run form starts from them)."""
    cron: str | None = None
    """Cron schedule, or None for trigger-only deployments."""


_RUN_ENV = {"TOKENIZERS_PARALLELISM": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}


def pool_specs(gpu_devices: str = "0") -> dict[str, PoolSpec]:
    """The CPU and GPU pools; ``gpu_devices`` is the GPU pool's ``CUDA_VISIBLE_DEVICES``."""
    return {
        CPU_POOL: PoolSpec(CPU_POOL, "TRACE flow runs on CPUs (tiny policy, synthetic families).",
                           # an empty CUDA_VISIBLE_DEVICES hides every GPU, so a CPU run on a GPU
                           # host cannot grab one by accident
                           {**_RUN_ENV, "CUDA_VISIBLE_DEVICES": ""}),
        GPU_POOL: PoolSpec(GPU_POOL, f"TRACE flow runs on GPU(s) {gpu_devices} (vLLM engine).",
                           {**_RUN_ENV, "CUDA_VISIBLE_DEVICES": gpu_devices}),
        CLUSTER_POOL: PoolSpec(CLUSTER_POOL, "TRACE flow runs whose engines and trainer ranks are "
                               "Ray actors (docs/cluster.md); the worker runs on a node of the "
                               "Ray cluster.", {**_RUN_ENV, "RAY_USAGE_STATS_ENABLED": "0"}),
    }


def deployment_specs(workdir: str | None = None, retrain_config: Mapping[str, Any] | None = None,
                     cron: str = DEFAULT_CRON) -> list[DeploymentSpec]:
    """Every deployment; ``workdir`` (None: the flows' default, relative to the repo root) becomes
    each one's default ``workdir`` parameter, ``retrain_config`` the scheduled run's config."""
    wd = {"workdir": workdir} if workdir else {}
    both = (CPU_POOL, GPU_POOL)
    return [
        DeploymentSpec("train", "flows/train.py:train", both,
                       "Train a policy with TRACE or a baseline allocator (config: a TrainConfig, "
                       "a typed form whose defaults are the embedded tiny CPU run).", dict(wd)),
        DeploymentSpec("train", "flows/train.py:train", (CLUSTER_POOL,),
                       "Train on a Ray cluster: a pool of engine actors and a group of trainer "
                       "ranks (docs/cluster.md); the flow writes DuckDB and MLflow.",
                       {"config": dict(CLUSTER_CONFIG), **wd}),
        DeploymentSpec("evaluate", "flows/evaluate.py:evaluate", both,
                       "Accuracy and contrast metrics of a policy checkpoint on a held-out split.",
                       dict(wd)),
        DeploymentSpec("retrain-predictor", "flows/retrain_predictor.py:retrain_predictor",
                       (CPU_POOL,), "Refit the predictor over a run's stored trees.", dict(wd)),
        DeploymentSpec("retrain-latest", "deployments/retrain.py:retrain_latest", both,
                       "Scheduled retraining: train from the policy that holds the registry "
                       "alias 'champion' (the best held-out score so far).",
                       {"config": dict(retrain_config or {}), **wd}, cron),
    ]


def deployment_name(pool: str) -> str:
    """A deployment is named after its pool: ``trace-cpu`` -> ``cpu``."""
    return pool.removeprefix("trace-")


def base_job_template(env: Mapping[str, str]) -> dict[str, Any]:
    """The process worker's default job template with ``env`` as the default environment."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    template["variables"]["properties"]["env"]["default"] = dict(env)
    return template


def ensure_pools(pools: Sequence[PoolSpec]) -> dict[str, bool]:
    """Create each pool that the server lacks; returns pool name -> whether it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    created = {}
    with get_client(sync_client=True) as client:
        for p in pools:
            try:
                client.read_work_pool(p.name)
                created[p.name] = False
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(
                    name=p.name, type="process", description=p.description,
                    base_job_template=base_job_template(p.env),
                    concurrency_limit=p.concurrency_limit))
                created[p.name] = True
    return created


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[^a-z\s])(?!\d+:)")
"""Where a description's first sentence ends: a full stop, then a word that starts a sentence
(not a lower-case word, nor a value being explained, as in ``2: two tokens each``)."""


def form_help(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (a parameter schema as JSON) with every property's description cut to its
    first sentence: the help the UI's run form shows under a field. The whole docstring stays in
    trace_rl/config/sections.py; the measurements behind a default are in docs/results.md."""
    def cut(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: cut(v) for k, v in node.items()}
            if isinstance(out.get("properties"), dict):
                for prop in out["properties"].values():
                    if isinstance(prop, dict) and isinstance(prop.get("description"), str):
                        text = " ".join(prop["description"].split())
                        prop["description"] = _SENTENCE_END.split(text, maxsplit=1)[0]
            return out
        return [cut(v) for v in node] if isinstance(node, list) else node
    return cut(schema)


FORM_DROPS = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
    "maxLength", "pattern", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "uniqueItems",
    "contains", "minContains", "maxContains", "not", "oneOf", "if", "then", "else"})
"""The validation keywords that the run form of the pinned Prefect UI (3.7) drops from a
parameter schema: it reads a deployment's schema through a mapper (prefect-ui-library,
``SchemaResponse`` -> ``Schema`` and back) that keeps, of each schema object it walks (the root,
each definition, each property through ``properties``), only ``$ref``, ``allOf``, ``anyOf``,
``const``, ``default``, ``description``, ``enum``, ``example``, ``format``, ``items``,
``maxItems``, ``minItems``, ``position``, ``prefixItems``, ``properties``, ``required``,
``title``, ``type`` and ``block_type_slug``. It sends what is left to the server's
``/ui/schemas/validate`` on Submit, so without these keywords a bad value passes the form and is
refused only by the run's creation. What is under ``allOf``, ``anyOf`` and ``items`` passes
through whole."""


def form_keeps_constraints(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (a parameter schema as JSON) with each schema object's validation keywords that
    the pinned UI's run form drops (``FORM_DROPS``: ``minimum``, ``pattern``,
    ``additionalProperties``, ...) moved into an ``allOf`` entry of that object, which the form
    keeps whole. The same values are valid (a schema's keywords are an ``allOf`` of them; an
    object's ``additionalProperties`` moves with the names of its ``properties``, the keys it is
    judged against), so the server enforces what it did, and the form's check on Submit sees
    every constraint and shows each error under its field."""
    def move(node: dict[str, Any]) -> dict[str, Any]:
        out = dict(node)
        for group in ("properties", "definitions"):
            if isinstance(out.get(group), dict):
                out[group] = {name: move(sub) if isinstance(sub, dict) else sub
                              for name, sub in out[group].items()}
        moved = {k: out.pop(k) for k in list(out)
                 if k in FORM_DROPS and not (k == "additionalProperties" and out[k] is True)}
        if "additionalProperties" in moved or "patternProperties" in moved:
            moved["properties"] = {name: {} for name in out.get("properties") or {}}
        if moved:
            out["allOf"] = [*out.get("allOf", []), moved]
        return out
    return move(schema)


def deployments(specs: Sequence[DeploymentSpec], pools: Sequence[str], *,
                source: Path = REPO_ROOT, paused: bool = True) -> list[Any]:
    """Each spec's deployment (a ``RunnerDeployment``, not yet sent to a server) on each of its
    pools that is in ``pools``. Its parameter schema is the flow's: for ``train``, the typed
    ``TrainConfig`` form with a description per field, which the server enforces."""
    from prefect import Flow
    from prefect.schedules import Cron

    out = []
    for spec in specs:
        targets = [p for p in spec.pools if p in pools]
        if not targets:
            continue
        # Loads the flow from the checkout (imports its module) and records a pull step that sets
        # the working directory to it: what a process worker on this machine needs.
        flow = Flow.from_source(source=str(source), entrypoint=spec.entrypoint)
        made = [flow.to_deployment(
            name=deployment_name(pool), description=spec.description,
            parameters=dict(spec.parameters), tags=["trace"], work_pool_name=pool,
            enforce_parameter_schema=True,
            # the schedule itself is inactive (not the deployment paused), so the UI's
            # schedule toggle and `prefect deployment schedule resume` switch it on
            schedules=[Cron(spec.cron, timezone="UTC", active=not paused,
                            slug=schedule_slug(spec.cron))]
            if spec.cron else None) for pool in targets]
        for d in made:
            d._parameter_openapi_schema = type(d._parameter_openapi_schema).model_validate(
                form_keeps_constraints(form_help(d._parameter_openapi_schema.model_dump())))
        out += made
    return out


def schedule_slug(cron: str) -> str:
    """A schedule's slug: the UI's schedule card shows it in place of the time, so it says the
    time (``At 03:00 every day (UTC)``, cronsim's reading of the cron expression)."""
    from datetime import datetime, timezone

    from cronsim import CronSim

    return f"{CronSim(cron, datetime.now(timezone.utc)).explain()} (UTC)"


def keep_user_switches(deployment: Any, existing: Any) -> Any:
    """``deployment`` with the switches a user owns taken from the server's ``existing`` copy:
    whether the deployment is paused, and whether each schedule is active. A schedule is matched
    by its slug; a deployment's one schedule whose slug changed (a new cron, or a slug of an
    older deploy) replaces the one on the server in place (``replaces``), keeping its state.
    Only what is new gets the deploy command's defaults."""
    before = {s.slug: s for s in existing.schedules if s.slug}
    deployment.paused = existing.paused
    new = deployment.schedules or []
    if len(new) == len(existing.schedules) == 1 and new[0].slug not in before \
            and existing.schedules[0].slug:
        old = existing.schedules[0]
        new = [new[0].model_copy(update={"replaces": old.slug})]
        before = {new[0].slug: old}
    deployment.schedules = [s.model_copy(update={"active": before[s.slug].active})
                            if s.slug in before else s for s in new]
    return deployment


def register(specs: Sequence[DeploymentSpec], pools: Sequence[str], *, source: Path = REPO_ROOT,
             paused: bool = True) -> list[str]:
    """Create or update each spec's deployment on each of its pools that is in ``pools``; returns
    the ``<flow>/<deployment>`` names. Idempotent: an existing deployment is updated in place
    (same id, each schedule the same id by its slug) and keeps its paused state and each
    schedule's active state as they are on the server (a user may have switched them in the UI);
    ``paused`` only sets the schedules that are new."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    names = []
    with get_client(sync_client=True) as client:
        for deployment in deployments(specs, pools, source=source, paused=paused):
            name = f"{deployment.flow_name}/{deployment.name}"
            try:
                keep_user_switches(deployment, client.read_deployment_by_name(name))
            except ObjectNotFound:
                pass
            deployment.apply()
            names.append(name)
    return names


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m deployments.deploy",
        description="Create TRACE's work pools (if missing) and register its deployments with "
                    "the Prefect server in PREFECT_API_URL.")
    ap.add_argument("--pools", nargs="+", choices=(CPU_POOL, GPU_POOL, CLUSTER_POOL),
                    default=[CPU_POOL, GPU_POOL, CLUSTER_POOL],
                    help="pools to create and deploy to (default: all three)")
    ap.add_argument("--gpu-devices", default="0",
                    help="CUDA_VISIBLE_DEVICES of flow runs from trace-gpu (default: 0)")
    ap.add_argument("--workdir", default=None,
                    help="default workdir parameter of every deployment (default: the flows' own "
                         "default, trace_runs/ under the repo root, where runs start)")
    ap.add_argument("--retrain-config", type=Path, default=None,
                    help="YAML of TrainConfig fields for the scheduled retrain-latest runs "
                         "(default: the embedded default config)")
    ap.add_argument("--cron", default=DEFAULT_CRON,
                    help=f"schedule of retrain-latest (default: {DEFAULT_CRON!r}, 03:00 UTC daily)")
    ap.add_argument("--activate-schedules", action="store_true",
                    help="create the retrain-latest schedules active (default: paused); a "
                         "schedule that exists keeps the state it has on the server")
    ap.add_argument("--source", type=Path, default=REPO_ROOT,
                    help="checkout the workers run from (default: this one)")
    return ap.parse_args(argv)


def _retrain_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    from trace_rl.config import config_from_mapping

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--retrain-config {path}: must hold a mapping of TrainConfig field: value")
    config_from_mapping(data, str(path))  # unknown or invalid fields fail here, not at 03:00
    return data


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        print("PREFECT_API_URL is not set: start a server (prefect server start --host 127.0.0.1) "
              "and export PREFECT_API_URL=http://127.0.0.1:4200/api", file=sys.stderr)
        return 2
    pools = pool_specs(args.gpu_devices)
    created = ensure_pools([pools[p] for p in args.pools])
    specs = deployment_specs(args.workdir, _retrain_config(args.retrain_config), args.cron)
    names = register(specs, args.pools, source=args.source.resolve(),
                     paused=not args.activate_schedules)
    for pool, new in created.items():
        print(f"work pool {pool}: {'created' if new else 'exists, left as is'}")
    for name in names:
        print(f"deployment {name}")
    state = "active" if args.activate_schedules else "paused"
    print(f"retrain-latest schedule {args.cron!r} ({state} if new; an existing schedule keeps "
          f"its state). Server: {api}\n"
          f"Start a worker from this checkout: prefect worker start --pool {args.pools[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
