"""What tasks share: paths of a work dir, the cache policy, and the look-ups of long-lived objects
(engine, environment, store) that must never travel between tasks.

Tasks hand each other ids and Arrow tables; a model, an engine or a DuckDB connection is looked up
by reference (a path, a config) in the running flow's session (``trace_rl.session.Session``),
which holds them, so a cache key never depends on a live object.
"""

from __future__ import annotations

import hashlib
import inspect
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext

from trace_core.allocators import Allocator, make_allocator
from trace_core.predictor import HashedNgramPredictor, HeadConfig
from trace_core.seeds import GLOBAL_TORCH_RNG
from trace_rl import environ
from trace_rl.config import TrainConfig
from trace_rl.config.sections import Allocation, Cluster, Predictor
from trace_rl.envs.base import Environment, TaskItem
from trace_rl.envs.registry import make_env
from trace_rl.engines import default_engine_kind, get_engine
from trace_rl.rollout.types import Engine
from trace_rl.session import Session
from trace_rl.rollout.treeio import StepTrees
from trace_rl.storage.store import TreeStore, make_node_id


@dataclass(frozen=True)
class Paths:
    """Where a work dir keeps things: DuckDB file, MLflow store, checkpoints, task results."""

    workdir: Path

    @property
    def db(self) -> Path:
        return self.workdir / "trace.duckdb"

    @property
    def results(self) -> Path:
        return self.workdir / "prefect-results"

    def policy_dir(self, run_id: str, step: int) -> Path:
        return self.workdir / "checkpoints" / run_id / f"policy-step{step:04d}"

    def predictor_file(self, run_id: str, step: int) -> Path:
        return self.workdir / "checkpoints" / run_id / f"predictor-step{step:04d}.pt"

    def plots(self, run_id: str) -> Path:
        return self.workdir / "plots" / run_id


@dataclass(frozen=True)
class StepRef:
    """Which step a phase works on: the work dir holding the run, the run id, the step. Phases
    take it instead of the three values; their cache key reads its fields as if they had been
    passed one by one (``PhaseKey``)."""

    workdir: str
    run_id: str
    step: int

    @property
    def paths(self) -> Paths:
        return Paths(Path(self.workdir))

    @property
    def policy_dir(self) -> str:
        """Where the step's policy checkpoint goes."""
        return str(self.paths.policy_dir(self.run_id, self.step))

    @property
    def predictor_file(self) -> str:
        """Where the predictor fitted in this step goes."""
        return str(self.paths.predictor_file(self.run_id, self.step))

    def refs(self) -> dict[str, Any]:
        return {"workdir": self.workdir, "run_id": self.run_id, "step": self.step}


def _source_hash(fn: Any) -> str:
    """A task function's source, hashed once per session (``inspect.getsource`` took ~3 ms a
    task run here)."""
    return Session.current().memo("source-hash", fn, lambda: _hash_source(fn), maxsize=64)


def _hash_source(fn: Any) -> str:
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        src = repr(fn)
    return hashlib.sha256(src.encode()).hexdigest()[:12]


