"""The train flow's step grows the same trees as before it was rewritten (trace_core.waves for the
refill waves, the joint split and the outcome counts; one allocator and one root pool per step):
2-step runs of TRACE, DAPO (refill waves) and TRACE's joint split on the tiny test policy, whose
stored nodes (text, rewards, allocations, predictions, values, advantages) must equal those
that main at f399c1a stored for the same configs (tests/data/step_reference.json).

Sampling on the CPU is deterministic for a given torch build; with another torch version the
reference does not apply, and the test says so rather than compare.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trace_rl.storage.store import TreeStore

REFERENCE = json.loads((Path(__file__).parent / "data" / "step_reference.json").read_text())
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


def stored_trees(store: TreeStore, run_id: str) -> list[dict]:
    return store.query(
        "SELECT step, level, tree_id, local_index, parent_index, depth, item_id, text, reward, "
        "allocated_k, round(predicted_v, 6) AS predicted_v, round(value, 6) AS value, "
        "round(advantage, 6) AS advantage, is_leaf FROM nodes WHERE run_id = $r "
        "ORDER BY step, tree_id, local_index", {"r": run_id}).to_pylist()


@pytest.mark.skipif(torch.__version__ != REFERENCE["torch"],
                    reason=f"reference trees sampled with torch {REFERENCE['torch']}")
@pytest.mark.parametrize("case", sorted(REFERENCE["cases"]))
def test_same_trees_as_before_the_rewrite(case, tiny_model_dir, tmp_path):
    from flows.train import train

    config = {**REFERENCE["base"], **REFERENCE["cases"][case], "policy": str(tiny_model_dir)}
    summary = train(config=config, workdir=str(tmp_path))
    got = stored_trees(TreeStore(tmp_path / "trace.duckdb", create=False), summary["run_id"])
    want = REFERENCE["trees"][case]
    assert len(got) == len(want)
    for mine, theirs in zip(got, want):
        assert mine == theirs, {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
