"""bench.peers: TRL's GRPOTrainer against this project's GRPO and default allocator."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from bench.learning_runs import RunResult

CLOSING = re.compile(r"vs TRL GRPOTrainer: wall per step (\d+\.\d\d)x, tokens/s (\d+\.\d\d)x, "
                     r"GRPO parity ([+-]\d+\.\d|[+-]?nan) points \(95% CI ([+-]\d+\.\d|[+-]?nan), "
                     r"([+-]\d+\.\d|[+-]?nan)\)")


def _run(method: str, seed: int, acc: list[float], tokens: list[float]) -> RunResult:
    return RunResult(method=method, seed=seed, eval_steps=[-1, 1, 3], accuracy=acc,
                     effective_ratio=[], leaves=[8.0] * 4, generated_tokens=tokens[-1],
                     tool_calls=0.0, wall_s=10.0, eval_tokens=tokens,
                     extra={"eval_wall_s": [0.0, 5.0, 10.0], "step_s": [2.5] * 4})


def test_parity_is_paired_at_equal_tokens():
    """Ours minus TRL per seed, read off each curve at the smallest total any of the two spent,
    with a t interval over the seeds (hand-worked: differences 10, 20, 30 points)."""
    from bench.peers import parity

    runs = []
    for seed, d in enumerate((0.1, 0.2, 0.3)):
        runs.append(_run("trl_grpo", seed, [0.2, 0.3, 0.4], [0.0, 100.0, 200.0]))
        # ours spends more tokens: compared at 200, where its curve is at 0.4 + d
        runs.append(_run("grpo", seed, [0.2, 0.4 + d, 0.9], [0.0, 200.0, 400.0]))
    p = parity(runs)
    assert p["budget_tokens"] == 200.0
    assert p["diffs"] == pytest.approx([10.0, 20.0, 30.0])
    half = 4.302652729911275 * 10.0 / 3 ** 0.5  # t(0.975, 2) x sd / sqrt(n)
    assert (p["gain"].mean, p["gain"].low, p["gain"].high) == pytest.approx((20.0, 20.0 - half, 20.0 + half))


def test_tokens_to_trl_final_is_a_ratio_with_an_interval(capsys):
    """The default allocator's tokens to TRL-GRPO's final accuracy over TRL's own first crossing,
    per seed (hand-worked: 150/200, 66.7/200, never), as a median with a bootstrap interval."""
    from bench.peers import report

    runs = []
    for seed, acc in enumerate(([0.2, 0.3, 0.5], [0.2, 0.5, 0.6], [0.2, 0.25, 0.3])):
        runs.append(_run("trl_grpo", seed, [0.2, 0.3, 0.4], [0.0, 100.0, 200.0]))
        runs.append(_run("grpo", seed, [0.2, 0.3, 0.4], [0.0, 100.0, 200.0]))
        runs.append(_run("trace", seed, acc, [0.0, 100.0, 200.0]))
    out = report(runs, steps=4, start=0.2)
    # the target is 0.4: s0 crosses it halfway from 100 to 200 tokens, s1 two thirds of the way
    # to 100 (0.2 -> 0.5), s2 never
    assert out["tokens_to_trl_final_trace"] == pytest.approx([150.0, 200.0 / 3, float("nan")],
                                                             nan_ok=True)
    r = out["reach_ratio_trace"]
    assert (r["median"], r["never"]) == (pytest.approx(0.75), 1)
    assert r["hi"] == float("inf")
    assert "tokens to trl_grpo's final / trl_grpo's: median 0.75x" in capsys.readouterr().out


def test_missing_trl_names_the_install_command(monkeypatch, capsys):
    from bench import peers

    monkeypatch.setitem(sys.modules, "trl", None)  # an import of trl now raises ImportError
    with pytest.raises(SystemExit) as exc:
        peers.main(["--quick"])
    assert "pip install -e .[peers] -c requirements/cpu-constraints.txt" in str(exc.value)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="TRL is not installed (the optional extra: pip install -e .[peers] "
                           "-c requirements/cpu-constraints.txt)")
def test_quick_peers_benchmark(tmp_path, capsys, monkeypatch):
    """The quick preset runs TRL's GRPOTrainer (multi-turn through rollout_func), this project's
    GRPO and its default allocator from one policy, and prints the closing line."""
    import trace_rl.engines as engines
    import trace_rl.integrations.trl as trl_integration
    from bench.peers import METHODS, main

    # TRL trains with none of this project's engines left open (the start's evaluation opened one)
    open_then, build = [], trl_integration.grpo_trainer
    monkeypatch.setattr(trl_integration, "grpo_trainer",
                        lambda *a, **k: open_then.append(len(engines._LIVE)) or build(*a, **k))
    results = tmp_path / "res"
    argv = ["--quick", "--workdir", str(tmp_path / "wd"), "--records", str(results), "--set", "temperature=1.0"]
    out = main(argv)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = CLOSING.fullmatch(last)
    assert m, last
    assert float(m.group(1)) == pytest.approx(out["wall_ratio"], abs=0.006)
    assert float(m.group(2)) == pytest.approx(out["rate_ratio"], abs=0.006)
    table = out["summary"]["methods"]
    assert set(table) == set(METHODS)
    for method in METHODS:
        record = json.loads((results / "runs" / f"{method}-s0.json").read_text())["result"]
        assert len(record["accuracy"]) == len(record["eval_steps"]) == len(record["eval_tokens"])
        assert record["generated_tokens"] > 0 and record["wall_s"] > 0
        assert record["eval_tokens"][-1] == pytest.approx(record["generated_tokens"])
        # same rollouts per step for every method (quick: 8 roots x (1 + 1))
        assert set(record["leaves"]) == {16.0}
    trl = json.loads((results / "runs" / "trl_grpo-s0.json").read_text())["result"]["extra"]
    # the family's grader as TRL's reward function agrees with the ReAct loop's own reward
    assert trl["reward_mismatches"] == 0
    assert open_then == [0]
    # each record carries the command's settings, --set included, and the policy it resolved to:
    # what it takes to run the same settings again elsewhere (the signature hashes that path)
    settings = trl["settings"]
    assert settings["set"] == ["temperature=1.0"] and settings["workdir"] == str(tmp_path / "wd")
    assert Path(settings["policy_path"]).is_dir() and Path(settings["policy_path"]).is_absolute()
    # a second invocation reuses every record: nothing is run again
    again = main(argv)
    assert again["summary"]["methods"]["trl_grpo"]["wall_per_step"] == \
        table["trl_grpo"]["wall_per_step"]
