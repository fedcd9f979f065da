"""How high can any allocation push the effective ratio on this pool? A ceiling from GRPO's own groups.

The effective ratio (share of rolled-out prompts whose group holds a success and a failure) that an
allocator can reach is bounded by how the pool's true per-prompt success rates p are spread. This
reads the GRPO runs of a ``bench.learning`` work dir, where every prompt got ``n`` independent
rollouts, and fits per window of steps a beta distribution of p by moments:

    mean of the group success rates   = mu
    variance of them                  = mu (1 - mu) [rho + (1 - rho) / n]

(rho: the intra-prompt correlation of outcomes, i.e. how far p varies between prompts). On pools of
``--pool-size`` prompts drawn from that beta it then gives the expected effective ratio, at the
benchmark's leaves per step, of

* ``grpo``          ``leaves / n`` prompts taken at random, ``n`` rollouts each (checks the fit
                    against the observed share);
* ``oracle_stage1`` the paper's Stage 1 objective solved exactly (``trace_core.allocation``) with
                    each prompt's TRUE p in place of the predictor, all leaves at once: what that
                    objective reaches with perfect predictions;
* ``oracle_joint``  TRACE's two waves with true p: Stage 1 on ``--root-budget`` leaves, outcomes
                    drawn, then the rest split by ``allocate_joint`` between further rollouts of
                    the prompts whose rollouts all agree and pairs of fresh prompts (TRACE's joint
                    split at the root; deeper prefixes need a model of turns and are left out);
* ``oracle_top``    the ``leaves / n`` prompts with p nearest 1/2, ``n`` rollouts each, and
* ``oracle_top2``   half as many such prompts with ``2n`` each (one more with ``n`` if
                    ``leaves / n`` is odd): allocations that chase the ratio itself (fewer, larger
                    groups), with true p.

    python -m studies.ceiling --workdir bench_runs/n2

The last line reads ``ceiling: oracle Stage 1 <x>x GRPO; oracle two waves <w>x; oracle top-<k> <y>x;
oracle top-<k/2> x 2n <z>x``
(ratios of the step-averaged effective ratios, as bench.learning reports them).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trace_core.allocation import (allocate_joint, allocate_roots, prefix_objective, root_gain,
                                   root_objective)

NAMES = ("grpo", "oracle_stage1", "oracle_joint", "oracle_top", "oracle_top2")
"""The allocations compared, in the order printed."""

RHO_FLOOR = 1e-3
"""Smallest rho fitted: a pool whose groups vary less than binomial noise is read as nearly alike."""


def fit_pool(values: Sequence[float], n: int) -> tuple[float, float]:
    """(mu, rho) of the per-prompt success rate from group success rates ``values`` of groups of
    ``n`` rollouts each, by moments; rho clipped to [RHO_FLOOR, 1 - RHO_FLOOR]."""
    v = np.asarray(values, dtype=np.float64)
    if n < 2 or len(v) < 2:
        raise ValueError(f"fit_pool: need >= 2 groups of >= 2 rollouts, got {len(v)} groups of {n}")
    mu = float(v.mean())
    if not 0.0 < mu < 1.0:
        raise ValueError(f"fit_pool: every group all {'successes' if mu == 1 else 'failures'}; "
                         "no spread to fit")
    rho = (v.var() / (mu * (1.0 - mu)) - 1.0 / n) / (1.0 - 1.0 / n)
    return mu, float(np.clip(rho, RHO_FLOOR, 1.0 - RHO_FLOOR))


def two_waves(p: np.ndarray, first: int, leaves: int, rng: np.random.Generator) -> tuple[float, int]:
    """(expected mixed prompts, prompts rolled out) of TRACE's two waves with true success rates
    ``p``: Stage 1 on ``first`` leaves, outcomes drawn, the other leaves by ``allocate_joint``
    (more rollouts of agreeing prompts, or fresh prompts); the second wave's outcomes are not
    drawn but taken in expectation."""
    m = allocate_roots(p, first)  # [pool]
    wins = rng.binomial(m, p)
    active = m > 0
    agree = active & ((wins == 0) | (wins == m))
    fresh = ~active
    observed = (wins[agree] > 0).astype(np.float64)  # the outcome an agreeing prompt repeated
    extra, k = allocate_joint(p[fresh], p[agree], observed, leaves - first)
    mixed = (np.count_nonzero(active & ~agree) + prefix_objective(p[agree], observed, k)
             + root_objective(p[fresh], extra))
    return mixed, int(np.count_nonzero(active) + np.count_nonzero(extra))


def pool_shares(mu: float, rho: float, *, pool_size: int, leaves: int, group: int, draws: int,
                rng: np.random.Generator, first: int | None = None) -> dict[str, dict[str, float]]:
    """Expected effective ratio ("share") and expected number of mixed prompts ("mixed") per
    allocation of the module docstring, averaged over ``draws`` pools (the same pools for all);
    ``first``: the first wave of ``oracle_joint`` (default a third of ``leaves``, as at N = 2)."""
    if group < 2 or leaves % group or not 0 < leaves // group <= pool_size:
        raise ValueError(f"pool_shares: need group >= 2 and leaves={leaves} a positive multiple of "
                         f"group={group} with leaves / group <= pool_size={pool_size}")
    first = leaves // 3 if first is None else first
    if not 2 <= first <= leaves:
        raise ValueError(f"pool_shares: first={first} must lie in [2, leaves={leaves}]")
    a, b = mu * (1.0 - rho) / rho, (1.0 - mu) * (1.0 - rho) / rho
    k = leaves // group
    out: dict[str, list[tuple[float, float]]] = {m: [] for m in NAMES}
    for _ in range(draws):
        p = rng.beta(a, b, size=pool_size)  # [pool]
        nearest = np.argsort(np.abs(p - 0.5), kind="stable")
        allocations = {
            "grpo": np.r_[np.full(k, group), np.zeros(pool_size - k, int)],  # pool order is random
            "oracle_stage1": allocate_roots(p, leaves),
            "oracle_top": np.zeros(pool_size, int),
            "oracle_top2": np.zeros(pool_size, int),
        }
        allocations["oracle_top"][nearest[:k]] = group
        allocations["oracle_top2"][nearest[:k // 2]] = 2 * group
        allocations["oracle_top2"][nearest[k // 2:k // 2 + k % 2]] = group
        for name, m in allocations.items():
            assert int(m.sum()) == leaves
            mixed = root_gain(p, m)  # [pool] P(prompt i's m_i rollouts are mixed)
            out[name].append((float(mixed.sum() / np.count_nonzero(m)), float(mixed.sum())))
        mixed_joint, rolled = two_waves(p, first, leaves, rng)
        out["oracle_joint"].append((mixed_joint / rolled, mixed_joint))
    return {name: {"share": float(np.mean([s for s, _ in v])), "mixed": float(np.mean([c for _, c in v]))}
            for name, v in out.items()}


def read_groups(workdir: Path, allocator: str = "grpo") -> list[tuple[str, int, float, int]]:
    """(run, step, success rate, rollouts) of every root that ``allocator``'s runs rolled out, from
    a train work dir or a bench.learning work dir (one DuckDB file per job)."""
    from trace_rl.storage.store import TreeStore

    dbs = sorted(workdir.glob(f"job-{allocator}-s*/trace.duckdb")) or [workdir / "trace.duckdb"]
    rows: list[tuple[str, int, float, int]] = []
    for db in dbs:
        if not db.exists():
            raise FileNotFoundError(f"studies.ceiling: no DuckDB store at {db}")
        t = TreeStore(db, create=False).query(
            "SELECT run_id, step, value, n_leaves FROM nodes WHERE depth = 0 AND allocator = $a "
            "AND value IS NOT NULL", {"a": allocator}).to_pylist()
        rows += [(f"{db}:{r['run_id']}", r["step"], r["value"], r["n_leaves"]) for r in t]
    if not rows:
        raise ValueError(f"studies.ceiling: no {allocator} roots with backed-up values under {workdir}")
    return rows


def ceiling(groups: list[tuple[str, int, float, int]], *, window: int, pool_size: int, draws: int,
            seed: int, first: int | None = None) -> list[dict[str, Any]]:
    """One row per window of ``window`` steps: the fit, the observed GRPO share, and
    ``pool_shares`` at the groups' size and the runs' leaves per step."""
    sizes = {n for *_, n in groups}
    if len(sizes) != 1:
        raise ValueError(f"studies.ceiling: the groups have sizes {sorted(sizes)}; need one GRPO size")
    (group,) = sizes
    spent: dict[tuple[str, int], int] = {}
    for run, step, _, n in groups:
        spent[run, step] = spent.get((run, step), 0) + n
    leaves = Counter(spent.values()).most_common(1)[0][0]  # the usual step's budget
    rng = np.random.default_rng(seed)
    rows = []
    last = max(step for _, step, _, _ in groups)
    for lo in range(0, last + 1, window):
        v = [x for _, s, x, _ in groups if lo <= s < lo + window]
        try:
            mu, rho = fit_pool(v, group)
        except ValueError as exc:
            raise ValueError(f"studies.ceiling, steps {lo}-{lo + window - 1}: {exc} "
                             "(try a larger --window)") from exc
        shares = pool_shares(mu, rho, pool_size=pool_size, leaves=leaves, group=group, draws=draws,
                             rng=rng, first=first)
        rows.append({"steps": (lo, min(lo + window, last + 1) - 1), "groups": len(v), "mu": mu,
                     "rho": rho, "observed": float(np.mean([0.0 < x < 1.0 for x in v])),
                     "leaves": leaves, "group": group, **shares})
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="a bench.learning work dir with GRPO runs")
    ap.add_argument("--window", type=int, default=5, help="steps per fitted window")
    ap.add_argument("--pool-size", type=int, default=32, help="candidate prompts per step (as in "
                    "bench.learning's --pool-size)")
    ap.add_argument("--root-budget", type=int, default=None, help="first wave of oracle_joint "
                    "(bench.learning's --root-budget; default a third of the leaves, as at N = 2)")
    ap.add_argument("--draws", type=int, default=400, help="simulated pools per window")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = ceiling(read_groups(Path(args.workdir)), window=args.window, pool_size=args.pool_size,
                   draws=args.draws, seed=args.seed, first=args.root_budget)
    names = NAMES
    print(f"{rows[0]['leaves']} leaves per step, GRPO groups of {rows[0]['group']}, pools of "
          f"{args.pool_size}; effective ratio (expected mixed prompts per step)")
    print(f"{'steps':>7}{'groups':>7}{'mu':>6}{'rho':>6}{'observed':>9}"
          + "".join(f"{n:>20}" for n in names))
    for r in rows:
        print(f"{r['steps'][0]:>3}-{r['steps'][1]:<3}{r['groups']:>7}{r['mu']:>6.2f}{r['rho']:>6.2f}"
              f"{r['observed']:>9.2f}" + "".join(f"{r[n]['share']:>13.2f} ({r[n]['mixed']:4.1f})"
                                                 for n in names))
    mean = {n: float(np.mean([r[n]["share"] for r in rows])) for n in names}
    k = rows[0]["leaves"] // rows[0]["group"]
    print(f"ceiling: oracle Stage 1 {mean['oracle_stage1'] / mean['grpo']:.2f}x GRPO; oracle two "
          f"waves {mean['oracle_joint'] / mean['grpo']:.2f}x; oracle top-{k} "
          f"{mean['oracle_top'] / mean['grpo']:.2f}x; oracle top-{(k + 1) // 2} x 2n "
          f"{mean['oracle_top2'] / mean['grpo']:.2f}x")
    return rows


if __name__ == "__main__":
    main()
