"""The learning benchmark's paired comparison, on hand-built per-seed results."""

from __future__ import annotations

import math

import pytest

from bench.learning_report import paired_tests
from bench.learning_runs import RunResult
from trace_core.stats import detectable_effect


def _run(method: str, seed: int, accuracy: list[float]) -> RunResult:
    return RunResult(method=method, seed=seed, eval_steps=[-1, 4, 9], accuracy=accuracy,
                     effective_ratio=[0.5], leaves=[48.0], generated_tokens=0.0, tool_calls=0.0,
                     wall_s=0.0)


def test_paired_differences_by_hand():
    results = [
        _run("trace", 0, [0.5, 0.7, 0.80]), _run("trace", 1, [0.5, 0.6, 0.70]),
        _run("trace", 2, [0.5, 0.8, 0.90]),
        _run("grpo", 0, [0.5, 0.7, 0.75]), _run("grpo", 1, [0.5, 0.6, 0.72]),
        _run("grpo", 2, [0.5, 0.8, 0.80]),
        _run("dapo", 1, [0.5, 0.5, 0.50]), _run("dapo", 7, [0.5, 0.9, 0.90]),  # one seed shared
        _run("oracle", 9, [0.5, 0.9, 0.90]),  # no seed shared: no difference
    ]
    out = paired_tests(results, key="final")
    # final, in points: differences 5, -2, 10 -> mean 4.33, sample sd 6.03, s.e. 3.48,
    # t(2) at 97.5% = 4.3027
    g = out["grpo"]["gain"]
    assert out["grpo"]["seeds"] == [0, 1, 2] and out["grpo"]["diffs"] == pytest.approx([5, -2, 10])
    assert g.mean == pytest.approx(13 / 3) and g.n == 3
    half = 4.302653 * 6.0277 / math.sqrt(3)
    assert (g.low, g.high) == pytest.approx((13 / 3 - half, 13 / 3 + half), rel=1e-4)
    assert out["grpo"]["detectable"] == pytest.approx(detectable_effect(6.0277, 3), rel=1e-4)
    assert out["dapo"]["seeds"] == [1] and out["dapo"]["gain"].mean == pytest.approx(20.0)
    assert math.isnan(out["dapo"]["gain"].low) and math.isnan(out["dapo"]["detectable"])
    assert out["oracle"]["gain"].n == 0 and math.isnan(out["oracle"]["gain"].mean)


def test_paired_without_the_method_has_no_seeds():
    assert paired_tests([_run("grpo", 0, [0.5, 0.6, 0.7]), _run("dapo", 0, [0.5, 0.6, 0.7])],
                        key="final")["dapo"]["gain"].n == 0


def _tok(method: str, seed: int, accuracy: list[float], tokens: list[float]) -> RunResult:
    r = _run(method, seed, accuracy)
    r.eval_tokens = tokens
    return r


def test_accuracy_at_equal_tokens_by_hand():
    from bench.learning_report import accuracy_at, token_budget

    tree = _tok("trace", 0, [0.5, 0.7, 0.8], [0.0, 100.0, 300.0])
    flat = _tok("grpo", 0, [0.5, 0.6, 0.9], [0.0, 200.0, 400.0])
    assert token_budget([tree, flat]) == 300.0  # the smallest total any run spent
    assert accuracy_at(tree, 200.0) == pytest.approx(0.75)  # halfway from 100 to 300
    assert accuracy_at(tree, 300.0) == pytest.approx(0.8)
    assert accuracy_at(flat, 300.0) == pytest.approx(0.75)  # halfway from 200 to 400
    assert math.isnan(accuracy_at(tree, 301.0))  # never extrapolated
    assert math.isnan(accuracy_at(_run("grpo", 1, [0.5, 0.6, 0.7]), 10.0))  # not recorded
    with pytest.raises(ValueError, match="trace seed 0: eval_tokens"):
        accuracy_at(_tok("trace", 0, [0.5, 0.7, 0.8], [0.0, 300.0, 100.0]), 50.0)
    assert paired_tests([tree, flat])["grpo"]["gain"].mean == pytest.approx(5.0)
    assert math.isnan(token_budget([_run("grpo", 0, [0.5, 0.6, 0.7])]))


