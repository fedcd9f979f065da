"""The train flow's step grows the trees it grew when ``tests/data/step_reference.json`` was
recorded, on every machine: 2-step runs of TRACE, DAPO (refill waves) and TRACE's joint split
through the real ``flows.train.train`` flow, with the rollouts written by a script instead of
sampled (``ArithAgent`` in tests/scripted_engine.py, injected through the engine registry by
``scripted_rollouts``), whose stored trees, allocations and ledger must equal the reference's.

Regenerate the reference (after a change that is meant to change the trees) with

    .venv/bin/python tests/test_step_reference.py --regenerate

which runs these tests in a mode that writes the file, and records in it the git commit of the
code that made it (and which code files differed from that commit, if any).

Why one reference holds on every CPU and torch build, field by field:

* text, observation, reward, tree shape (tree_id, local_index, parent_index, depth, level,
  is_leaf, n_leaves), item_id: every turn is a pure function of the decoded context, the copy
  index and the request's seed (blake2b; the ReAct loop derives the seed from the run's seed and
  the request's place: start, copy, depth); the calculator and the verifier are Python
  arithmetic (IEEE-754, exactly rounded, the same everywhere); the items and candidate pools
  come from seeded Python and numpy generators. The policy update still runs on torch and changes
  the policy, but with a script the policy writes nothing, so no stored field depends on its
  weights. Token counts (the ledger) come from the tiny tokenizer, a byte-level BPE trained
  deterministically on a fixed corpus.
* allocated_k, the allocations table and the ledger's waves: the allocators' discrete choices,
  from the outcomes above and from the predictor's predictions, whose last bits may differ
  between CPUs (see predicted_v); a choice can only flip where two options' gains agree to
  within that rounding, and the solvers' exact ties (equal inputs) are broken by index.
* predicted_v: the hashed n-gram predictor (blake2b buckets of the texts) with a head
  initialised from torch's CPU generator (mt19937: a seed gives the same numbers on every CPU,
  and has across torch releases) and fitted by Adam in float32 on the step's texts and values,
  all fixed above. What may differ is rounding in the last bits (vector width, BLAS kernels),
  so it is compared to within ``PREDICTION_TOL`` (1e-4), not exactly; a 5% change of the
  predictor's learning rate moves a prediction by 5e-3 and fails the test.
* value, advantage: the leaves' success rate under a node and the advantage estimator's
  float64 numpy arithmetic on the 0/1 rewards and the tree shape: ratios of small counts,
  compared rounded to 6 decimals (a half-way point at the 7th decimal would need a
  denominator divisible by 2^7 or 5^7, and a tree holds at most a dozen leaves).

Checked on 2026-12-05 (AMD EPYC, torch 2.13.0+cpu): regenerated with torch's, MKL's and numpy's
AVX512 kernels replaced by scalar or SSE ones (``ATEN_CPU_CAPABILITY=default
MKL_ENABLE_INSTRUCTIONS=SSE4_2 OPENBLAS_CORETYPE=Nehalem NPY_DISABLE_CPU_FEATURES="AVX512F
AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR AVX2 FMA3 F16C AVX"``, under
which torch's float32 sums do change in the last bits), every compared field of the three
cases equals the AVX512 run's, predictions included, at 6 decimals.

``test_sampled_runs_repeat_on_this_machine`` keeps real sampling under test: the same config on
the tiny policy with the HF engine, run twice, stores the same trees. Sampling differs from CPU
to CPU, so that is compared run to run, never against a stored file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripted_engine import ArithAgent, mixed_skill, scripted_rollouts
from trace_rl.storage.store import TreeStore

REFERENCE_FILE = Path(__file__).parent / "data" / "step_reference.json"
REGENERATE = "TRACE_REGENERATE_STEP_REFERENCE"
"""Set (to anything) by ``--regenerate``: the golden test writes its case instead of comparing."""
COMMAND = ".venv/bin/python tests/test_step_reference.py --regenerate"
PREDICTION_TOL = 1e-4
"""How far a stored prediction may be from the reference's (float32 rounding across CPUs)."""

BASE = {"engine": "hf", "steps": 2, "root_budget": 4, "pool_size": 6, "max_turns": 4,
        "max_new_tokens": 48, "multiplier": 2, "family": "synth_arith", "difficulty": 2,
        "plot_every": 0, "eval_items": 0}
"""synth_arith at difficulty 2: episodes of 1 to 3 turns (two calculator calls, an answer); a
scripted turn is at most 31 tokens, so none is cut at ``max_new_tokens``."""
CASES = {"trace": {}, "dapo": {"allocator": "dapo", "group_size": 2},
         "joint": {"joint_split": True, "multiplier": 3}}
"""At ``multiplier`` 2 the joint split spends every leaf on continuations in both steps (the
trees of ``trace``); at 3 its second step also buys fresh prompts, a second level-0 wave."""
AGENT = ArithAgent(mixed_skill, seed=0)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.usefixtures("prefect_harness")]


def stored_trees(store: TreeStore, run_id: str) -> dict[str, list[dict]]:
    """What a run stored that a reference compares: nodes, allocation decisions, ledger rows
    (ids without the run id, which holds the policy directory's path)."""
    r = {"r": run_id}
    nodes = store.query(
        "SELECT step, level, tree_id, local_index, parent_index, depth, item_id, text, observation, "
        "reward, allocated_k, n_leaves, round(predicted_v, 6) AS predicted_v, round(value, 6) AS value, "
        "round(advantage, 6) AS advantage, is_leaf FROM nodes WHERE run_id = $r "
        "ORDER BY step, tree_id, local_index", r).to_pylist()
    allocations = store.query(
        "SELECT step, level, substr(node_id, length(run_id) + 2) AS node, allocator, item_id, k, "
        "round(predicted_v, 6) AS predicted_v FROM allocations WHERE run_id = $r "
        "ORDER BY step, level, node", r).to_pylist()
    ledger = store.query(
        "SELECT step, level, method, trajectories, prompt_tokens, generated_tokens, tool_calls "
        "FROM ledger WHERE run_id = $r ORDER BY step, level, method", r).to_pylist()
    return {"nodes": nodes, "allocations": allocations, "ledger": ledger}


