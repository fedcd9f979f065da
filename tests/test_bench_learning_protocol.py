"""bench.learning's tokens protocol on hand-made records: the sizing rule, the order runs start in,
and the report's statistics (shared with the simulator, bench.learning_report)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import learning as protocol
from bench.learning_runs import RunResult, load_run, save_run
from bench.learning_report import final_accuracy, tokens_to_reach
from trace_core.allocators import Budget


def _run(method: str, seed: int, accuracy: list[float], tokens: float = 1000.0,
         leaves: float = 48.0) -> RunResult:
    """Two steps, evaluated after each; ``tokens`` generated per step, 40% of the prompts mixed."""
    steps = {"tokens": [tokens, tokens], "train_tokens": [2 * tokens, 2 * tokens],
             "bare_tokens": [400.0, 400.0], "bare": [16.0, 16.0], "active": [10.0, 10.0],
             "mixed": [4.0, 4.0]}
    return RunResult(method=method, seed=seed, eval_steps=[-1, 0, 1], accuracy=accuracy,
                     effective_ratio=[0.4, 0.4], leaves=[leaves, leaves],
                     generated_tokens=2 * tokens, tool_calls=0.0, wall_s=1.0,
                     extra={"steps": steps}, eval_tokens=[0.0, tokens, 2 * tokens])


def test_the_sizing_rule_matches_tokens_in_whole_groups():
    # 1500 tokens a step at 32 a leaf: 46.9 leaves, 11.7 groups of 4 -> 12 groups
    assert Budget.matched(1500, 32, 4) == Budget(48, 0)
    assert Budget.matched(1000, 30, 2).roots == 34  # 16.7 pairs -> 17
    assert Budget.matched(100, 60, 4).roots == 4  # never less than one group
    for bad in ((0, 30, 4), (100, 0, 4), (100, 30, 0)):
        with pytest.raises(ValueError, match="Budget.matched"):
            Budget.matched(*bad)
    # From a reference's record: its mean tokens per step over its tokens per bare rollout
    ref = _run("trace_cover", 0, [0.5, 0.6, 0.7])
    ref.extra["steps"].update(tokens=[1000.0, 1200.0], bare_tokens=[320.0, 400.0], bare=[10.0, 10.0])
    # 1100 a step, 36 a bare rollout: grpo 4 x round(7.64) = 32, prompt_only 2 x round(15.3) = 30
    assert protocol.matched_budget(ref, "grpo", 4) == {"root_budget": 32, "multiplier": 0}
    assert protocol.matched_budget(ref, "dapo", 4) == {"root_budget": 32, "multiplier": 0}
    assert protocol.matched_budget(ref, "prompt_only", 4) == {"root_budget": 30, "multiplier": 0}


def test_the_regime_gives_defaults_that_explicit_options_override():
    args = protocol.parse(protocol._parser(), ["--regime", "paper", "--eval-items", "50"])
    paper = protocol.REGIMES["paper"]
    assert args.protocol == "tokens" and args.mix == paper["mix"] and args.final_of == paper["final_of"]
    assert args.eval_items == 50
    plain = protocol.parse(protocol._parser(), [])
    assert plain.protocol == "leaves" and plain.mix == "" and plain.final_of == 1


def test_runs_start_references_first_then_matched_baselines_seed_by_seed():
    order = protocol.job_order([3, 4], {"main": ("trace", "grpo", "trace_cover"),
                                        "control": ("grpo", "trace_cover")})
    assert order == [("main", "trace_cover", 3), ("control", "trace_cover", 3), ("main", "grpo", 3),
                     ("control", "grpo", 3), ("main", "trace", 3),
                     ("main", "trace_cover", 4), ("control", "trace_cover", 4), ("main", "grpo", 4),
                     ("control", "grpo", 4), ("main", "trace", 4)]


def test_matched_baselines_start_after_their_seeds_reference(tmp_path, monkeypatch):
    started: list[tuple[str, str, int, dict]] = []

    def fake_job(st, method, seed, budget, policy, eval_steps, ev, job_dir):
        started.append((st.name, method, seed, budget))
        r = _run(method, seed, [0.5, 0.6, 0.7])
        r.extra["budget"] = budget
        return str(save_run(st.records, st.signature, r))

    monkeypatch.setattr(protocol, "_job", fake_job)
    st = protocol.Structure("main", {"group_size": 4}, "sig", 0.5, tmp_path / "wd",
                            tmp_path / "rec" / "main", ("trace_cover", "grpo", "trace"))
    jobs = [("main", "grpo", 0), ("main", "trace", 0), ("main", "trace_cover", 0),
            ("main", "grpo", 1)]
    protocol.run_jobs(jobs, {"main": st}, 1, "policy", [0, 1], {})
    order = [(m, s) for _, m, s, _ in started]
    # grpo of seed 0 waits for its reference; seed 1 has none, so its grpo never starts
    assert order == [("trace", 0), ("trace_cover", 0), ("grpo", 0)]
    # 1000 tokens a step at 25 a bare rollout: 40 leaves, 10 groups of 4
    assert started[-1][3] == {"root_budget": 40, "multiplier": 0}
    assert load_run(st.records, "sig", "grpo", 0).extra["budget"] == started[-1][3]
    assert load_run(st.records, "sig", "grpo", 1) is None


def _write(root, name, method, accs, tokens=1000.0):
    for seed, acc in enumerate(accs):
        save_run(root / name, "sig-" + name, _run(method, seed, acc, tokens))


def test_report_statistics_on_hand_made_records(tmp_path, capsys):
    rec = tmp_path / "rec"
    # final = mean of the last 2 evaluations; trace_cover - grpo per seed: +4, +6, +8 points
    _write(rec, "main", "trace_cover", [[0.5, 0.62, 0.70], [0.5, 0.64, 0.72], [0.5, 0.66, 0.74]])
    _write(rec, "main", "grpo", [[0.5, 0.60, 0.64], [0.5, 0.60, 0.64], [0.5, 0.60, 0.64]], 1100.0)
    _write(rec, "main", "dapo", [[0.5, 0.50, 0.50]] * 3, 900.0)
    _write(rec, "main", "prompt_only", [[0.5, 0.55, 0.55]] * 3)
    # control: the pair differs by -1, +1, 0 points
    _write(rec, "control", "trace_cover", [[0.5, 0.60, 0.60], [0.5, 0.60, 0.62], [0.5, 0.60, 0.61]])
    _write(rec, "control", "grpo", [[0.5, 0.61, 0.61], [0.5, 0.60, 0.60], [0.5, 0.61, 0.60]])
    _write(rec, "control", "dapo", [[0.5, 0.5, 0.5]] * 3)
    _write(rec, "control", "prompt_only", [[0.5, 0.5, 0.5]] * 3)
    out = protocol.protocol_report(rec, final_of=2)
    printed = capsys.readouterr().out
    gain, ctl = out["gain"], out["control"]
    assert out["best"] == "grpo"
    assert gain.mean == pytest.approx(6.0) and gain.n == 3
    half = 4.302653 * 2.0 / np.sqrt(3)  # Student-t (2 df) interval, sd of (4, 6, 8) = 2
    assert (gain.low, gain.high) == pytest.approx((6.0 - half, 6.0 + half))
    assert ctl.mean == pytest.approx(0.0, abs=1e-9) and ctl.low < 0 < ctl.high
    assert printed.strip().splitlines()[-1] == (
        f"TRACE-cover vs best baseline at equal tokens and steps: +6.0 points (95% CI "
        f"{gain.low:+.1f}, {gain.high:+.1f}) over 3 seeds; control +0.0 (95% CI {ctl.low:+.1f}, "
        f"{ctl.high:+.1f})")
    rows = {r["method"]: r for r in out["tables"]["main"]}
    assert rows["trace_cover"]["mixed"] == 4.0 and rows["trace_cover"]["ratio"] == pytest.approx(0.4)
    assert rows["grpo"]["tokens"] == 1100.0 and rows["grpo"]["train_tokens"] == 2200.0
    assert "grpo 1.10" in printed and "dapo 0.90" in printed  # tokens per step / the reference's
    # tokens to GRPO's final (62 points, the mean of 60 and 64): GRPO crosses it at 1100 + 1100 x
    # 2 / 4 = 1650 tokens; trace_cover at 1000 (seed 0), 1000 x 12 / 14 (seed 1), 1000 x 12 / 16
    # (seed 2): the median ratio is seed 1's
    assert rows["trace_cover"]["reach"][0] == pytest.approx(1000 * 12 / 14 / 1650)
    assert rows["dapo"]["reach"][3] == 3  # never reaches it


def test_an_evaluated_curve_reads_its_own_token_totals():
    log = {"acc0": 0.5, "accuracy": [0.6, 0.7, 0.8], "eval_tokens": [100.0, 300.0, 600.0],
           "tokens": [50.0] * 12, "final_of": 2}
    assert final_accuracy(log) == pytest.approx(75.0)
    assert tokens_to_reach(log, 65.0) == pytest.approx(200.0)
    assert tokens_to_reach(log, 50.0) == 0.0 and np.isnan(tokens_to_reach(log, 81.0))
    with pytest.raises(ValueError, match="accuracies"):
        tokens_to_reach({**log, "eval_tokens": [100.0]}, 65.0)


def test_a_folder_of_two_settings_is_refused(tmp_path):
    save_run(tmp_path / "main", "a", _run("grpo", 0, [0.5, 0.6, 0.7]))
    save_run(tmp_path / "main", "b", _run("grpo", 1, [0.5, 0.6, 0.7]))
    with pytest.raises(ValueError, match="2 settings"):
        protocol.load_structure(tmp_path / "main")
    st = protocol.Structure("main", {}, "a", 0.5, tmp_path, tmp_path / "main", ("grpo",))
    with pytest.raises(SystemExit, match="other settings"):
        protocol.check_signatures(st.records, st.signature)


def test_a_seed_is_complete_only_with_every_method_the_invocation_runs(tmp_path, capsys):
    rec = tmp_path / "rec"
    for name in ("main", "control"):
        for m in ("trace_cover", "grpo", "dapo", "prompt_only"):
            _write(rec, name, m, [[0.5, 0.6, 0.7]] * 2)
    args = {"family": "synth_arith", "mix": "1,2,2", "difficulty": 2, "control_difficulty": 1,
            "steps": 2, "root_budget": 16, "multiplier": 2, "eval_items": 3, "eval_samples": 2,
            "methods": "trace_cover,grpo,dapo,prompt_only,trace"}
    out = protocol.protocol_report(rec, 2, args)
    printed = capsys.readouterr().out
    assert "main: 0 complete seed(s) []" in printed and "trace 0" in printed
    assert "control: 2 complete seed(s) [0, 1]" in printed  # the control runs no trace row
    assert "no closing line" in printed and "main" not in out["finals"]


def test_the_oracle_row_runs_last_and_no_seed_waits_for_it():
    order = protocol.job_order([3, 4], {"main": ("trace_cover", protocol.ORACLE, "grpo")})
    assert order == [("main", "trace_cover", 3), ("main", "grpo", 3), ("main", "trace_cover", 4),
                     ("main", "grpo", 4), ("main", protocol.ORACLE, 3), ("main", protocol.ORACLE, 4)]


def test_the_oracle_row_is_reported_over_the_seeds_that_hold_it(tmp_path, capsys):
    """Three complete seeds, the Monte-Carlo oracle's row recorded for two: the closing line keeps
    all three; the oracle row is paired on its two, against the best baseline and the reference,
    with its oracle's tokens per step beside its own."""
    rec = tmp_path / "rec"
    _write(rec, "main", "trace_cover", [[0.5, 0.62, 0.70], [0.5, 0.64, 0.72], [0.5, 0.66, 0.74]])
    _write(rec, "main", "grpo", [[0.5, 0.60, 0.64]] * 3)
    _write(rec, "main", "dapo", [[0.5, 0.50, 0.50]] * 3)
    _write(rec, "main", "prompt_only", [[0.5, 0.55, 0.55]] * 3)
    _write(rec, "main", "trace", [[0.5, 0.55, 0.55]] * 3)
    for seed, acc in enumerate([[0.5, 0.70, 0.74], [0.5, 0.70, 0.78]]):  # finals 72, 74
        r = _run(protocol.ORACLE, seed, acc)
        r.extra["steps"]["oracle_tokens"] = [8000.0, 9000.0]
        save_run(rec / "main", "sig-main", r)
    for m in ("trace_cover", "grpo", "dapo", "prompt_only"):
        _write(rec, "control", m, [[0.5, 0.6, 0.7]] * 3)
    args = {"family": "synth_arith", "mix": "1,2,2", "difficulty": 2, "control_difficulty": 1,
            "steps": 2, "root_budget": 16, "multiplier": 2, "eval_items": 3, "eval_samples": 2,
            "methods": protocol.REGIMES["paper"]["methods"]}
    out = protocol.protocol_report(rec, 2, args)
    printed = capsys.readouterr().out
    assert "main: 3 complete seed(s) [0, 1, 2]" in printed and out["gain"].n == 3
    row = next(r for r in out["tables"]["main"] if r["method"] == protocol.ORACLE)
    # per seed: oracle 72, 74; grpo 62, 62; trace_cover 66, 68
    assert row["seeds"] == 2 and row["acc"] == pytest.approx(73.0)
    assert row["oracle_tokens"] == 8500.0 and row["tokens"] == 1000.0
    assert row["vs_grpo"][0] == pytest.approx(11.0)
    assert row["vs"]["grpo"].mean == pytest.approx(11.0) and row["vs"]["grpo"].n == 2
    assert row["vs"]["trace_cover"].mean == pytest.approx(6.0)
    assert f"{protocol.ORACLE} over its 2 seeds: vs grpo +11.0" in printed
    from bench.tables import learning_lm

    (tmp_path / "learning_lm").mkdir()
    rec.rename(tmp_path / "learning_lm" / "paper")
    lines = [ln for ln in learning_lm(tmp_path).splitlines() if protocol.ORACLE in ln]
    assert lines == [f"| main | {protocol.ORACLE} | 2 | 4.00 | 0.40 | 10.0 | 1000 / 2000 (+ 8500 "
                     "oracle) | 48.0 | 73.0 | +11.0 (-1.7, +23.7) |"]  # +10, +12: t(1 df) 12.71 x sd 1.41 / sqrt 2
