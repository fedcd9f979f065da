"""bench.learning_sim: the exact return and gradient against finite differences and Monte Carlo,
the chain's mechanics on hand-built items, the generator, and a short paired run's ledger."""

from __future__ import annotations

import numpy as np
import pytest

from bench.learning_runs import parse_seeds
from bench.learning_sim import load_records, main, write_records
from trace_rl.sim.run import at_tokens, run_seed
from trace_rl.sim.model import (ALIAS, INIT_PROBS, NEAR_DUP, NO_HAZARD, TOKENS_PER_TURN, ChainParams,
                             Items, dynamics, exact, make_items, parse_hops, sample)
from bench.learning_report import closing, reach_ratio, tokens_to_reach
from trace_core.stats import detectable_effect as detectable
from trace_rl.sim.run import REFERENCE, SimSettings, methods


def _items(hops, hazard, first_wrong=None) -> Items:
    hazard = np.asarray(hazard, np.int64)
    first_wrong = np.ones_like(hazard, bool) if first_wrong is None else np.asarray(first_wrong)
    return Items(np.asarray(hops, np.int64), hazard, first_wrong,
                 np.zeros((len(hops), 2), np.int64), tuple(f"i{k}" for k in range(len(hops))))


def _peaked(actions) -> np.ndarray:
    """Logits that pick ``actions[type]`` with probability ~1."""
    theta = np.full((4, 3), -60.0)
    theta[np.arange(4), actions] = 0.0
    return theta


@pytest.mark.parametrize("structure", ["chain", "arith"])
def test_gradient_matches_finite_differences(structure):
    rng = np.random.default_rng(5)
    dyn = dynamics(make_items(60, ChainParams(structure=structure), rng, "x"))
    theta = rng.normal(size=(4, 3))
    ex = exact(dyn, theta)
    eps = 1e-6
    for k in range(4):
        for a in range(3):
            up, down = theta.copy(), theta.copy()
            up[k, a] += eps
            down[k, a] -= eps
            fd = (exact(dyn, up, grad=False).start - exact(dyn, down, grad=False).start) / (2 * eps)
            np.testing.assert_allclose(ex.grad[:, k, a], fd, atol=1e-7)
    # softmax logits: shifting one type's logits together changes nothing
    np.testing.assert_allclose(ex.grad.sum(axis=2), 0.0, atol=1e-12)


def test_monte_carlo_agrees_with_the_exact_return():
    rng = np.random.default_rng(11)
    items = make_items(12, ChainParams(), rng, "x")
    dyn = dynamics(items)
    theta = np.log(INIT_PROBS) + rng.normal(scale=0.3, size=(4, 3))
    ex = exact(dyn, theta)
    reps = 4000
    item = np.repeat(np.arange(items.size), reps)
    batch = sample(dyn, theta, item, np.zeros((len(item), 4), np.int64), np.random.default_rng(2))
    mc = batch.reward.reshape(items.size, reps).mean(axis=1)
    se = np.sqrt(np.maximum(ex.start * (1 - ex.start), 1e-4) / reps)
    assert np.all(np.abs(mc - ex.start) < 4.5 * se + 1e-3), (mc, ex.start)
    # from mid-episode states (as Stage 2 continues a stored prefix): each rollout's first
    # recorded state is a reachable state; continuations from it match its exact value
    starts = batch.state[::reps, 0]  # [I, 4] state after one turn
    live = np.flatnonzero((batch.length[::reps] > 1))
    item2 = np.repeat(live, reps)
    again = sample(dyn, theta, item2, np.repeat(starts[live], reps, axis=0), np.random.default_rng(3))
    mc2 = again.reward.reshape(len(live), reps).mean(axis=1)
    j, s, d, t = starts[live].T
    v2 = ex.value[t, live, j, s, d]
    se2 = np.sqrt(np.maximum(v2 * (1 - v2), 1e-4) / reps)
    assert np.all(np.abs(mc2 - v2) < 4.5 * se2 + 1e-3), (mc2, v2)


