"""Stage 1, one task: the step's candidate pool (``candidate_pool``), scored by the predictor
(``score_roots``), and its bare rollouts allocated (``allocate_roots``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from prefect import task

from tasks import runtime
from tasks.correlation import outcome_correlation
from tasks.runtime import StepRef, load_predictor
from trace_core.allocators import Allocator, RootPool
from trace_core.posterior import PromptPosterior, root_values
from trace_core.seeds import Phase, phase_rng
from trace_rl.config import TrainConfig
from trace_rl.rollout.treeio import StepTrees, history_text
from trace_rl.session import Session


def candidate_pool(cfg: TrainConfig, step: int, ids: list[str] | None = None) -> list[str]:
    """The candidate pool of ``step``: ``pool_size`` item ids of the train split (``ids``, sorted;
    default: loaded), drawn without replacement, seeded by (seed, step), so any step's pool can be
    recomputed."""
    ids = sorted(runtime.items_for(cfg, cfg.train_split)) if ids is None else ids
    if len(ids) < cfg.pool_size:
        raise ValueError(f"{cfg.family}/{cfg.train_split} has {len(ids)} items; pool_size="
                         f"{cfg.pool_size} needs at least that many")
    rng = phase_rng(cfg.seed, step, Phase.POOL)
    return [ids[i] for i in rng.choice(len(ids), size=cfg.pool_size, replace=False)]


def staleness(cfg: TrainConfig, step: int, item_ids: list[str],
              last_rolled_out: dict[str, int]) -> list[float]:
    """Steps each candidate has waited for a rollout: since it was last rolled out, or, if it never
    was, since it was first offered in a candidate pool (0 for a prompt offered for the first time).

    Exploration (``trace_core.allocation.explore``) trusts a prediction less the longer it has
    gone unchecked. A prompt seen for the first time has nothing unchecked: its prediction comes
    from a predictor fit on the last step. (Counting every step so far for it, as the simulator
    of a small recurring pool may, flattened every prediction toward 1/2 as training went on when
    the pool is drawn from a large dataset: by exp(-0.1 (t + 1)), i.e. to a third at step 10.)
    """
    first_offered: dict[str, int] = {}
    wanted = set(item_ids) - set(last_rolled_out)
    ids = sorted(runtime.items_for(cfg, cfg.train_split)) if wanted and step else []
    for s in range(step):  # earlier pools are a pure function of (config, step)
        if not wanted:
            break
        for i in candidate_pool(cfg, s, ids):
            if i in wanted:
                first_offered[i] = s
                wanted.discard(i)
    return [float(step - last_rolled_out[i]) if i in last_rolled_out
            else float(step - first_offered.get(i, step)) for i in item_ids]


BARE_COUNTS = "bare-counts"
"""The session memo of ``bare_counts`` as of a step's start, keyed (work dir, run id, step)."""


def bare_counts(workdir: str, run_id: str, step: int) -> list[dict]:
    """Per prompt rolled out before ``step``: successes ``s`` and rollouts ``n`` of its bare
    rollouts (level-0 leaves, refill waves included) and ``last``, the last step it was rolled
    out in, from the stored steps before ``step``. Read once per session: a finished step adds
    its own to the counts as of its start (``remember_bare_counts``), so the next step's read is
    served from memory; a resumed run reads them from the store."""
    def read() -> list[dict]:
        return runtime.store(workdir).query(
            "SELECT item_id, coalesce(sum(reward) FILTER (WHERE is_leaf AND level = 0), 0) AS s, "
            "count(*) FILTER (WHERE is_leaf AND level = 0) AS n, max(step) AS last FROM nodes "
            "WHERE run_id = $r AND step < $s AND (depth = 0 OR is_leaf AND level = 0) "
            "GROUP BY item_id ORDER BY item_id", {"r": run_id, "s": step}).to_pylist()

    return Session.current().memo(BARE_COUNTS, (workdir, run_id, step), read, maxsize=4)


def remember_bare_counts(workdir: str, run_id: str, step: int, trees: StepTrees) -> None:
    """After ``step`` finished (``trees``: its final trees): ``bare_counts`` as of ``step + 1``,
    the counts as of ``step`` plus the step's own bare rollouts, kept in the session (the rows
    the store's query would return, in its order)."""
    counts = {r["item_id"]: dict(r) for r in bare_counts(workdir, run_id, step)}
    columns = ("item_id", "depth", "is_leaf", "level", "reward")
    for item, depth, leaf, level, reward in zip(*(trees.column(c) for c in columns)):
        bare = bool(leaf) and level == 0
        if depth == 0 or bare:
            row = counts.setdefault(item, {"item_id": item, "s": 0.0, "n": 0, "last": step})
            row["last"] = step
            if bare:
                row["s"], row["n"] = row["s"] + reward, row["n"] + 1
    rows = [counts[i] for i in sorted(counts)]
    Session.current().memo(BARE_COUNTS, (workdir, run_id, step + 1), lambda: rows, maxsize=4)


