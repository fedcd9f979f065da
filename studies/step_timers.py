"""Where a step's overhead goes, piece by piece: ``python -m studies.step_timers [--steps 8]``.

``bench.overhead`` gives the overhead (a step's wall less generation and the optimiser) and the
seconds inside each Prefect task run; this study times the pieces that make it up, in one real
``train`` run of the default config (evaluation off, a new work dir and Prefect home): Prefect's
own cost around each task run (``run_task_sync`` less the task's function), the store's calls,
the weight load into the engine, the checkpoint save, the tree metrics and the step's end
mark. It wraps those functions with timers for the run's length; each row is a mean over the
steps after step 0 (which starts the engine). Its finding is in docs/results.md, "The overhead
of a step, and the optimiser against the machine".
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

SECONDS: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
"""step -> piece -> seconds spent in it during that step."""
STEP = [-1]


def timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its seconds to the current step's ``label``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[STEP[0]][label] += time.perf_counter() - t0
    setattr(owner, name, wrapper)


def instrument() -> None:
    import prefect.task_engine as engine

    import flows.run_lifecycle as lifecycle
    import flows.train as train
    import tasks.expand as expand
    import tasks.runtime as runtime
    import tasks.track as track
    from trace_rl.policy.update import PolicyTrainer
    from trace_rl.storage.store import TreeStore

    run_task, call = engine.run_task_sync, engine.call_with_parameters
    inside = [0.0]

    def run_task_sync(*args: Any, **kwargs: Any) -> Any:  # Prefect's cost: the run less the fn
        t0, inside[0] = time.perf_counter(), 0.0
        try:
            return run_task(*args, **kwargs)
        finally:
            SECONDS[STEP[0]]["prefect, around the task runs"] += time.perf_counter() - t0 - inside[0]

    def call_with_parameters(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0
    engine.run_task_sync, engine.call_with_parameters = run_task_sync, call_with_parameters
    step = train.run_step

    def run_step(cfg: Any, at: Any, *args: Any, **kwargs: Any) -> Any:
        STEP[0] = at.step
        return step(cfg, at, *args, **kwargs)
    train.run_step = run_step
    for method in ("write_level", "update_values", "mark_step", "query"):
        timed(TreeStore, method, f"store.{method}")
    timed(lifecycle.Run, "complete", "the step's end (mark, pruning)")
    timed(runtime, "engine_for", "weight load into the engine")
    timed(PolicyTrainer, "save", "checkpoint save")
    timed(PolicyTrainer, "update", "optimiser (not overhead)")
    timed(expand, "_rollout", "rollouts (generation, not overhead)")
    timed(track, "tree_metrics", "tree metrics")
    timed(track, "prediction_metrics", "tree metrics: the predictions' figures")
    from trace_rl.storage.published import PublishedDatabase

    timed(PublishedDatabase, "_open", "store: connection opens")
    timed(PublishedDatabase, "_publish", "store: publishes (file copies)")
    timed(runtime, "save_predictor", "predictor save")
    timed(runtime, "load_predictor", "predictor load")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    instrument()
    from flows.train import train
    from trace_rl.config import TrainConfig

    with tempfile.TemporaryDirectory(prefix="trace-step-timers-") as workdir:
        train(config=TrainConfig(steps=args.steps, eval_items=0, run_name="step-timers"),
              workdir=workdir)
    steps = [s for s in SECONDS if s > 0]
    print(f"mean seconds a step over steps {steps[0]}-{steps[-1]}:")
    for label in sorted({k for s in steps for k in SECONDS[s]}):
        print(f"  {label:40s} {sum(SECONDS[s][label] for s in steps) / len(steps):6.3f}")


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="trace-step-timers-prefect-"))
    from trace_rl import environ

    environ.apply()
    from trace_rl.engines import entry_point

    sys.exit(entry_point(main))