def test_tokens_at_evaluations_by_hand():
    from bench.learning_runs import tokens_at_evals

    metrics = [{"ledger/generated_tokens": t} for t in (10, 20, 30, 40)]
    assert tokens_at_evals(metrics, [1, 3]) == [0.0, 30.0, 100.0]
    with pytest.raises(ValueError, match="4 steps stored, evaluations at steps"):
        tokens_at_evals(metrics, [1, 4])


def test_seeds_accumulate_and_pair_by_seed(tmp_path):
    from bench.learning_runs import load_run, parse_seeds, save_run

    assert parse_seeds("3") == [0, 1, 2]
    assert parse_seeds("3-5") == [3, 4, 5]
    for bad in ("x", "5-3", "0"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)
    r = _run("trace", 3, [0.5, 0.6, 0.7])
    save_run(tmp_path, "sig-a", r)
    assert load_run(tmp_path, "sig-a", "trace", 3) == r
    assert load_run(tmp_path, "sig-b", "trace", 3) is None  # other settings: not the same run
    assert load_run(tmp_path, "sig-a", "trace", 4) is None
    results = [_run("trace", s, [0.5, 0.6, a]) for s, a in enumerate([0.80, 0.70, 0.90])]
    results += [_run("grpo", s, [0.5, 0.6, a]) for s, a in enumerate([0.75, 0.72, 0.80])]
    results += [_run("dapo", s, [0.5, 0.6, a]) for s, a in enumerate([0.50, 0.45, 0.60])]
    tests = paired_tests(results, key="final")
    # grpo: d = 0.05, -0.02, 0.10; mean 0.0433, s.e. 0.0348, t(2) 97.5% = 4.303
    g, d = tests["grpo"]["gain"], tests["dapo"]
    assert g.mean == pytest.approx(13 / 3) and g.n == 3
    assert g.high - g.mean == pytest.approx(4.302653 * 6.0277 / math.sqrt(3), rel=1e-4)
    # dapo: d = 30, 25, 30 points (sd 2.8868); a variant of TRACE pairs as any method does
    assert d["gain"].mean == pytest.approx(85 / 3)
    assert d["detectable"] == pytest.approx(detectable_effect(2.8868, 3), rel=1e-4)
    oracle = [_run("trace_oracle", s, [0.5, 0.6, a]) for s, a in enumerate([0.9, 0.8, 0.95])]
    assert paired_tests(results + oracle, key="final")["trace_oracle"]["gain"].mean == pytest.approx(-25 / 3)


def test_report_names_the_best_baseline_not_a_variant(capsys):
    from bench.learning import report
    from bench.learning_runs import PREDICTOR_KEYS, UPDATE_KEYS, curves

    per_step = curves([{"loss/ratio_max": 7.5, "rollout/reward_mean": 0.25}, {}], UPDATE_KEYS)
    assert set(per_step) == set(UPDATE_KEYS) and per_step["loss/ratio_max"][0] == 7.5
    assert math.isnan(per_step["time/step_s"][1])  # a step that logged no seconds
    assert per_step["rollout/reward_mean"][0] == 0.25 and math.isnan(per_step["loss/pg_loss"][1])
    pred = curves([{"predictor/root_auc": 0.5}, {}, {"predictor/root_auc": 0.7,
                                                     "predictor/flip_predicted": 0.1},
                   {"predictor/root_auc": 0.9, "predictor/prefix_auc": 0.6,
                    "predictor/flip_predicted": 0.3, "predictor/flip_realised": 0.4}],
                  PREDICTOR_KEYS, "predictor/")
    assert pred["root_auc"][::2] == [0.5, 0.7] and math.isnan(pred["root_auc"][1])
    assert math.isnan(pred["prefix_auc"][0]) and pred["prefix_auc"][3] == 0.6
    tokens = [0.0, 100.0, 200.0]
    results = []
    for s, (t, g, p, o) in enumerate([(0.80, 0.75, 0.70, 0.95), (0.70, 0.72, 0.60, 0.90),
                                      (0.90, 0.80, 0.75, 0.99)]):
        results.append(_tok("trace", s, [0.5, 0.6, t], tokens))
        results[-1].extra = pred
        results += [_tok("grpo", s, [0.5, 0.6, g], tokens), _tok("prompt_only", s, [0.5, 0.6, p], tokens),
                    _tok("trace_oracle", s, [0.5, 0.6, o], tokens)]
    out = report(results, 0.5)
    lines = capsys.readouterr().out.splitlines()
    grpo_row = next(line.split() for line in lines if line.startswith("grpo "))
    assert grpo_row[1] == "75.7" and grpo_row[4] == "75.7"  # final and at 200 tokens
    assert out["table"]["trace"]["at_tokens"][0] == pytest.approx(0.8)
    # The oracle run is a ceiling, not a baseline: GRPO is the best baseline here.
    assert lines[-1] == "TRACE vs best baseline: +4.3 points held-out accuracy; effective ratio 1.00x GRPO"
    # trace - grpo at 200 tokens: 0.05, -0.02, 0.10, t(2) interval; paired sd 6.0 points, so 3
    # seeds see 19.7 points at 80% power (noncentral t)
    assert ("trace - grpo           at equal generated tokens:  +4.3 points (95% CI -10.6, +19.3) "
            "over 3 seeds; detectable at 80% power: 19.7") in lines


