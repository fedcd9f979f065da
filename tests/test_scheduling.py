"""tests/scheduling.py: the order and units xdist's workers get, driven as xdist's controller
drives a scheduler (collections in, tests reported complete), with simulated test durations."""

from __future__ import annotations

import heapq
from types import SimpleNamespace

from scheduling import EXPECTED_S, LongestFirst

SHARED = "tests/test_ui.py"  # has module-scoped fixtures
SECOND = "tests/test_failures.py::test_sigkill_at_ten_random_points_then_resume_matches_uninterrupted_run"
THIRD = "tests/test_first_run.py::test_first_trace_train_on_a_fresh_prefect_home_beside_cpu_load"
BOOT = "tests/test_exit.py::test_trace_bootstrap_exits"  # joins test_ui's unit


class _Node:
    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _run(collection: list[str], seconds: dict[str, float]) -> dict[str, list[str]]:
    """Simulate two workers: each runs the tests it was sent in order; return what each ran."""
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"],
                             option=SimpleNamespace(loadscopereorder=True))
    sched = LongestFirst(config)
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, collection)
    sched.schedule()
    ran: dict[str, list[str]] = {n.gateway.id: [] for n in nodes}
    clock: list[tuple[float, int, _Node]] = [(0.0, i, n) for i, n in enumerate(nodes)]
    while clock:
        now, i, node = heapq.heappop(clock)
        if len(ran[node.gateway.id]) == len(node.sent):
            continue  # nothing left for it: the scheduler shut it down
        nodeid = collection[node.sent[len(ran[node.gateway.id])]]
        ran[node.gateway.id].append(nodeid)
        sched.mark_test_complete(node, collection.index(nodeid))
        heapq.heappush(clock, (now + seconds.get(nodeid, 1.0), i, node))
    assert sched.tests_finished
    return ran


def test_longest_first_keeps_a_shared_fixture_module_on_one_worker_and_balances():
    ui = [f"{SHARED}::test_no_task_run_records_a_subflow_result_as_input",
          *(f"{SHARED}::test_{k}" for k in range(4))]
    fast = [f"tests/test_tree.py::test_{k}" for k in range(40)]
    collection = [*fast[:20], BOOT, THIRD, *ui, *fast[20:], SECOND]
    seconds = {BOOT: 400.0, THIRD: 200.0, SECOND: 300.0, ui[0]: 100.0}
    ran = _run(collection, seconds)
    assert sorted(t for tests in ran.values() for t in tests) == sorted(collection)
    firsts = {tests[0] for tests in ran.values()}
    assert firsts == {BOOT, SECOND}  # the two longest units start at once, on both workers
    holder = [w for w, tests in ran.items() if ui[0] in tests]
    assert len(holder) == 1 and ran[holder[0]][:6] == [BOOT, *ui]  # one unit, on one worker
    other = next(w for w in ran if w != holder[0])
    assert ran[other][1] == THIRD  # the next longest goes to the worker free first
    ends = [sum(seconds.get(t, 1.0) for t in tests) for tests in ran.values()]
    assert abs(ends[0] - ends[1]) <= 2.0, ends  # the fast tests fill in: both end together


def test_the_expected_times_name_tests_that_exist():
    """A renamed test would silently lose its place at the front."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for nodeid in EXPECTED_S:
        path, name = nodeid.split("::", 1)
        assert f"def {name.split('[')[0]}(" in (root / path).read_text(), nodeid