_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the phases run from (resolved once: ~5 ms a cache key here)."""


def code_version() -> str:
    """Hash of every module a phase can run (trace_core, trace_rl, tasks): a task's own source is
    not enough, since a change in what it calls changes its result too. Computed once per
    session."""
    return Session.current().memo("code-version", str(_ROOT), lambda: _code_hash(_ROOT),
                                  maxsize=1)


def _code_hash(root: Path) -> str:
    h = hashlib.sha256()
    for pkg in ("trace_core", "trace_rl", "tasks"):
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


@dataclass
class PhaseKey(CachePolicy):
    """Cache key = task name + config hash + task source + code version + the scalar references
    among the inputs (run id, step, level, work dir, checkpoint paths; a ``StepRef``'s fields).

    Built only from those references, never from model objects or tables, so a re-run of a killed
    flow finds the finished phases of its step as cache hits, and any code or config change
    invalidates them. A path inside ``workdir`` (the work dir the policy is bound to,
    ``flows.common.bind``) enters the key relative to it, so a copied or moved work dir finds
    its cache.
    """

    workdir: str | None = None

    def _ref(self, value: Any) -> Any:
        if self.workdir and isinstance(value, str) and (
                value == self.workdir or value.startswith(self.workdir.rstrip("/") + "/")):
            return "<workdir>" + value[len(self.workdir.rstrip("/")):]
        return value

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any],
                    flow_parameters: dict[str, Any], **kwargs: Any) -> str | None:
        cfg = inputs.get("cfg")
        flat = {k: v for k, v in inputs.items() if not isinstance(v, StepRef)}
        for v in inputs.values():
            if isinstance(v, StepRef):
                flat.update(v.refs())
        refs = sorted(f"{k}={self._ref(v)}" for k, v in flat.items()
                      if isinstance(v, (str, int, float, bool)) and k != "cfg")
        parts = [task_ctx.task.name, cfg.config_hash if isinstance(cfg, TrainConfig) else "-",
                 _source_hash(task_ctx.task.fn), code_version(), *refs]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


PHASE_KEY = PhaseKey()


def store(workdir: str) -> TreeStore:
    """The work dir's tree store (one per session and work dir)."""
    return Session.current().memo("store", workdir, lambda: TreeStore(Paths(Path(workdir)).db),
                                  maxsize=8)


def step_trees(at: StepRef, trees: StepTrees | None = None) -> StepTrees:
    """The step's stored trees: ``trees`` when the flow read them and handed them on, else one
    read of the store (a task called on its own)."""
    return trees if trees is not None else StepTrees(store(at.workdir).read_step(at.run_id, at.step))


def environment(family: str, kwargs: tuple[tuple[str, Any], ...] = ()) -> Environment:
    """The environment of ``family`` with ``kwargs`` (one per session)."""
    return Session.current().memo("environment", (family, kwargs),
                                  lambda: make_env(family, **dict(kwargs)), maxsize=8)


def _kwargs_key(cfg: TrainConfig) -> tuple[tuple[str, Any], ...]:
    """``cfg.env_kwargs()`` as a hashable cache key (lists, e.g. a difficulty ``mix``, become
    tuples)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                        for k, v in cfg.env_kwargs().items()))


def env_for(cfg: TrainConfig) -> Environment:
    return environment(cfg.family, _kwargs_key(cfg))


def _items(family: str, kwargs: tuple[tuple[str, Any], ...], split: str,
           policy_dir: str | None = None, max_new_tokens: int = 0) -> tuple[dict[str, TaskItem], int]:
    """(items by id, items skipped): with ``policy_dir``, an item whose prompt leaves fewer than
    ``max_new_tokens`` tokens of the policy's context (``context_limit``) is skipped. Loaded once
    per session."""
    return Session.current().memo(
        "items", (family, kwargs, split, policy_dir, max_new_tokens),
        lambda: _load_items(family, kwargs, split, policy_dir, max_new_tokens), maxsize=16)


def _load_items(family: str, kwargs: tuple[tuple[str, Any], ...], split: str,
                policy_dir: str | None, max_new_tokens: int) -> tuple[dict[str, TaskItem], int]:
    env = environment(family, kwargs)
    items = env.load(split)
    if policy_dir is None:
        return {it.id: it for it in items}, 0
    from transformers import AutoTokenizer

    from trace_rl.engines import context_limit
    from trace_rl.rollout.format import TurnFormat

    fmt = TurnFormat(AutoTokenizer.from_pretrained(policy_dir))
    limit = context_limit(policy_dir) - max_new_tokens
    system = env.system_prompt()
    kept = [it for it in items if len(fmt.prompt_ids(system, env.user_prompt(it))) <= limit]
    if len(kept) < len(items):
        print(f"{family}/{split}: skipped {len(items) - len(kept)} of {len(items)} items whose "
              f"prompt leaves fewer than max_new_tokens={max_new_tokens} of the policy's "
              f"{context_limit(policy_dir)} tokens of context")
    return {it.id: it for it in kept}, len(items) - len(kept)


def _fit_dir(cfg: TrainConfig, policy_dir: str | None) -> str | None:
    if policy_dir is None and cfg.policy != "tiny":
        from trace_rl.policy.named import resolve_policy

        policy_dir = resolve_policy(cfg.policy)
    return None if policy_dir is None else str(Path(policy_dir).resolve())


def items_for(cfg: TrainConfig, split: str, policy_dir: str | None = None) -> dict[str, TaskItem]:
    """Items of a split by id (loaded once per session), without those whose prompt does not fit
    the policy's context with room for one turn (``policy_dir``, default ``cfg.policy`` unless
    ``tiny``: the synthetic families' prompts are short)."""
    return items_and_skipped(cfg, split, policy_dir)[0]


def items_and_skipped(cfg: TrainConfig, split: str,
                      policy_dir: str | None = None) -> tuple[dict[str, TaskItem], int]:
    """``items_for`` and the number of items it skipped as too long for the policy's context."""
    return _items(cfg.family, _kwargs_key(cfg), split, _fit_dir(cfg, policy_dir),
                  cfg.max_new_tokens)


def drop_optimizer_state(workdir: str, run_id: str, step: int) -> None:
    """Delete the optimiser state of step ``step``'s local checkpoint once a later step is
    complete: only the newest checkpoint resumes a run, and the state is twice the size of the
    weights (a 20-step run of the tiny policy kept 0.8 GB of them)."""
    from trace_rl.policy.update import OPTIMIZER_STATE

    if step >= 0:
        Paths(Path(workdir)).policy_dir(run_id, step).joinpath(OPTIMIZER_STATE).unlink(missing_ok=True)


def drop_checkpoint(workdir: str, run_id: str, step: int) -> None:
    """Delete step ``step``'s local policy checkpoint (``TrainConfig.keep_checkpoints``)."""
    shutil.rmtree(Paths(Path(workdir)).policy_dir(run_id, step), ignore_errors=True)


def configure_threads() -> int:
    """Torch threads for this worker: ``$TRACE_TORCH_THREADS``, default 1. The tiny CPU policy gains
    nothing from a second thread, and OpenMP spin-waiting against the rollout engine and other
    processes made a step 7x slower here (25 s vs 3.3 s per step)."""
    n = environ.torch_threads()
    torch.set_num_threads(n)
    return n


def allocator_for(allocation: Allocation) -> Allocator:
    """The allocator a config's ``allocation`` section names, with its knobs (one registry, at
    this edge); the train flow builds one per step and hands it to the tasks that allocate."""
    return make_allocator(allocation.allocator, allocation.allocator_config)


def new_predictor(settings: Predictor, seed: int) -> HashedNgramPredictor:
    """A fresh predictor with a config's ``predictor`` section and the run's seed."""
    with GLOBAL_TORCH_RNG:  # the CPU generator (trace_core.predictor), not another thread's
        torch.random.default_generator.manual_seed(seed)
        return HashedNgramPredictor(head=HeadConfig(lr=settings.predictor_lr,
                                                    epochs=settings.predictor_epochs, seed=seed))


def load_predictor(settings: Predictor, seed: int, workdir: str, run_id: str, step: int,
                   take: bool = False) -> HashedNgramPredictor:
    """The predictor as saved after ``step`` (a fresh one before step 0): the one this process
    fitted at ``step`` when the session kept it (``save_predictor``), else read from its file (a
    resumed run, another process). The kept one is shared: predict with it, or ``take`` it to fit
    it (it leaves the session)."""
    kept = Session.current().kept_predictor(workdir, run_id, step, take) if step >= 0 else None
    if kept is not None:
        with GLOBAL_TORCH_RNG:
            torch.random.default_generator.manual_seed(seed)  # the state new_predictor leaves
        return kept
    predictor = new_predictor(settings, seed)
    if step < 0:
        return predictor
    path = Paths(Path(workdir)).predictor_file(run_id, step)
    if not path.exists():
        raise FileNotFoundError(f"predictor checkpoint of step {step} missing: {path}")
    predictor.load_state_dict(torch.load(path, weights_only=False))
    return predictor


def save_predictor(predictor: HashedNgramPredictor, workdir: str, run_id: str, step: int) -> Path:
    """Save the predictor fitted at ``step`` and keep it in the session for the next step."""
    path = Paths(Path(workdir)).predictor_file(run_id, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(predictor.state_dict(), tmp)
    tmp.rename(path)
    Session.current().keep_predictor(workdir, run_id, step, predictor)
    return path


def node_id(run_id: str, step: int, tree_id: int, local_index: int) -> str:
    return make_node_id(run_id, step, tree_id, local_index)


def engine_kind(engine: str) -> str:
    """The engine kind a config's ``engine`` names (``auto``: the platform's default)."""
    return default_engine_kind() if engine == "auto" else engine


def engine_for(engine: str, cluster: Cluster, run_id: str, policy_dir: str) -> Engine:
    """The session's engine of run ``run_id``, of the kind ``engine`` names (a config's
    ``engine``), on the Ray cluster of a config's ``cluster`` section if it names one, holding
    ``policy_dir``'s weights; after a policy update the flow syncs weights into it (sync task).

    The engine is keyed by the run's initial policy directory (``Session.engine_home``), so a
    later step (or a resumed run, or the next flow of a benchmark) re-uses the same engine and
    only reloads weights."""
    kind = engine_kind(engine)
    session = Session.current()
    home = session.engine_home(kind, run_id, policy_dir)
    if cluster.cluster:  # a pool of engine actors on Ray (docs/cluster.md)
        return cluster_for(cluster, run_id, kind).engine(home, policy_dir)
    return session.serve(get_engine(kind, home), home, policy_dir)


def cluster_for(cluster: Cluster, run_id: str, kind: str) -> Any:
    """The Ray session of run ``run_id`` on a config's ``cluster`` section
    (``trace_rl.cluster.session``: its engine pool and trainer group, engines of ``kind``);
    imports Ray, so only called when ``cluster.cluster`` is set."""
    from trace_rl.cluster.session import session

    return session(cluster.cluster, kind, cluster.rollout_engines, cluster.trainer_ranks,
                   cluster.weight_sync, run_id, strategy=cluster.trainer_strategy)