def test_every_variant_is_a_valid_train_config():
    """bench.learning's TRACE variants are TrainConfig overrides: each builds a config that differs
    from its plain allocator's (trace, trace_cover) in exactly its own fields."""
    from bench.learning_runs import VARIANTS
    from trace_rl.config import config_from_mapping

    for name, overrides in VARIANTS.items():
        plain = config_from_mapping({"allocator": overrides["allocator"]}, "test").model_dump()
        cfg = config_from_mapping(dict(overrides), f"variant {name}").model_dump()
        changed = {k for k in cfg if cfg[k] != plain[k]}
        assert changed == {k for k in overrides if k != "allocator"}, name


def test_trainer_threads_other_than_one_make_another_run(monkeypatch, tmp_path):
    """Runs whose updates sum in another order (another thread count) never pair with records
    made at the default one thread, whose signatures stay as they were."""
    from bench.learning_runs import signature

    args = ({"family": "hotpotqa", "steps": 20}, [0, 10, 20], {"items": 100}, str(tmp_path))
    monkeypatch.delenv("TRACE_TORCH_THREADS", raising=False)
    default = signature(*args)
    monkeypatch.setenv("TRACE_TORCH_THREADS", "1")
    assert signature(*args) == default
    monkeypatch.setenv("TRACE_TORCH_THREADS", "2")
    assert signature(*args) != default


@pytest.mark.parametrize("raw", ["two", "0", "-1", ""])
def test_a_bad_thread_count_is_named(monkeypatch, tmp_path, raw):
    """A thread count that is not a positive integer stops the run with the variable's name,
    before any run is signed or any trainer starts."""
    from bench.learning_runs import signature

    monkeypatch.setenv("TRACE_TORCH_THREADS", raw)
    with pytest.raises(ValueError, match="TRACE_TORCH_THREADS"):
        signature({"family": "hotpotqa"}, [0], {}, str(tmp_path))


def test_report_sets_trace_cover_against_the_baselines_over_the_seeds_both_ran(capsys):
    """Both TRACE allocators get their lines; the headline's difference is paired over the seeds
    both ran (trace_cover has 2 of GRPO's 3 here: +5 and -1 points, +2.0; the unpaired means'
    difference would be 0.78 - 0.7567 = +2.3)."""
    from bench.learning import report

    tokens = [0.0, 100.0, 200.0]
    results = []
    for s, (t, g, c) in enumerate([(0.80, 0.75, 0.80), (0.70, 0.72, 0.71), (0.90, 0.80, None)]):
        results += [_tok("trace", s, [0.5, 0.6, t], tokens), _tok("grpo", s, [0.5, 0.6, g], tokens)]
        if c is not None:
            results.append(_tok("trace_cover", s, [0.5, 0.6, c], tokens))
    out = report(results, 0.5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "trace_cover vs best baseline: +2.0 points held-out accuracy; effective ratio 1.00x GRPO"
    assert "TRACE vs best baseline: +4.3 points held-out accuracy; effective ratio 1.00x GRPO" in lines
    cover = out["tests_by_method"]["trace_cover"]["final"]
    assert cover["grpo"]["seeds"] == [0, 1] and cover["grpo"]["diffs"] == pytest.approx([5.0, -1.0])
    assert out["tests"] is out["tests_by_method"]["trace"]
