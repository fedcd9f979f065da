"""The learning benchmark's paired comparison, on hand-built per-seed results."""

from __future__ import annotations

import math

import pytest

from bench.learning import RunResult, paired, print_paired


def _run(method: str, seed: int, accuracy: list[float]) -> RunResult:
    return RunResult(method=method, seed=seed, eval_steps=[-1, 4, 9], accuracy=accuracy,
                     effective_ratio=[0.5], leaves=[48.0], generated_tokens=0.0, tool_calls=0.0,
                     wall_s=0.0)


def test_paired_differences_by_hand(capsys):
    results = [
        _run("trace", 0, [0.5, 0.7, 0.80]), _run("trace", 1, [0.5, 0.6, 0.70]),
        _run("trace", 2, [0.5, 0.8, 0.90]),
        _run("grpo", 0, [0.5, 0.7, 0.75]), _run("grpo", 1, [0.5, 0.6, 0.72]),
        _run("grpo", 2, [0.5, 0.8, 0.80]),
        _run("dapo", 1, [0.5, 0.5, 0.50]), _run("dapo", 7, [0.5, 0.9, 0.90]),  # one seed shared
        _run("oracle", 9, [0.5, 0.9, 0.90]),  # no seed shared: left out
    ]
    out = paired(results)
    assert set(out) == {"grpo", "dapo"}
    # final: differences 0.05, -0.02, 0.10 -> mean 0.0433, sample std 0.0603, s.e. 0.0348
    assert out["grpo"]["seeds"] == [0, 1, 2]
    assert out["grpo"]["final"][0] == pytest.approx(0.13 / 3)
    assert out["grpo"]["final"][1] == pytest.approx(0.060277 / math.sqrt(3), rel=1e-4)
    # AUC on budget steps 0, 5, 10 (eval steps -1, 4, 9): trace seed 0 = (5 * 0.6 + 5 * 0.75) / 10
    # = 0.675, grpo seed 0 = (5 * 0.6 + 5 * 0.725) / 10 = 0.6625; seeds 1 and 2 likewise
    assert out["grpo"]["auc"][0] == pytest.approx((0.0125 - 0.005 + 0.025) / 3)
    assert out["dapo"]["seeds"] == [1]
    assert out["dapo"]["final"][0] == pytest.approx(0.2) and math.isnan(out["dapo"]["final"][1])
    print_paired(out)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("trace - grpo") and "final  +4.3 ± 3.5" in lines[0]
    assert "seeds 0,1,2" in lines[0]


def test_paired_without_the_method_is_empty():
    assert paired([_run("grpo", 0, [0.5, 0.6, 0.7])]) == {}
