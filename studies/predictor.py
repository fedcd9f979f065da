"""Which features make the best value predictor V~(H)?

Replays a finished train run's rollout trees through the pipeline's online protocol
(tasks/learn.py::fit_predictor): at step s, predict V~ for every internal node (roots and
prefixes) of step s, score those predictions against the backed-up targets V^, then fit the head
on the step's (history, V^, n) with its replay window. Metrics pool the predictions made BEFORE
each fit over steps >= 1 (step 0 is predicted by an untrained head). Every featuriser gets the run's
own head settings (predictor_lr, predictor_epochs) and the same head seeds.

Printed per featuriser (mean +- std over head seeds): Brier and ECE against V^, AUC on the nodes
whose leaves all agree (V^ in {0, 1}) pooled and within each step, the feature cost per prefix in ms (wall time of the
featuriser on each step's histories the first time they are seen, cache included, as the pipeline
pays it), the fit cost per step, and the one-off load time. The constant predictor (running
weighted base rate) is the reference.

    python -m studies.predictor --workdir DIR [--run-id ID] [--featurizers ...] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from trace_core.predictor import (ConstantPredictor, FeaturePredictor, Featurizer,
                                  HashedNgramFeaturizer, HeadConfig, Predictor, auc, brier, ece)
from trace_rl.config import config_from_mapping
from trace_rl.rollout.treeio import StepTrees
from trace_rl.storage.store import TreeStore


@dataclass(frozen=True)
class StepData:
    """One step's training examples for the predictor: every internal node of its trees."""

    histories: list[str]
    targets: np.ndarray  # [n] V^
    weights: np.ndarray  # [n] leaf counts n_y


def _policy(pooling: str) -> Callable[[str], Featurizer]:
    def make(policy_dir: str) -> Featurizer:
        from trace_rl.policy.features import EncoderConfig, PolicyHiddenFeaturizer

        return PolicyHiddenFeaturizer(policy_dir, EncoderConfig(pooling=pooling))
    return make


def _text_encoder(policy_dir: str) -> Featurizer:
    from trace_rl.policy.features import TextEncoderFeaturizer

    return TextEncoderFeaturizer()


FEATURIZERS: dict[str, Callable[[str], Featurizer]] = {
    "hashed-ngram": lambda policy_dir: HashedNgramFeaturizer(),
    "text-encoder": _text_encoder,
    "policy-mean": _policy("mean"),
    "policy-last": _policy("last"),
}
"""Featuriser registry: name -> factory of the run's starting policy directory."""


def step_examples(store: TreeStore, run_id: str, step: int) -> StepData:
    """(history, V^, n) of every backed-up internal node: exactly what fit_predictor fits on."""
    return StepData(*StepTrees(store.read_step(run_id, step)).predictor_examples())


def load_run(workdir: str | Path, run_id: str | None) -> tuple[str, dict[str, Any], list[StepData]]:
    """The run (the newest in the work dir when ``run_id`` is None), its config, its steps' data."""
    path = Path(workdir) / "trace.duckdb"
    if not path.exists():
        raise FileNotFoundError(f"no trace.duckdb in work dir {workdir}: run `trace train --workdir {workdir}` first")
    store = TreeStore(path, create=False)
    if run_id is None:
        runs = store.query("SELECT run_id FROM runs ORDER BY created_at DESC LIMIT 1").column("run_id").to_pylist()
        if not runs:
            raise ValueError(f"{path} holds no runs")
        run_id = runs[0]
    run = store.get_run(run_id)
    if run is None:
        raise ValueError(f"{path} holds no run {run_id!r}")
    last = store.last_complete_step(run_id)
    if last is None or last < 1:
        raise ValueError(f"run {run_id} has {0 if last is None else last + 1} complete step(s); "
                         "the study needs at least 2")
    return run_id, run["config"], [step_examples(store, run_id, s) for s in range(last + 1)]


def online(predictor: Predictor, steps: Sequence[StepData],
           featurizer: Featurizer | None = None) -> dict[str, Any]:
    """The pipeline's protocol: predict step s, then fit on it. Returns the predictions of
    steps >= 1 with their targets, seconds spent in the featuriser (on histories as they first
    arrive) and per fit."""
    preds, targets, step_of, feat_s, fit_s = [], [], [], 0.0, []
    for s, data in enumerate(steps):
        if featurizer is not None:
            t0 = time.perf_counter()
            featurizer(data.histories)  # fills its cache: what predict would spend on features
            feat_s += time.perf_counter() - t0
        p = predictor.predict(data.histories)  # [n]
        if s >= 1:
            preds.append(p)
            targets.append(data.targets)
            step_of.append(np.full(len(p), s))
        t0 = time.perf_counter()
        predictor.fit(data.histories, data.targets, data.weights)
        fit_s.append(time.perf_counter() - t0)
    return {"p": np.concatenate(preds), "y": np.concatenate(targets),
            "step": np.concatenate(step_of), "feature_s": feat_s,
            "fit_s": float(np.mean(fit_s))}


def _pure_auc(p: np.ndarray, y: np.ndarray) -> float:
    hard = (y == 0) | (y == 1)
    return auc(p[hard], y[hard]) if hard.any() and 0 < y[hard].mean() < 1 else float("nan")


