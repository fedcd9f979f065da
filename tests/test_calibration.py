"""trace_core.calibration: the outcome-correlation estimate recovers a known rho from trees drawn
under the Beta model, reads each kind of node correctly, and names bad input."""

import numpy as np
import pytest

from trace_core.calibration import MAX_CORRELATION, Correlation, Term, estimate, tree_terms


def draw_tree(rng, v_root, rho_root, rho_prefix, m=3, k=2):
    """A root with m bare rollouts of two turns; the first bare rollout's turn-1 node gets k
    continuations. True values: V_root ~ Beta(mean v_root, rho_root); the prefix is predicted
    p = V_root (so its bare rollout is a draw of the root like the others) and its true value is
    ~ Beta(mean p, rho_prefix). Returns (parent, reward, level, predicted)."""
    def beta(mean, rho):
        kappa = 1 / rho - 1 if rho > 0 else 1e9
        mean = min(max(mean, 1e-9), 1 - 1e-9)  # a draw of V may be exactly 0 or 1
        return rng.beta(mean * kappa, (1 - mean) * kappa)

    V = beta(v_root, rho_root)
    p_prefix = V
    parent, reward, level, predicted = [-1], [np.nan], [0], [v_root]
    for j in range(m):
        turn = len(parent)
        parent += [0, turn]
        level += [0, 0]
        if j == 0:
            Vp = beta(p_prefix, rho_prefix)
            predicted += [p_prefix, np.nan]
            reward += [np.nan, float(rng.random() < Vp)]
        else:
            predicted += [np.nan, np.nan]
            reward += [np.nan, float(rng.random() < V)]
    for _ in range(k):  # continuations of node 1 (the first bare rollout's turn 1)
        parent.append(1)
        level.append(1)
        predicted.append(np.nan)
        reward.append(float(rng.random() < Vp))
    return np.array(parent), np.array(reward), np.array(level), np.array(predicted)


@pytest.mark.parametrize(("rho_root", "rho_prefix"), [(0.0, 0.0), (0.3, 0.7), (0.6, 0.2)])
def test_estimate_recovers_the_correlation(rho_root, rho_prefix):
    rng = np.random.default_rng(0)
    terms = []
    for _ in range(6000):
        terms += tree_terms(*draw_tree(rng, rng.uniform(0.2, 0.8), rho_root, rho_prefix))
    est = estimate(terms)
    assert est.at(0) == pytest.approx(rho_root, abs=0.04)
    assert est.at(1) == pytest.approx(rho_prefix, abs=0.04)
    assert est.at(3) == est.prefixes == est.at(1)  # no depth-3 evidence: the pooled prefixes


def test_terms_of_a_hand_built_tree():
    # root (pred 0.5) -> bare rollouts a: [1 -> 2 (r=1)], b: [3 -> 4 (r=0)], c: [5 (r=1)]
    # node 1 (pred 0.8) got continuations 6 -> 7 (r=0) and 8 (r=1); node 3 was not scored.
    parent = np.array([-1, 0, 1, 0, 3, 0, 1, 6, 1])
    reward = np.array([np.nan, np.nan, 1, np.nan, 0, 1, np.nan, 0, 1], dtype=float)
    level = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1])
    predicted = np.array([0.5, 0.8, np.nan, np.nan, np.nan, np.nan, np.nan, np.nan, np.nan])
    terms = tree_terms(parent, reward, level, predicted)
    assert terms[0] == Term(0, 2 / 3, 0.5)  # s=2 of m=3: 2 disagreeing pairs of 3
    assert terms[1].depth == 1 and terms[1].observed == 1.0  # one continuation flipped r=1
    assert terms[1].expected == pytest.approx(2 * 0.2)  # 2 continuations x (1 - q), q = 0.8
    assert terms[1].units == 2.0 and terms[0].units == 1.0
    assert len(terms) == 2


def test_estimate_clips_and_falls_back():
    assert estimate([Term(0, 0.0, 1.0)] * 20).at(0) == MAX_CORRELATION  # never a disagreement
    assert estimate([Term(0, 2.0, 1.0)] * 20).at(0) == 0.0  # more than independent draws give
    few = estimate([Term(1, 0.0, 1.0)] * 3, min_terms=16)
    assert few.at(1) == 0.0 and few.evidence == {1: 3}
    assert Correlation().at(0) == Correlation().at(2) == 0.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="leaf 2 has reward 0.5"):
        tree_terms(np.array([-1, 0, 1]), np.array([np.nan, np.nan, 0.5]), np.zeros(3, int),
                   np.full(3, np.nan))
    with pytest.raises(ValueError, match="parent"):
        tree_terms(np.array([-1, 2, 1]), np.array([np.nan, np.nan, 1.0]), np.zeros(3, int),
                   np.full(3, np.nan))
    with pytest.raises(ValueError, match="one entry per node"):
        tree_terms(np.array([-1, 0]), np.array([np.nan]), np.zeros(2, int), np.full(2, np.nan))
    with pytest.raises(ValueError, match="min_terms"):
        estimate([], min_terms=0)