def prompt_posterior(cfg: TrainConfig, workdir: str, run_id: str, step: int) -> PromptPosterior:
    """The per-prompt posterior of ``TrainConfig.root_posterior`` as of the start of ``step``,
    rebuilt from the bare rollouts stored before it (``bare_counts``), so a resumed run has the
    same counts and there is no state of its own to keep."""
    rows = [r for r in bare_counts(workdir, run_id, step) if r["n"]]
    posterior = PromptPosterior(cfg.root_posterior)
    posterior.update([r["item_id"] for r in rows], np.asarray([r["s"] for r in rows], np.float64),
                     np.asarray([r["n"] for r in rows], np.float64))
    return posterior


def _oracle(cfg: TrainConfig, ids: list[str]) -> np.ndarray:
    """The family's oracle success rate of each item (``Environment.oracle_success``)."""
    env, items = runtime.env_for(cfg), runtime.items_for(cfg, cfg.train_split)
    o = [env.oracle_success(items[i]) for i in ids]
    if any(x is None for x in o):
        raise ValueError(f"root_oracle: family {cfg.family!r} has no oracle_success")
    return np.asarray(o, dtype=np.float64)


def _rates(measured: pa.Table, item_ids: list[str]) -> np.ndarray:
    """The measured success rate of each of ``item_ids`` (``measure_roots``' table, same order)."""
    if measured.column("item_id").to_pylist() != list(item_ids):
        raise ValueError("score_roots: the measured oracle's candidates are not the pool's")
    return measured.column("successes").to_numpy() / measured.column("rollouts").to_numpy()


def score_roots(cfg: TrainConfig, allocator: Allocator, at: StepRef, item_ids: list[str],
                measured: pa.Table | None = None) -> pa.Table:
    """V~(x_i) for the pool (``trace_core.posterior.root_values``: the text predictor's, the
    per-prompt posterior's, the family's oracle's or, with ``measured`` (``measure_roots``, in
    pool order), the Monte-Carlo oracle's success rates), each prompt's staleness and the roots'
    outcome correlation rho (``tasks.correlation.outcome_correlation``), from one read of the
    earlier steps' bare rollouts."""
    items = runtime.items_for(cfg, cfg.train_split)
    text = load_predictor(cfg.predictor, cfg.seed, at.workdir, at.run_id, at.step - 1).predict(
        [history_text(items[i].question, []) for i in item_ids])
    past = bare_counts(at.workdir, at.run_id, at.step)
    rolled = [r for r in past if r["n"]]
    seen = [r["item_id"] for r in rolled]
    v = root_values(text, item_ids, seen, np.asarray([r["s"] for r in rolled], np.float64),
                    np.asarray([r["n"] for r in rolled], np.float64), strength=cfg.root_posterior,
                    oracle=_oracle(cfg, item_ids) if cfg.root_oracle else None,
                    seen_oracle=_oracle(cfg, seen) if cfg.root_oracle else None,
                    measured=None if measured is None else _rates(measured, item_ids))
    rho = outcome_correlation(cfg, allocator, at.workdir, at.run_id, at.step).at(0)
    return pa.table({"item_id": item_ids, "predicted_v": np.asarray(v, dtype=np.float64),
                     "staleness": staleness(cfg, at.step, item_ids,
                                            {r["item_id"]: r["last"] for r in past}),
                     "correlation": pa.array([rho] * len(item_ids), pa.float64())})


def root_pool(scored: pa.Table) -> RootPool:
    """The step's candidate pool as trace_core's allocators read it, from ``score_roots``' table."""
    rho = scored.column("correlation")
    return RootPool(predicted=scored.column("predicted_v").to_numpy(),
                    staleness=scored.column("staleness").to_numpy(),
                    correlation=float(rho[0].as_py()) if len(rho) else 0.0)


def with_counts(scored: pa.Table, m: np.ndarray) -> pa.Table:
    """``score_roots``' table with ``m``, the bare rollouts of each candidate (a wave's plan;
    an ``m`` already there is replaced)."""
    if "m" in scored.column_names:
        scored = scored.drop_columns(["m"])
    return scored.append_column("m", pa.array(np.asarray(m, dtype=np.int64)))


@task(name="allocate-roots", cache_policy=runtime.PHASE_KEY)
def allocate_roots(cfg: TrainConfig, allocator: Allocator, at: StepRef, item_ids: list[str],
                   measured: pa.Table | None = None) -> pa.Table:
    """Stage 1 on the step's candidate pool ``item_ids`` (``candidate_pool``): its scores
    (``score_roots``; ``measured``: the Monte-Carlo oracle's) with m_i, the bare rollouts the
    step's allocator gives each candidate (Stage 1 for trace / prompt_only), as column ``m``.
    Scoring and allocating are one task run (both cheap; cached together)."""
    scored = score_roots(cfg, allocator, at, item_ids, measured)
    rng = phase_rng(cfg.seed, at.step, Phase.ROOTS)
    return with_counts(scored, allocator.allocate_roots(root_pool(scored),
                                                        allocator.root_leaves(cfg.budget), rng))
