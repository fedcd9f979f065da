"""The learning benchmark's runs: one (method, seed) run of the train flow from the shared starting
policy, its held-out evaluations, and its record under ``<workdir>/runs/`` (kept per settings)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

METHODS = ("trace", "grpo", "dapo", "prompt_only", "random_prefix")
VARIANTS: dict[str, dict[str, Any]] = {
    "trace_oracle": {"allocator": "trace", "root_oracle": True},
    "trace_posterior": {"allocator": "trace", "root_posterior": 4.0},
    "trace_joint": {"allocator": "trace", "joint_split": True},
    "cover_oracle": {"allocator": "trace_cover", "root_oracle": True},
    "trace_cover_oracle": {"allocator": "trace_cover", "oracle_rollouts": 8},
    # the simulator's cover_post_noexp (docs/results.md, "Learning simulator": "Helped")
    "cover_post_noexp": {"allocator": "trace_cover", "root_posterior": 4.0, "exploration": 0.0},
}
"""Methods beyond the allocators, as ``TrainConfig`` overrides."""


@dataclass
class RunResult:
    method: str
    seed: int
    eval_steps: list[int]  # -1 = the starting policy
    accuracy: list[float]
    effective_ratio: list[float]
    leaves: list[float]
    generated_tokens: float
    tool_calls: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    eval_tokens: list[float] = field(default_factory=list)  # generated tokens spent before each evaluation


def _eval(cfg_dict: dict[str, Any], policy_dir: str, eval_items: int, eval_skip: int,
          eval_samples: int, eval_temperature: float) -> float:
    """Mean reward of ``eval_samples`` rollouts per item on test items past the ``eval_skip`` the
    bootstrap chose its epoch on (accuracy on those is biased upward: 27% there against 16%). The
    evaluations of runs from one starting policy (``cfg_dict["policy"]``) share a run id, hence one
    engine that only reloads weights (``tasks.runtime.engine_for`` keys engines by run id)."""
    import hashlib

    from flows.evaluate import evaluate_rollouts
    from trace_rl.config import config_from_mapping

    start = str(Path(cfg_dict["policy"]).resolve()).encode()
    run_id = "learn-eval-" + hashlib.sha256(start).hexdigest()[:8]
    cfg = config_from_mapping({**cfg_dict, "run_id": run_id}, "bench.learning")
    out = evaluate_rollouts.fn(cfg, policy_dir, cfg.eval_split, eval_items, eval_samples,
                               eval_temperature, skip=eval_skip)
    return out["accuracy"]


def run_one(method: str, seed: int, base: dict[str, Any], policy: str, workdir: Path,
            eval_steps: Sequence[int], start_accuracy: float, **ev: Any) -> RunResult:
    """One (method, seed) run of the train flow in ``workdir``, its checkpoints at ``eval_steps``
    evaluated on the test split: the record is whole once the run ends."""
    from flows.train import train
    from tasks.runtime import Paths
    from trace_rl.config import config_from_mapping
    from trace_rl.storage.store import TreeStore

    config = {**base, **VARIANTS.get(method, {"allocator": method}), "seed": seed,
              "policy": policy, "run_name": f"learn-{method}-s{seed}"}
    t0 = time.perf_counter()
    summary = train(config=config_from_mapping(config, "bench.learning"), workdir=str(workdir))
    wall = time.perf_counter() - t0
    run_id = summary["run_id"]
    store = TreeStore(workdir / "trace.duckdb", create=False)
    steps = store.query("SELECT step, metrics_json FROM steps WHERE run_id = $r AND status = 'complete' "
                        "ORDER BY step", {"r": run_id}).to_pylist()
    metrics = [json.loads(s["metrics_json"]) for s in steps]
    acc = [start_accuracy]
    for s in eval_steps:
        acc.append(_eval(config, str(Paths(workdir).policy_dir(run_id, s)), **ev))
    return RunResult(method=method, seed=seed, eval_steps=[-1, *eval_steps], accuracy=acc,
                     effective_ratio=[m["tree/effective_ratio"] for m in metrics],
                     leaves=[m["rollout/leaves"] for m in metrics],
                     generated_tokens=sum(m["ledger/generated_tokens"] for m in metrics),
                     tool_calls=sum(m["ledger/tool_calls"] for m in metrics), wall_s=wall,
                     extra={"reward_mean": float(np.mean([m["rollout/reward_mean"] for m in metrics])),
                            **curves(metrics, PREDICTOR_KEYS, "predictor/"),
                            "per_step": curves(metrics, UPDATE_KEYS),
                            "steps": step_costs(store, run_id, metrics)},
                     eval_tokens=tokens_at_evals(metrics, eval_steps))


def step_costs(store: Any, run_id: str, metrics: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Per step, what the protocol's tables show: generated tokens, training tokens (summed over
    every root-to-leaf path: what the update forwards), the bare rollouts (level 0) and their
    tokens, the active and mixed prompts and a Monte-Carlo oracle's own generated tokens."""
    rows = {r["step"]: r for r in store.query(
        "SELECT step, sum(gen_tokens * coalesce(n_leaves, 0)) AS train_tokens, "
        "coalesce(sum(gen_tokens) FILTER (WHERE level = 0), 0) AS bare_tokens, "
        "count(*) FILTER (WHERE level = 0 AND is_leaf) AS bare "
        "FROM nodes WHERE run_id = $r GROUP BY step", {"r": run_id}).to_pylist()}
    steps = range(len(metrics))
    active = [float(m.get("alloc/active_roots", float("nan"))) for m in metrics]
    oracle = [float(m["predictor/oracle_tokens"]) for m in metrics if "predictor/oracle_tokens" in m]
    return {"tokens": [float(m["ledger/generated_tokens"]) for m in metrics],
            "train_tokens": [float(rows[s]["train_tokens"] or 0) for s in steps],
            "bare_tokens": [float(rows[s]["bare_tokens"]) for s in steps],
            "bare": [float(rows[s]["bare"]) for s in steps],
            "active": active,
            "mixed": [a * float(m["tree/effective_ratio"]) for a, m in zip(active, metrics)],
            **({"oracle_tokens": oracle} if oracle else {})}


