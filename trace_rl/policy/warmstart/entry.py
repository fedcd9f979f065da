"""The warm start's entry point: ``warmstart_policy`` builds (or reuses) the policy of a
``WarmstartConfig``, once per machine under the cache, as an MLflow run in the work dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.envs.registry import make_env
from trace_rl.policy import cache
from trace_rl.policy.warmstart.cache import holds, input_hash
from trace_rl.policy.warmstart.config import RECORD, WarmstartConfig
from trace_rl.policy.warmstart.traces import load_split_items


def warmstart_policy(config: WarmstartConfig, out_dir: str | Path, *,
                     cache_dir: str | Path | None = None, workdir: str | Path | None = None,
                     engine: str = "auto", show_progress: bool = False) -> Path:
    """Build (or reuse) the warm-started policy of ``config`` in ``out_dir``; return it.

    With ``cache_dir`` it is built once per machine (``cache_dir/policies/warmstart-<family>-
    <hash>``, under a file lock) and copied into ``out_dir``. With ``workdir`` the build is an
    MLflow run there (experiment ``warmstart``). ``engine``: the measurement's rollout engine."""
    from trace_rl.policy.named import resolve_policy

    out = Path(out_dir)
    base_dir = Path(resolve_policy(config.base))
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"warmstart: base={config.base!r} is not a Hugging Face model directory "
                         "or a named policy")
    env = make_env(config.family, **dict(config.env_args))
    train, eval_items = load_split_items(config, env)
    digest = input_hash(config, base_dir, env, train, eval_items)
    if holds(out, digest):
        return out
    if cache_dir is None:
        _build(config, base_dir, env, train, eval_items, digest, out, workdir, engine,
               show_progress)
        return out
    cached = Path(cache_dir) / "policies" / f"warmstart-{config.family}-{digest[:16]}"
    return cache.build_once(cached, out, lambda d: holds(d, digest),
                            lambda d: _build(config, base_dir, env, train, eval_items, digest, d,
                                             workdir, engine, show_progress),
                            "warmstart" if show_progress else None)


def _build(config: WarmstartConfig, base_dir: Path, env: Environment, train: list[TaskItem],
           eval_items: list[TaskItem], digest: str, out: Path, workdir: str | Path | None,
           engine: str, show_progress: bool) -> None:
    """Train the policy (an MLflow run with ``workdir``) and move it onto ``out`` atomically."""
    from trace_rl.policy.warmstart.training import train_policy
    from trace_rl.progress import Progress, Silent

    tracker = None
    if workdir is not None:
        from trace_rl.storage.tracking import Tracker

        tracker = Tracker(workdir, experiment="warmstart")
        tracker.start_or_resume(f"warmstart-{config.family}-{digest[:10]}")
        tracker.log_config({**config.to_json(), "base_dir": str(base_dir)})

    def make(staged: Path, work: Path) -> dict[str, Any]:
        with (Progress(f"warmstart {config.family}", 0) if show_progress else Silent()) as progress:
            record = train_policy(config, base_dir, env, train, eval_items, staged, progress,
                                  tracker, engine)
        return record | {"input_hash": digest}

    try:
        cache.build_staged(out, RECORD, make)
    except BaseException:
        if tracker is not None:
            tracker.end("FAILED")
        raise
    if tracker is not None:
        tracker.end("FINISHED")