def test_chain_mechanics_on_hand_built_items():
    # a peaked policy: correct query, retry the alias, verify, answer
    good = _peaked([0, 0, 0, 0])
    items = _items([2, 3, 3, 2], [[ALIAS, ALIAS, 0, 0], [ALIAS, ALIAS, ALIAS, 0],
                                  [NEAR_DUP, 0, 0, 0], [0, 0, 0, 0]])
    dyn = dynamics(items)
    np.testing.assert_allclose(exact(dyn, good, grad=False).start, [1, 0, 1, 1], atol=1e-12)
    # two aliases: 2 hops + 2 retries + the answer = 5 turns = the cap; three aliases need 7 > 6
    batch = sample(dyn, good, np.array([0, 1]), np.zeros((2, 4), np.int64), np.random.default_rng(0))
    assert batch.length.tolist() == [5, 6] and batch.reward.tolist() == [1.0, 0.0]
    # taking the first match derails silently when it is the wrong copy (hidden in the item)
    take_first = _peaked([0, 0, 1, 0])
    homonyms = _items([2, 2], [[NEAR_DUP, 0, 0], [NEAR_DUP, 0, 0]],
                      first_wrong=[[True, False, False], [False, False, False]])
    out = exact(dynamics(homonyms), take_first, grad=False)
    np.testing.assert_allclose(out.start, [0.0, 1.0], atol=1e-12)
    # the derailed episode still runs to its answer: the derail is silent
    b = sample(dynamics(homonyms), take_first, np.array([0]), np.zeros((1, 4), np.int64),
               np.random.default_rng(0))
    assert b.length[0] == 3 and b.reward[0] == 0.0 and b.state[0, 0, 2] == 1


def test_generator_and_negative_control():
    rng = np.random.default_rng(0)
    items = make_items(4000, ChainParams(hops="2:0.5,4:0.5", hazard_a=2, hazard_b=2), rng, "x")
    assert set(np.unique(items.hops)) == {2, 4}
    assert abs(np.mean(items.hops == 2) - 0.5) < 0.03
    assert np.all(items.cap == items.hops + 3)
    beyond = np.arange(items.hazard.shape[1])[None, :] >= items.hops[:, None]
    assert np.all(items.hazard[beyond] == NO_HAZARD)
    real = ~beyond
    assert abs(np.mean(items.hazard[real] != NO_HAZARD) - 0.5) < 0.03  # E[Beta(2, 2)] = 0.5
    v = exact(dynamics(items), np.log(INIT_PROBS), grad=False).start
    assert v.min() < 0.05 and v.max() > 0.7  # some prompts never solved, some mostly
    arith = make_items(50, ChainParams(structure="arith"), rng, "a")
    va = exact(dynamics(arith), np.log(INIT_PROBS), grad=False).start
    assert np.ptp(va) == 0.0 and 0.3 < va[0] < 0.7  # prompts alike


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="--hops"):
        parse_hops("2:0.5,3")
    with pytest.raises(ValueError, match="--hops"):
        parse_hops("2:0.5,3:0.2")
    with pytest.raises(ValueError, match="--seeds"):
        parse_seeds("0-x", count=False)
    with pytest.raises(ValueError, match="--structure"):
        ChainParams(structure="tree")
    with pytest.raises(ValueError, match="--hazard-a"):
        ChainParams(hazard_a=0)
    with pytest.raises(ValueError, match="--train-items"):
        SimSettings(pool_size=32, train_items=16)
    with pytest.raises(ValueError, match="--plus"):
        methods(["trace+magic"])
    assert parse_seeds("0-2,7", count=False) == [0, 1, 2, 7] and parse_seeds("5", count=False) == [5]


