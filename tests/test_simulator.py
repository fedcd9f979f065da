"""trace_core.simulator: exact V against hand-worked values and Monte Carlo; the difficulty mix."""

import numpy as np
import pytest

from trace_core.simulator import DEADEND, FOUND, SEARCH, Prompt, SimConfig, Simulator, render


def _prompt(solve=0.3, deadend=0.2, recover=0.1) -> Prompt:
    return Prompt(uid=7, topic=1, level=2, shown_level=2, solve=solve, deadend=deadend, recover=recover)


def test_state_values_hand_worked():
    sim = Simulator(SimConfig(max_turns=2))
    v = sim.state_values(_prompt(solve=0.5, deadend=0.25, recover=0.5))
    # R=1: V_O = a = 0.5, V_D = 0.  R=2: V_O = 0.5 + 0.25*0 + 0.25*0.5 = 0.625, V_D = 0.5*0.5 = 0.25.
    np.testing.assert_allclose(v, [[0, 0], [0.5, 0], [0.625, 0.25]])


def test_belief_hand_worked():
    sim = Simulator(SimConfig(max_turns=3, obs_noise=0.1))
    p = _prompt(solve=0.5, deadend=0.25, recover=0.5)
    # From O: stay open 0.25, doom 0.25; "deadend" seen with P 0.1 from O and 0.9 from D.
    np.testing.assert_allclose(sim.belief(p, (DEADEND,)), [0.1, 0.9])
    np.testing.assert_allclose(sim.belief(p, (SEARCH,)), [0.9, 0.1])
    # V after one "deadend" with 2 turns left: 0.1 * 0.625 + 0.9 * 0.25.
    assert sim.true_value(p, (DEADEND,)) == pytest.approx(0.1 * 0.625 + 0.9 * 0.25)


@pytest.mark.parametrize("prefix", [(), (SEARCH,), (DEADEND, DEADEND), (SEARCH, DEADEND, SEARCH)])
def test_true_value_matches_monte_carlo(prefix):
    sim = Simulator(SimConfig(max_turns=5))
    p = _prompt()
    rng = np.random.default_rng(1)
    n = 20000
    rate = np.mean([sim.rollout(p, prefix, rng).reward for _ in range(n)])
    v = sim.true_value(p, prefix)
    assert abs(rate - v) < 4 * np.sqrt(v * (1 - v) / n) + 1e-3


def test_rollout_shape_reward_and_tokens():
    sim = Simulator(SimConfig(max_turns=4, tokens_per_turn=10))
    rng = np.random.default_rng(0)
    for _ in range(200):
        r = sim.rollout(_prompt(), (SEARCH,), rng)
        assert 1 <= len(r.turns) <= 3
        assert r.reward == (r.turns[-1] == FOUND)
        assert FOUND not in r.turns[:-1]
        assert r.tokens == 10 * len(r.turns)


def test_rollout_is_reproducible_from_the_rng():
    sim = Simulator()
    p = _prompt()
    a = [sim.rollout(p, (), np.random.default_rng(5)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_bad_prefix_and_config_raise():
    sim = Simulator(SimConfig(max_turns=2))
    with pytest.raises(ValueError, match="non-terminal"):
        sim.true_value(_prompt(), (SEARCH, SEARCH))
    with pytest.raises(ValueError, match="found"):
        sim.true_value(_prompt(), (FOUND,))
    with pytest.raises(ValueError, match="level_probs"):
        SimConfig(level_probs=(0.5, 0.2), level_solve=(0.1, 0.2), level_deadend=(0.1, 0.1))
    with pytest.raises(ValueError, match="obs_noise"):
        SimConfig(obs_noise=0.5)


def test_render_is_the_history_text():
    p = _prompt()
    assert render(p, ()) == "q7 topic1 level2"
    assert render(p, (SEARCH, DEADEND)) == "q7 topic1 level2 | search | deadend"


def test_uniform_grpo_effective_ratio_is_in_the_paper_range():
    """Uniform GRPO, n = 8: the share of prompts whose group holds both outcomes is ~25-35%."""
    sim = Simulator()
    rng = np.random.default_rng(0)
    prompts = sim.sample_prompts(3000, rng)
    v = np.array([sim.true_value(p) for p in prompts])
    expected = np.mean(1 - v**8 - (1 - v) ** 8)
    assert 0.25 <= expected <= 0.35
    mixed = [0 < sum(sim.rollout(p, (), rng).reward for _ in range(8)) < 8 for p in prompts[:800]]
    assert 0.25 <= np.mean(mixed) <= 0.35


def test_text_carries_signal_without_revealing_v():
    sim = Simulator()
    prompts = sim.sample_prompts(3000, np.random.default_rng(3))
    v = np.array([sim.true_value(p) for p in prompts])
    shown = np.array([p.shown_level for p in prompts])
    means = [v[shown == lvl].mean() for lvl in range(len(sim.config.level_probs))]
    assert all(a > b for a, b in zip(means, means[1:]))  # harder tag, lower V
    # ... but prompts with the same tag still differ in V.
    assert v[shown == 2].std() > 0.1
    # A "deadend" turn lowers V, a "search" turn does not drop it as far.
    p = prompts[int(np.argmin(np.abs(v - 0.5)))]
    assert sim.true_value(p, (DEADEND,)) < sim.true_value(p, (SEARCH,))


def test_sample_prompts_gives_fresh_ids_and_valid_rates():
    sim = Simulator()
    rng = np.random.default_rng(0)
    a, b = sim.sample_prompts(50, rng), sim.sample_prompts(50, rng)
    assert len({p.uid for p in a + b}) == 100
    for p in a + b:
        assert 0 < p.solve and 0 <= p.deadend and p.solve + p.deadend <= 0.95 + 1e-12
