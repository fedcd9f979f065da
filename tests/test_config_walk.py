"""Following ``config`` through one training step stays a short read (tests/config_walk.py): the
read walk of step 1 of the step-reference test's scripted TRACE run re-enters files at most
``MAX_REENTRIES`` times, and the walk's counter counts what its docstring says."""

from __future__ import annotations

import pytest

from config_walk import _count, describe, walk_one_step

MAX_REENTRIES = 28
"""Half the 57 re-entries the walk was first reported with. Measured on 2026-12-05: 47 (read) and
401 (every call) before the phases were handed the sections they read, 27 and 279 after. On
2026-12-07, with the predictor's fit in a thread beside the update: 21-23 and 259-261 from run to
run while the two threads' calls were read interleaved; 22 and 255 in every run since each
thread's calls are read on their own."""


def test_the_counter_follows_calls_and_returns_between_files():
    a, b, c = (compile(f"{name} = 1", name, "exec") for name in "abc")  # three functions' code
    events = [("call", "x.py", a), ("call", "y.py", b), ("return", "", None),
              ("call", "y.py", b), ("call", "z.py", c), ("return", "", None),
              ("return", "", None), ("call", "y.py", c), ("return", "", None),
              ("return", "", None)]
    every = _count(events, once=False)
    # x > y > x > y > z > y > x > y > x: 3 files, 4 climbs, 6 re-entries
    assert (every["files"], every["climbs"], every["reentries"]) == (3, 4, 6)
    read = _count(events, once=True)  # the second call of b is not followed, nor c below it
    assert read["path"] == ["x.py", "y.py", "x.py", "y.py", "x.py"]
    assert (read["files"], read["climbs"], read["reentries"]) == (2, 2, 3)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("prefect_harness")
def test_one_step_reenters_files_at_most_half_as_often(tiny_model_dir, tmp_path):
    counts = walk_one_step(str(tmp_path / "run"), str(tiny_model_dir))
    read = counts["read"]
    assert read["calls"] > 10  # the step was followed
    assert read["reentries"] <= MAX_REENTRIES, (
        f"{read['reentries']} re-entries; the read walk:\n{describe(read['steps'])}")