def test_short_paired_run_keeps_the_ledger():
    rows = [m for m in methods(["trace+post"]) if m.name in
            ("grpo", "dapo", "trace", "root_only", "oracle_pred", "joint_split", "trace+post", "N=1")]
    settings = SimSettings(steps=3, pool_size=16, train_items=32, eval_items=20)
    out = run_seed(0, rows, ChainParams(), settings, protocol="leaves")
    budget = settings.train.root_budget * (1 + settings.train.multiplier)
    for name, log in out.items():
        assert len(log["accuracy"]) == 3 and all(0.0 <= a <= 1.0 for a in log["accuracy"])
        if name == "dapo":
            assert all(x <= budget for x in log["leaves"])  # DAPO may stop early
        else:
            assert log["leaves"] == [budget] * 3, name
        assert all(t % TOKENS_PER_TURN == 0 and t > 0 for t in log["tokens"])
        assert all(-1.0 <= c <= 1.0 for c in log["cosine"])
    # paired: every method starts from the same policy on the same test items
    assert len({log["acc0"] for log in out.values()}) == 1
    # accuracy at equal tokens interpolates the curve against cumulative tokens
    log = {"acc0": 0.2, "accuracy": [0.4, 0.6], "tokens": [100, 100]}
    assert at_tokens(log, 150) == pytest.approx(0.5) and at_tokens(log, 0) == pytest.approx(0.2)


def test_matched_baselines_spend_the_references_tokens(tmp_path):
    rows = [m for m in methods([]) if m.name in (REFERENCE, "grpo", "prompt_only", "trace")]
    settings = SimSettings(steps=6, pool_size=32, train_items=64, eval_items=20)
    out = run_seed(1, rows, ChainParams(hops="2:0.2,6:0.8"), settings)
    assert list(out) == [m.name for m in rows]
    ref = np.array(out[REFERENCE]["tokens"], float)
    budget = settings.train.root_budget * (1 + settings.train.multiplier)
    assert out[REFERENCE]["leaves"] == [budget] * 6 and out["trace"]["leaves"] == [budget] * 6
    for name in ("grpo", "prompt_only"):
        tokens = np.array(out[name]["tokens"], float)
        assert abs(tokens.sum() / ref.sum() - 1) < 0.2, (name, tokens, ref)  # matched, not equal leaves
        assert out[name]["leaves"] != [budget] * 6
    assert all(x % settings.train.group_size == 0 for x in out["grpo"]["leaves"])
    # training tokens: every path's turns, so a tree trains on more tokens than it generates
    assert sum(out[REFERENCE]["train_tokens"]) > sum(out[REFERENCE]["tokens"])
    assert out["grpo"]["train_tokens"] == out["grpo"]["tokens"]
    # a matched row without the reference is refused
    with pytest.raises(ValueError, match="reference"):
        run_seed(1, rows[1:], ChainParams(), settings)
    # the records round-trip, and other settings are refused
    write_records(tmp_path, "chain", 1, out, {"a": 1})
    back = load_records(tmp_path, "chain", list(out), {"a": 1})
    assert list(back) == [1] and back[1]["grpo"]["tokens"] == out["grpo"]["tokens"]
    with pytest.raises(ValueError, match="other settings"):
        load_records(tmp_path, "chain", list(out), {"a": 2})


def test_tokens_to_reach_and_the_ratio():
    log = {"acc0": 0.2, "accuracy": [0.4, 0.6, 0.5], "tokens": [100, 100, 100]}
    assert tokens_to_reach(log, 50.0) == pytest.approx(150.0)
    assert tokens_to_reach(log, 10.0) == 0.0 and np.isnan(tokens_to_reach(log, 70.0))
    # GRPO reaches its final accuracy (mean of the last steps) at 200 tokens; a method twice as
    # fast per token needs half
    grpo = {"acc0": 0.0, "accuracy": [0.25, 0.5] + [0.5] * 5, "tokens": [100] * 7}
    fast = {"acc0": 0.0, "accuracy": [0.5] * 7, "tokens": [100] * 7}
    ratio, low, high, never = reach_ratio([fast, fast], [grpo, grpo])
    assert ratio == pytest.approx(0.5) and low == high == pytest.approx(0.5) and never == 0
    slow = {"acc0": 0.0, "accuracy": [0.1] * 7, "tokens": [100] * 7}
    ratio, low, high, never = reach_ratio([slow, fast, slow], [grpo] * 3)
    assert never == 2 and ratio == np.inf and low == 0.5 and high == np.inf  # never: not flattered