def _same(mine: dict, theirs: dict) -> dict:
    """The fields in which two rows differ ({} if none): predictions to within PREDICTION_TOL."""
    def differs(key: str) -> bool:
        a, b = mine.get(key), theirs.get(key)
        if key == "predicted_v" and a is not None and b is not None:
            return abs(a - b) > PREDICTION_TOL
        return a != b
    return {k: (mine.get(k), theirs.get(k)) for k in {*mine, *theirs} if differs(k)}


def assert_same_trees(got: dict[str, list[dict]], want: dict[str, list[dict]], hint: str) -> None:
    for table in ("nodes", "allocations", "ledger"):
        mine, theirs = got[table], want[table]
        for i, (a, b) in enumerate(zip(mine, theirs)):
            diff = _same(a, b)
            assert not diff, f"{table} row {i} differs (mine, reference): {diff}; {hint}"
        assert len(mine) == len(theirs), f"{len(mine)} {table} rows, the reference {len(theirs)}; {hint}"


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          check=True).stdout.rstrip("\n")


def _record(case: str, trees: dict[str, list[dict]]) -> None:
    """Write ``case``'s trees into the reference file (beside the other cases' trees written by
    the same regeneration), with what made them."""
    import torch

    code = ["trace_core", "trace_rl", "tasks", "flows", "tests/scripted_engine.py",
            "tests/test_step_reference.py"]
    made = json.loads(REFERENCE_FILE.read_text())["trees"] if REFERENCE_FILE.exists() else {}
    reference = {
        "made_by": {"commit": _git("rev-parse", "HEAD").strip(),
                    "uncommitted": sorted(line[3:] for line in _git(
                        "status", "--porcelain", "--", *code).splitlines()),
                    "command": COMMAND, "date": time.strftime("%Y-%m-%d"),
                    "machine (informational)": f"torch {torch.__version__}, "
                                               f"{torch.backends.cpu.get_cpu_capability()}"},
        "base": BASE, "cases": CASES, "trees": dict(sorted({**made, case: trees}.items()))}
    REFERENCE_FILE.write_text(json.dumps(reference, indent=1, ensure_ascii=False) + "\n")


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_trees_as_the_reference(case, tiny_model_dir, tmp_path):
    from flows.train import train

    config = {**BASE, **CASES[case], "policy": str(tiny_model_dir)}
    with scripted_rollouts(AGENT) as engines:
        summary = train(config=config, workdir=str(tmp_path))
    # the script served every rollout: the flow built its engine through the registry
    assert any(e.requests for e in engines), "the flow did not use the scripted engine"
    got = stored_trees(TreeStore(tmp_path / "trace.duckdb", create=False), summary["run_id"])
    # trees worth comparing: multi-turn, mixed outcomes, continuations (DAPO's groups are flat)
    assert any(r["depth"] >= 2 for r in got["nodes"])
    assert {r["reward"] for r in got["nodes"] if r["is_leaf"]} == {0.0, 1.0}
    assert any(r["level"] == 1 for r in got["nodes"]) == (case != "dapo")
    waves = {r["method"].split(":")[-1] for r in got["ledger"]}  # refill waves, fresh prompts
    assert ("refill1" in waves) == (case != "trace")
    if os.environ.get(REGENERATE):
        _record(case, got)
        return
    reference = json.loads(REFERENCE_FILE.read_text())
    hint = f"the reference was made by {reference['made_by']['commit'][:10]}; regenerate: {COMMAND}"
    assert (reference["base"], reference["cases"]) == (BASE, CASES), \
        f"the reference was recorded for another config; {hint}"
    assert_same_trees(got, reference["trees"][case], hint)


def test_sampled_runs_repeat_on_this_machine(tiny_model_dir, tmp_path):
    """Real sampling (the tiny policy on the HF engine, a policy update between the steps): the
    same config run twice stores the same trees, to the last bit of every float."""
    from flows.train import train

    config = {**BASE, "difficulty": 1, "max_turns": 2, "max_new_tokens": 16, "multiplier": 1,
              "pool_size": 4, "policy": str(tiny_model_dir)}
    runs = []
    for name in ("first", "second"):
        summary = train(config=config, workdir=str(tmp_path / name))
        store = TreeStore(tmp_path / name / "trace.duckdb", create=False)
        runs.append(store.query(
            "SELECT * EXCLUDE (node_id, parent_id, root_id, created_at) FROM nodes "
            "WHERE run_id = $r ORDER BY step, tree_id, local_index",
            {"r": summary["run_id"]}).to_pylist())
    assert len(runs[0]) > 0
    assert runs[0] == runs[1]


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: {COMMAND}")
    REFERENCE_FILE.unlink(missing_ok=True)  # every case is written anew
    # pytest in a process of its own: tests/conftest.py must set Prefect's home before anything
    # imports Prefect, which this module's imports may already have done
    sys.exit(subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             f"{__file__}::test_same_trees_as_the_reference"],
                            env={**os.environ, REGENERATE: "1"}).returncode)