PREDICTOR_KEYS = ("root_auc", "prefix_auc", "root_brier", "prefix_brier", "flip_predicted",
                  "flip_realised")
"""Per-step predictor statistics kept in a run record (``tasks.track.prediction_metrics``)."""
UPDATE_KEYS = ("rollout/reward_mean", "loss/pg_loss", "loss/grad_norm", "loss/approx_kl",
               "loss/approx_kl_max", "loss/ratio_max", "loss/entropy_proxy", "loss/kl_stopped",
               "loss/kl_after_step_max", "time/step_s", "time/rollout_s")
"""Per-step statistics of the rollouts and the update kept in a run record (``extra["per_step"]``);
the steps' seconds also cover steps of an earlier process."""


def curves(metrics: Sequence[dict[str, Any]], keys: Sequence[str],
           prefix: str = "") -> dict[str, list[float]]:
    """Per step (step order), each key's metric ``prefix + key``; nan where a step did not log it."""
    return {key: [float(m.get(prefix + key, float("nan"))) for m in metrics] for key in keys}


def tokens_at_evals(metrics: Sequence[dict[str, Any]], eval_steps: Sequence[int]) -> list[float]:
    """Generated tokens spent before each evaluation: 0 before the first step, then the sum
    through each evaluated step, from the per-step metrics (step order)."""
    spent = np.cumsum([m["ledger/generated_tokens"] for m in metrics])
    if eval_steps and max(eval_steps) >= len(spent):
        raise ValueError(f"{len(spent)} steps stored, evaluations at steps {list(eval_steps)}")
    return [0.0, *(float(spent[s]) for s in eval_steps)]


def parse_seeds(text: str, count: bool = True) -> list[int]:
    """``--seeds``: ranges and lists (``"3-5"``: seeds 3, 4 and 5; ``"0-2,7"``) or, with
    ``count``, a lone number as a count (``"3"``: seeds 0, 1 and 2; else seed 3)."""
    try:
        seeds = list(range(int(text))) if count and str(text).isdigit() else [
            s for part in str(text).split(",") for lo, _, hi in [part.partition("-")]
            for s in (range(int(lo), int(hi) + 1) if hi else [int(lo)])]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: give a count (3), a range (3-5) or a list (0-2,7)") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: no seeds, or repeated ones (a count >= 1, or ranges "
                         "low-high of distinct seeds >= 0)")
    return seeds