def test_power_and_closing_line():
    # Many seeds: the normal approximation (z_0.975 + z_0.8) sd / sqrt(n) = 2.8016 sd / sqrt(n).
    assert detectable(10.0, 400) == pytest.approx(2.8016 * 10 / 20, rel=5e-3)
    # Few seeds: the t-test needs more; at the returned effect a simulated paired t-test rejects
    # 80% of the time.
    d = detectable(5.4, 10)
    assert d > 2.8016 * 5.4 / np.sqrt(10) + 0.4
    rng = np.random.default_rng(0)
    x = rng.normal(d, 5.4, size=(20000, 10))
    t = x.mean(1) / (x.std(1, ddof=1) / np.sqrt(10))
    assert np.mean(np.abs(t) > 2.262157) == pytest.approx(0.8, abs=0.01)
    assert np.isnan(detectable(1.0, 1))  # one seed: no test, no detectable effect
    main_ = {"grpo": np.array([50.0, 52, 54]), "dapo": np.array([40.0, 41, 42]),
             "prompt_only": np.array([51.0, 53, 55]), REFERENCE: np.array([53.0, 55, 57])}
    ctl = {k: v - 20 for k, v in main_.items()}
    line, iv, civ = closing(main_, ctl, REFERENCE)
    assert line == ("TRACE-cover vs best baseline at equal tokens and steps: +2.0 points (95% CI "
                    "+2.0, +2.0) over 3 seeds; control +2.0 (95% CI +2.0, +2.0)")


def test_cli_accumulates_seeds_in_its_records(tmp_path, capsys):
    argv = ["--regime", "paper", "--steps", "2", "--pool-size", "16", "--train-items", "32",
            "--eval-items", "10", "--records", str(tmp_path)]
    main(argv + ["--seeds", "0"])
    out = main(argv + ["--seeds", "1"])
    text = capsys.readouterr().out
    assert text.count("seed 0 chain") == 1 and "seed 1 chain" in text
    assert text.splitlines()[-1].startswith("TRACE-cover vs best baseline at equal tokens and steps:")
    assert "over 2 seeds; control" in text.splitlines()[-1] and out["gain"].n == 2
    assert len(list((tmp_path / "control" / REFERENCE).glob("seed*.json"))) == 2


def test_the_oracle_row_is_the_true_v_without_exploration_and_the_stage_options_compose():
    """cover_oracle (the Oracle allocator's stages) equals trace_cover fed the true V with
    exploration 0, run for run; the true V in both stages through ``root_predictor`` equals it
    through ``predictor``; and the posterior's Thompson draws differ from its mean."""
    rows = {m.name: m for m in methods([])}
    settings = SimSettings(steps=6, pool_size=32, train_items=64, eval_items=40)
    both = rows["cover_exact"]
    as_roots = type(both)("exact_both_ways", "trace_cover", predictor="oracle", root_predictor="oracle")
    names = ["cover_oracle", "cover_exact_noexp", "cover_exact", "cover_post_noexp",
             "cover_post_thompson"]
    out = run_seed(3, [rows[n] for n in names] + [as_roots], ChainParams(hops="2:0.2,6:0.8"), settings)
    assert out["cover_oracle"]["accuracy"] == out["cover_exact_noexp"]["accuracy"]
    assert out["cover_exact"]["accuracy"] == out["exact_both_ways"]["accuracy"]
    assert out["cover_exact"]["accuracy"] != out["cover_exact_noexp"]["accuracy"]  # exploration acts
    assert out["cover_post_noexp"]["accuracy"] != out["cover_post_thompson"]["accuracy"]
