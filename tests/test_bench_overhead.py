"""``bench.overhead``'s comparison of alternating runs and its reading of the optimiser's
throughput from a run's DuckDB file (the runs themselves are the benchmark)."""

from __future__ import annotations

import math

import pytest
from test_store import LEDGER, LEVEL0, LEVEL1, table

from bench.overhead import compare, optimiser_throughput, with_throughput
from trace_rl.storage import TreeStore


def run(code: str, shares: list[float], overhead: list[float], rate: float = 100.0) -> dict:
    steps = [{"step": i, "overhead_s": o} for i, o in enumerate(overhead)]
    return {"code": code, "overhead_share": sum(shares) / len(shares), "steps": steps,
            "share_over": list(range(1, len(overhead))), "optimiser_tokens_per_s": rate}


def test_compare_pairs_the_runs_by_repeat_and_gives_the_difference_with_its_interval():
    ref = [run("abc (abc)", [0.20], [9.0, 1.0, 1.2]), run("abc (abc)", [0.16], [9.0, 0.8, 0.9]),
           run("abc (abc)", [0.18], [9.0, 1.0, 1.1])]
    now = [run("this checkout", [0.15], [9.0, 0.7, 0.8]), run("this checkout", [0.13], [9.0, 0.6, 0.6]),
           run("this checkout", [0.14], [9.0, 0.7, 0.7])]
    text = compare([ref[0], now[0], now[1], ref[1], ref[2], now[2]])  # the order A B B A A B
    lines = text.splitlines()
    assert lines[0].strip().startswith("abc (abc): overhead share 18.0% over 3 runs (20.0, 16.0, 18.0)")
    assert "1.00 s a step (median over 6 steps)" in lines[0]  # step 0 (the engine's start) left out
    assert "14.0% over 3 runs" in lines[1] and "0.70 s a step" in lines[1]
    # pairs by repeat: -5, -3, -4 points; mean -4.0, t(2) interval -4 +- 4.30 * 1/sqrt(3)
    assert lines[2].strip().startswith("this checkout - ref: -4.0 points (95% CI -6.5, -1.5) over 3 pairs")
    assert lines[3].strip().startswith("optimiser trained tokens/s, this checkout / ref: 1.00x")


def test_compare_gives_the_optimiser_speed_up_as_a_geometric_mean_with_its_interval():
    ref = [run("abc", [0.2], [9.0, 1.0], 100.0), run("abc", [0.2], [9.0, 1.0], 200.0)]
    now = [run("this checkout", [0.1], [9.0, 0.5], 200.0), run("this checkout", [0.1], [9.0, 0.5], 800.0)]
    lines = compare([ref[0], now[0], now[1], ref[1]]).splitlines()
    assert "optimiser 150 trained tokens/s (100, 200)" in lines[0]
    assert "optimiser 500 trained tokens/s (200, 800)" in lines[1]
    # ratios 2x and 4x: geometric mean sqrt(8) = 2.83x; log-scale t(1) interval
    assert lines[3].strip().startswith("optimiser trained tokens/s, this checkout / ref: 2.83x (95% CI ")


def test_compare_with_one_run_each_gives_no_interval():
    text = compare([run("abc", [0.2], [9.0, 1.0]), run("this checkout", [0.1], [9.0, 0.5], 300.0)])
    assert "CI" not in text and len(text.splitlines()) == 3
    assert text.splitlines()[2].strip() == ("optimiser trained tokens/s, this checkout / ref: 3.00x over "
                                            "1 pairs (geometric mean)")


@pytest.fixture
def workdir(tmp_path):
    """test_store's hand-worked step in a real store. Tree 0 (mixed) has five paths: four of
    prompt 3 + turn 3 + leaf 2 = 8 tokens and one of 3 + 3 + 3 + 2 = 11, 43 in all; tree 1 (both
    leaves succeed) trains nothing. The update: 4 optimiser steps, 2 mini-batches a pass, 2 s."""
    s = TreeStore(tmp_path)
    s.init_run("run1", {"mini_batches": 2})
    s.write_level("run1", 0, 0, table(LEVEL0), None, LEDGER)
    s.write_level("run1", 0, 1, table(LEVEL1), None, LEDGER)
    s.mark_step("run1", 0, "running")
    s.mark_step("run1", 0, "complete", {"loss/updates": 4.0, "loss/seconds": 2.0})
    s.mark_step("run1", 1, "running")
    s.mark_step("run1", 1, "complete", {"loss/paths_with_signal": 0.0})  # no update: left out
    return tmp_path


def test_the_optimiser_s_trained_tokens_are_the_mixed_trees_paths_times_their_passes(workdir):
    got = optimiser_throughput(workdir)
    assert got == {0: {"trained_tokens": 43 * 4 / 2, "optimiser_s": 2.0, "tokens_per_s": 43.0}}
    result = with_throughput({"steps": [{"step": 0}, {"step": 1}], "share_over": [0, 1]}, workdir)
    assert result["optimiser_tokens_per_s"] == 43.0 and result["steps"][0]["tokens_per_s"] == 43.0
    none = with_throughput({"steps": [{"step": 1}], "share_over": [1]}, workdir)
    assert math.isnan(none["optimiser_tokens_per_s"])
