"""The outcome correlation rho the allocation reads (``trace_core.calibration``), from the store.

Shared by Stage 1 (``tasks.roots.score_roots``, depth 0) and Stage 2
(``tasks.prefixes.score_prefixes``, every depth) and by ``studies/calibration.py``.
"""

from __future__ import annotations

from tasks import runtime
from trace_core import calibration
from trace_core.allocators import Allocator
from trace_rl.config import TrainConfig
from trace_rl.rollout.treeio import StepTrees
from trace_rl.session import Session

TERMS = "correlation-terms"
"""The session memo of each finished step's terms, keyed (work dir, run id, step)."""


def outcome_correlation(cfg: TrainConfig, allocator: Allocator, workdir: str, run_id: str,
                        step: int) -> calibration.Correlation:
    """rho per depth from the stored trees of the last ``correlation_window`` steps before
    ``step`` (more, if they hold too few nodes for the roots' estimate or, for an allocator that
    branches, the prefixes'), with the predictions the allocation used then; no estimate (0
    everywhere) when the window is 0 or the allocator reads no predictor. Both stages of a step ask for it; the steps it
    reads are complete and never rewritten, so the second ask is served from memory."""
    if cfg.correlation_window == 0 or step == 0 or not allocator.uses_predictor:
        return calibration.Correlation()
    branches = allocator.tree_leaves(cfg.min_per_root, cfg.budget) > 0
    # A window too thin for an estimate (e.g. steps that continued few prefixes because rho was
    # high) is widened, doubling, back to step 0, instead of falling back to rho = 0: a fallback
    # would flip the allocation between two regimes from step to step.
    width = cfg.correlation_window
    while True:
        first = max(0, step - width)
        rho = _estimate(workdir, run_id, first, step, cfg.correlation_min_terms)
        enough = 0 in rho.by_depth and (not branches or rho.prefix_evidence >= cfg.correlation_min_terms)
        if first == 0 or enough:
            return rho
        width *= 2


def _estimate(workdir: str, run_id: str, first: int, stop: int, min_terms: int) -> calibration.Correlation:
    """rho of steps first .. stop - 1 (complete, never rewritten: kept in the session)."""
    return Session.current().memo(
        "correlation", (workdir, run_id, first, stop, min_terms),
        lambda: calibration.estimate(stored_terms(workdir, run_id, first, stop),
                                     min_terms=min_terms), maxsize=16)


def stored_terms(workdir: str, run_id: str, first: int, stop: int) -> list[calibration.Term]:
    """``calibration.batch_terms`` of every stored tree of steps first .. stop - 1, with the
    predictions the allocation used (roots: the node's Stage 1 score; prefixes: the Stage 2
    score in the allocations table); each step's read once per session (a window slides by one
    step a step)."""
    return [t for s in range(first, stop) for t in _step_terms(workdir, run_id, s)]


def _step_terms(workdir: str, run_id: str, step: int) -> list[calibration.Term]:
    """The terms of one stored step (complete, never rewritten: kept in the session)."""
    def read() -> list[calibration.Term]:
        store = runtime.store(workdir)
        scores = store.query("SELECT node_id, predicted_v FROM allocations WHERE run_id = $r AND "
                             "step = $s AND level = 1", {"r": run_id, "s": step})
        trees = StepTrees(store.read_step(run_id, step))
        return calibration.batch_terms(trees.batch, trees.allocation_scores(scores))

    return Session.current().memo(TERMS, (workdir, run_id, step), read, maxsize=64)


def remember_step_terms(workdir: str, run_id: str, step: int,
                        terms: list[calibration.Term]) -> None:
    """Keep a finished step's terms (computed from its final trees and allocation scores, as
    ``_step_terms`` reads them) for the next steps' rho, so the store is not read for them."""
    Session.current().memo(TERMS, (workdir, run_id, step), lambda: terms, maxsize=64)