def eval_plan(args: Any, skip: int) -> tuple[list[int], dict[str, Any]]:
    """The evaluated steps (every ``--eval-every`` and the last) and the evaluation settings of
    ``run_one`` from a benchmark's command line (``skip``: the test items the bootstrap used)."""
    ev = dict(eval_items=args.eval_items, eval_skip=skip, eval_samples=args.eval_samples,
              eval_temperature=args.eval_temperature)
    return sorted({*range(args.eval_every - 1, args.steps, args.eval_every), args.steps - 1}), ev


def check_signatures(records: Path, sig: str) -> None:
    """Refuse a records folder that holds runs of other settings: a run of these would overwrite
    theirs (one file per method and seed)."""
    other = {d["signature"] for p in sorted((records / "runs").glob("*.json"))
             if (d := json.loads(p.read_text())).get("signature") != sig}
    if other:
        raise SystemExit(f"{records}: records of other settings ({sorted(other)[:3]}); give another "
                         f"--records folder")


def save_run(workdir: Path, signature: str, r: RunResult) -> Path:
    """Record run ``r`` in ``<workdir>/runs/<method>-s<seed>.json``, on one line, floats to 6
    significant digits (records kept in git)."""
    path = workdir / "runs" / f"{r.method}-s{r.seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    # floats to 6 significant digits on the way through JSON (tuples become lists, as read back)
    rounded = json.loads(json.dumps(r.__dict__), parse_float=lambda x: float(f"{float(x):.6g}"))
    tmp.write_text(json.dumps({"signature": signature, "result": rounded}, separators=(",", ":")) + "\n")
    tmp.rename(path)
    return path


def load_run(workdir: Path, signature: str, method: str, seed: int) -> RunResult | None:
    """The recorded run of (method, seed) made with the same settings (``signature``), or None."""
    path = workdir / "runs" / f"{method}-s{seed}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return RunResult(**data["result"]) if data.get("signature") == signature else None


def read_records(workdir: Path) -> list[tuple[str, RunResult]]:
    """(signature, run) of every record under ``<workdir>/runs/``, in file-name order."""
    return [(d.get("signature"), RunResult(**d["result"]))
            for d in (json.loads(p.read_text()) for p in sorted((workdir / "runs").glob("*.json")))]


def recorded_runs(workdir: Path, signature: str | None = None) -> list[RunResult]:
    """Every run recorded under ``workdir`` with these settings (None: of the one setting the
    folder holds; records of several are an error), by seed then method name."""
    records = read_records(workdir)
    if signature is None and len(sigs := {s for s, _ in records}) > 1:
        raise ValueError(f"{workdir}: records of {len(sigs)} settings; keep one per folder")
    return sorted((r for s, r in records if signature in (None, s)), key=lambda r: (r.seed, r.method))


def signature(base: dict[str, Any], eval_steps: Sequence[int], ev: dict[str, Any], policy: str) -> str:
    """What makes two runs of one method and seed the same run: the train config but its
    ``NEVER_HASHED`` fields (where a run executes, what it keeps), the evaluation settings, the
    starting policy's record and ``$TRACE_TORCH_THREADS`` where not 1 (another count sums the
    update in another order; the records made at 1 keep their signatures)."""
    import hashlib

    from trace_rl.config import NEVER_HASHED
    from trace_rl.environ import torch_threads

    record = Path(policy) / "bootstrap.json"
    policy_id = json.loads(record.read_text()).get("input_hash", "") if record.exists() else policy
    base = {k: v for k, v in base.items() if k not in NEVER_HASHED}
    parts: dict[str, Any] = {"base": base, "eval_steps": list(eval_steps), "ev": ev,
                             "policy": policy_id}
    threads = torch_threads()
    if threads != 1:
        parts["torch_threads"] = threads
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
