"""The train flow's step grows the same trees as before it was rewritten (trace_core.waves for the
refill waves, the joint split and the outcome counts; one allocator and one root pool per step):
2-step runs of TRACE, DAPO (refill waves) and TRACE's joint split on the tiny test policy, whose
stored nodes (text, rewards, allocations, predictions, values, advantages) must equal those
that main at f399c1a stored for the same configs (tests/data/step_reference.json).

Sampling on the CPU is deterministic for a given torch build and CPU; with another torch version
the reference does not apply, and the test says so rather than compare. Another CPU samples other
trees from the same code (measured: f399c1a itself grows 29 nodes for DAPO on an AMD EPYC where
the reference has 32; on an AVX2-only AMD EPYC 30), so the reference holds f399c1a's trees per
CPU (``trees_by_cpu``, ``cpu_key()``), and ``trees`` (the machine it was first computed on) for any
other. To add a CPU: ``git worktree add <dir> f399c1a``, copy this reference into its tests/data,
run the three configs there through its own ``tiny_model_dir`` fixture and ``train`` flow (with
``PYTHONPATH=<dir>`` so its modules, not this checkout's, are imported), and store the
``stored_trees`` query's rows under ``trees_by_cpu[cpu_key()]``.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

from trace_rl.storage.store import TreeStore

REFERENCE = json.loads((Path(__file__).parent / "data" / "step_reference.json").read_text())
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]


def cpu_key() -> str:
    """This machine's architecture, CPU model name and the kernels torch picks for it."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                  .splitlines() if line.startswith("model name")), "") \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    return f"{platform.machine()} {model} {torch.backends.cpu.get_cpu_capability()}"


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
    known = REFERENCE.get("trees_by_cpu", {})
    want = known.get(cpu_key(), REFERENCE["trees"])[case]
    assert len(got) == len(want), (
        f"{len(got)} nodes, the reference {len(want)}" + ("" if cpu_key() in known else
        f"; no f399c1a trees for this CPU ({cpu_key()!r}): compared with the first machine's, "
        "and another CPU samples other trees; add this CPU's (module docstring)"))
    for mine, theirs in zip(got, want):
        assert mine == theirs, {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
