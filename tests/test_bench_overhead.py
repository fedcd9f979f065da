"""``bench.overhead``'s comparison of alternating runs (the runs themselves are the benchmark)."""

from __future__ import annotations

from bench.overhead import compare


def run(code: str, shares: list[float], overhead: list[float]) -> dict:
    steps = [{"step": i, "overhead_s": o} for i, o in enumerate(overhead)]
    return {"code": code, "overhead_share": sum(shares) / len(shares), "steps": steps,
            "share_over": list(range(1, len(overhead)))}


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


def test_compare_with_one_run_each_gives_no_interval():
    text = compare([run("abc", [0.2], [9.0, 1.0]), run("this checkout", [0.1], [9.0, 0.5])])
    assert "CI" not in text and len(text.splitlines()) == 2