def scores(p: np.ndarray, y: np.ndarray, step: np.ndarray) -> dict[str, float]:
    """Brier and ECE against V^; AUC on pure nodes (V^ in {0, 1}) when both outcomes occur,
    pooled over steps and within each step (mean over steps weighted by their pure nodes). The
    pooled AUC also rewards tracking the base rate's drift across steps (a running constant
    scores above 0.5 when the policy improves); the within-step AUC ranks prefixes only."""
    within, weight = [], []
    for s in np.unique(step):
        a = _pure_auc(p[step == s], y[step == s])
        if not np.isnan(a):
            within.append(a)
            weight.append(int(((y[step == s] == 0) | (y[step == s] == 1)).sum()))
    return {"brier": brier(p, y), "ece": ece(p, y), "auc": _pure_auc(p, y),
            "auc_step": float(np.average(within, weights=weight)) if within else float("nan")}


def study(steps: Sequence[StepData], head: HeadConfig, names: Sequence[str], policy_dir: str,
          seeds: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Per featuriser (plus ``constant``): metrics per seed and costs."""
    results: dict[str, dict[str, Any]] = {}
    const = online(ConstantPredictor(), steps)
    results["constant"] = {"dim": 0, "runs": [scores(const["p"], const["y"], const["step"])], "feature_ms": 0.0,
                           "fit_s": const["fit_s"], "load_s": 0.0}
    n_hist = sum(len(d.histories) for d in steps)
    for name in names:
        t0 = time.perf_counter()
        try:
            featurizer = FEATURIZERS[name](policy_dir)
        except ImportError as exc:
            results[name] = {"skipped": str(exc)}
            continue
        load_s = time.perf_counter() - t0
        runs, feature_ms, fit_s = [], None, []
        for seed in seeds:
            predictor = FeaturePredictor(featurizer, HeadConfig(**{**head.__dict__, "seed": seed}))
            # Features are cached per history, so only the first seed pays (and measures) them.
            out = online(predictor, steps, featurizer if feature_ms is None else None)
            if feature_ms is None:
                feature_ms = 1000.0 * out["feature_s"] / n_hist
            runs.append(scores(out["p"], out["y"], out["step"]))
            fit_s.append(out["fit_s"])
        results[name] = {"dim": featurizer.dim, "runs": runs, "feature_ms": feature_ms,
                         "fit_s": float(np.mean(fit_s)), "load_s": load_s}
    return results


def _cell(runs: list[dict[str, float]], key: str) -> str:
    v = np.array([r[key] for r in runs])
    if np.isnan(v).all():
        return "n/a"
    return f"{np.nanmean(v):.4f}" + (f" +- {np.nanstd(v):.4f}" if len(v) > 1 else "")


def render(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'predictor':<14} {'dim':>5} {'Brier':>17} {'ECE':>17} {'AUC (pure)':>17} {'AUC in-step':>17} {'feat ms/prefix':>15} {'fit s/step':>11} {'load s':>7}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"{name:<14} skipped: {r['skipped']}")
            continue
        lines.append(f"{name:<14} {r['dim']:>5} {_cell(r['runs'], 'brier'):>17} {_cell(r['runs'], 'ece'):>17} "
                     f"{_cell(r['runs'], 'auc'):>17} {_cell(r['runs'], 'auc_step'):>17} {r['feature_ms']:>15.3f} {r['fit_s']:>11.3f} {r['load_s']:>7.1f}")
    return "\n".join(lines)


def best(results: dict[str, dict[str, Any]]) -> str:
    mean_brier = {n: float(np.mean([x["brier"] for x in r["runs"]]))
                  for n, r in results.items() if "runs" in r and n != "constant"}
    if not mean_brier:
        raise ValueError("no featuriser ran")
    name = min(mean_brier, key=mean_brier.get)
    const = results["constant"]["runs"][0]["brier"]
    return f"best predictor: {name} (Brier {mean_brier[name]:.4f} vs constant {const:.4f})"


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="python -m studies.predictor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="work dir of a finished `trace train` run")
    ap.add_argument("--run-id", default=None, help="run to replay (default: the newest in the work dir)")
    ap.add_argument("--featurizers", nargs="+", default=list(FEATURIZERS), choices=list(FEATURIZERS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="head seeds")
    ap.add_argument("--policy-dir", default=None,
                    help="policy for the policy-* featurisers (default: the run's starting policy)")
    args = ap.parse_args(argv)

    run_id, config, steps = load_run(args.workdir, args.run_id)
    cfg = config_from_mapping(config, f"run {run_id}'s stored config")
    head = HeadConfig(lr=cfg.predictor_lr, epochs=cfg.predictor_epochs)
    policy_dir = args.policy_dir or cfg.policy
    y = np.concatenate([d.targets for d in steps[1:]])
    pure = (y == 0) | (y == 1)
    print(f"run {run_id} ({cfg.family}, {cfg.allocator}): {len(steps)} steps, "
          f"{sum(len(d.targets) for d in steps)} nodes; scored (steps >= 1): {len(y)} nodes, "
          f"{int(pure.sum())} pure ({int((y[pure] == 1).sum())} success); head lr {head.lr}, "
          f"epochs {head.epochs}, seeds {args.seeds}")
    results = study(steps, head, args.featurizers, policy_dir, args.seeds)
    print(render(results))
    print(best(results))
    return results


if __name__ == "__main__":
    main()
