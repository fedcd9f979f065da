"""How well does Stage 1 rank prompts? Root AUC per step of a stored run, for several rankers.

For every step of a ``train`` run (its DuckDB store and predictor checkpoints), each bare rollout
is one (score, reward) pair, scored by its prompt's prediction (``trace_core.calibration.
batch_pairs``), and the AUC is taken within the step. Rankers, all of the same roots:

* ``stored``: what Stage 1 used (the ``predicted_v`` of the root: the text predictor's, or with
  ``root_posterior`` / ``root_oracle`` theirs);
* ``text``: the shared text predictor as saved after the previous step (recomputed);
* ``posterior k``: the per-prompt posterior (``trace_core.posterior``, strength k) over the text
  predictor, counts from the bare rollouts of the earlier steps;
* ``oracle``: the family's ``Environment.oracle_success`` (synth_chain: 0.5 per homonym).

    python -m studies.roots --workdir trace_runs [--run RUN_ID] [--strength 4]

Prints one row per step and the mean over the steps from ``--from-step`` on.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np


def root_aucs(workdir: str, run_id: str, strength: float = 4.0) -> list[dict[str, Any]]:
    """Per step: the number of bare rollouts and the within-step root AUC of each ranker (nan
    where the step's bare rollouts all agree)."""
    from tasks import roots, runtime
    from trace_core.posterior import PromptPosterior
    from trace_core.predictor import auc
    from trace_rl.config import config_from_mapping
    from trace_rl.rollout.treeio import history_text

    store = runtime.store(workdir)
    stored_cfg = store.get_run(run_id)
    if stored_cfg is None:
        raise KeyError(f"studies.roots: no run {run_id!r} in {workdir}")
    cfg = config_from_mapping(stored_cfg["config"], f"run {run_id}")
    env, items = runtime.env_for(cfg), runtime.items_for(cfg, cfg.train_split)
    steps = [r["step"] for r in store.query(
        "SELECT DISTINCT step FROM nodes WHERE run_id = $r ORDER BY step", {"r": run_id}).to_pylist()]
    out = []
    for step in steps:
        rows = store.query(
            "SELECT n.item_id, any_value(r.predicted_v) AS stored, list(n.reward) AS rewards "
            "FROM nodes n JOIN nodes r ON r.run_id = n.run_id AND r.step = n.step "
            "AND r.tree_id = n.tree_id AND r.depth = 0 WHERE n.run_id = $r AND n.step = $s "
            "AND n.is_leaf AND n.level = 0 GROUP BY n.tree_id, n.item_id ORDER BY n.tree_id",
            {"r": run_id, "s": step}).to_pylist()
        ids = [r["item_id"] for r in rows]
        text = runtime.load_predictor(cfg.predictor, cfg.seed, workdir, run_id, step - 1).predict(
            [history_text(items[i].question, []) for i in ids])
        posterior = PromptPosterior(strength)
        seen = roots.bare_counts(workdir, run_id, step)
        posterior.update([r["item_id"] for r in seen], np.asarray([r["s"] for r in seen], float),
                         np.asarray([r["n"] for r in seen], float))
        oracle = [env.oracle_success(items[i]) for i in ids]
        rankers = {"stored": [r["stored"] for r in rows], "text": text,
                   f"posterior {strength:g}": posterior.predict(ids, np.asarray(text))}
        if all(o is not None for o in oracle):
            rankers["oracle"] = oracle
        y = np.concatenate([r["rewards"] for r in rows]).astype(float) if rows else np.zeros(0)
        row: dict[str, Any] = {"step": step, "rollouts": int(y.size),
                               "recurring": int(sum(posterior.counts(ids)[1] > 0))}
        for name, score in rankers.items():
            p = np.repeat(np.asarray(score, float), [len(r["rewards"]) for r in rows])
            row[name] = auc(p, y) if y.size and 0 < y.mean() < 1 else float("nan")
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--run", default=None, help="run id (default: the only run in the store)")
    ap.add_argument("--strength", type=float, default=4.0, help="k of the posterior ranker")
    ap.add_argument("--from-step", type=int, default=0, help="first step of the printed mean")
    args = ap.parse_args(argv)
    from tasks import runtime

    workdir = str(Path(args.workdir).resolve())
    run = args.run
    if run is None:
        ids = [r["run_id"] for r in runtime.store(workdir).query("SELECT run_id FROM runs").to_pylist()]
        if len(ids) != 1:
            raise SystemExit(f"studies.roots: {len(ids)} runs in {workdir}; choose one with --run: {ids}")
        run = ids[0]
    rows = root_aucs(workdir, run, args.strength)
    names = [k for k in rows[0] if k not in ("step", "rollouts", "recurring")] if rows else []
    print(f"root AUC per step of {run} (bare rollouts scored by their prompt's prediction)")
    print(f"{'step':>4} {'rollouts':>8} {'seen before':>11} " + " ".join(f"{n:>13}" for n in names))
    for r in rows:
        print(f"{r['step']:>4} {r['rollouts']:>8} {r['recurring']:>11} "
              + " ".join(f"{r[n]:>13.3f}" for n in names))
    tail = [r for r in rows if r["step"] >= args.from_step]
    print(f"mean over steps {args.from_step}-{rows[-1]['step'] if rows else '-'}: " + ", ".join(
        f"{n} {np.nanmean([r[n] for r in tail]):.3f}" for n in names))
    return rows


if __name__ == "__main__":
    main()
