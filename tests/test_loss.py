"""trace_core.loss: masking, the unclipped gradient at ratio 1, clipping, KL, aggregations, and
hand-worked numbers."""

import math

import pytest
import torch

from trace_core.loss import AGGREGATIONS, engine_mismatch, policy_loss, tis_weights


@pytest.fixture(autouse=True)
def float64():
    """Hand-worked numbers are compared in double precision; restore the global default after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def leaf(values):
    return torch.tensor(values, requires_grad=True)


def test_masked_tokens_get_zero_gradient_even_with_garbage_values():
    logp = leaf([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    old = torch.tensor([[-1.1, float("-inf"), -0.4], [-0.2, -0.9, float("nan")]])
    adv = torch.tensor([[1.0, float("nan"), -2.0], [0.5, 0.5, float("nan")]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    ref = torch.tensor([[-1.0, float("nan"), -0.6], [-0.4, -0.6, float("inf")]])
    for agg in AGGREGATIONS:
        logp.grad = None
        loss, stats = policy_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.1, agg=agg)
        loss.backward()
        assert torch.isfinite(loss)
        assert logp.grad[0, 1] == 0 and logp.grad[1, 2] == 0
        assert torch.all(logp.grad[mask.bool()] != 0)
        assert stats["n_tokens"] == 4


def test_ratio_one_gives_plain_policy_gradient():
    # At logp == old_logp the clip is inactive: d loss / d logp = -A * mask / n_tokens.
    values = [[-1.0, -2.0, -0.5, -0.1], [-0.3, -0.7, -1.1, -2.5]]
    logp = leaf(values)
    adv = torch.tensor([[1.0, 1.0, -0.5, 0.0], [2.0, -1.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    loss, stats = policy_loss(logp, torch.tensor(values), adv, mask)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * mask / 7)
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / 7)
    assert stats["clip_frac"] == 0 and stats["ratio_mean"] == pytest.approx(1)
    assert stats["approx_kl"] == pytest.approx(0)


@pytest.mark.parametrize(
    ("advantage", "log_ratio", "clipped"),
    [
        (1.0, math.log(1.5), True),  # A > 0, ratio above 1 + 0.28
        (1.0, math.log(1.2), False),  # inside the band
        (1.0, math.log(0.5), False),  # A > 0, ratio low: PPO keeps the gradient
        (-1.0, math.log(0.5), True),  # A < 0, ratio below 1 - 0.2
        (-1.0, math.log(1.5), False),  # A < 0, ratio high: PPO keeps the gradient
        (1.0, math.log(1.25), False),  # clip-higher: 1.25 < 1.28 is still trained on
    ],
)
def test_clipping_removes_the_gradient_exactly_where_expected(advantage, log_ratio, clipped):
    logp = leaf([[-1.0]])
    old = torch.tensor([[-1.0 - log_ratio]])
    loss, stats = policy_loss(logp, old, torch.tensor([[advantage]]), torch.tensor([[1]]))
    loss.backward()
    expected_grad = 0.0 if clipped else -advantage * math.exp(log_ratio)
    assert logp.grad.item() == pytest.approx(expected_grad)
    assert stats["clip_frac"] == (1.0 if clipped else 0.0)


@pytest.mark.parametrize(
    ("advantage", "ratio", "grad_kept", "cut"),
    [
        (-1.0, 5.0, False, True),  # A < 0, ratio past c = 3: the dual clip removes the gradient
        (-1.0, 2.0, True, False),  # A < 0, ratio between 1 + clip_high and c: PPO's gradient
        (1.0, 5.0, False, False),  # A > 0, ratio high: PPO's own clip (not the dual one)
        (-1.0, 0.5, False, False),  # A < 0, ratio low: PPO's own clip
    ],
)
def test_dual_clip_bounds_negative_advantage_tokens_with_runaway_ratios(advantage, ratio, grad_kept, cut):
    logp = leaf([[-1.0]])
    old = torch.tensor([[-1.0 - math.log(ratio)]])
    adv, mask = torch.tensor([[advantage]]), torch.tensor([[1]])
    loss, stats = policy_loss(logp, old, adv, mask, clip_ratio_c=3.0)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-advantage * ratio if grad_kept else 0.0)
    assert stats["dual_clip_frac"] == (1.0 if cut else 0.0)
    assert stats["ratio_max"] == pytest.approx(ratio)
    if cut:  # the loss is -A c, not -A rho
        assert loss.item() == pytest.approx(-advantage * 3.0)
        plain, _ = policy_loss(leaf([[-1.0]]), old, adv, mask)
        assert plain.item() == pytest.approx(-advantage * ratio)


def test_dual_clip_off_is_plain_ppo():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-3.0, -1.0, -0.4]])
    adv, mask = torch.tensor([[-1.0, 2.0, -0.5]]), torch.ones(1, 3)
    a, sa = policy_loss(logp, old, adv, mask)
    b, sb = policy_loss(logp, old, adv, mask, clip_ratio_c=0.0)
    assert a.item() == b.item() and "dual_clip_frac" not in sa and "dual_clip_frac" not in sb


def test_hand_worked_value_and_aggregations():
    # Sequence 0: tokens (A=1, rho=1.5 -> clipped to 1.28), (A=-1, rho=1) ; sequence 1: (A=2,
    # rho=0.5 -> unclipped, -A rho = -1), masked token, then (A=-2, rho=0.5 -> clipped to 0.8,
    # max(1.0, 1.6) = 1.6).
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    log_ratio = torch.log(torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 0.5]]))
    logp = leaf((old + log_ratio).tolist())
    adv = torch.tensor([[1.0, -1.0, 0.0], [2.0, 5.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    pg = [[-1.28, 1.0], [-1.0, 1.6]]
    expected = {
        "token-mean": (sum(pg[0]) + sum(pg[1])) / 4,
        "seq-mean-token-sum": (sum(pg[0]) + sum(pg[1])) / 2,
        "seq-mean-token-mean": (sum(pg[0]) / 2 + sum(pg[1]) / 2) / 2,
    }
    for agg, value in expected.items():
        loss, stats = policy_loss(logp, old, adv, mask, agg=agg)
        assert loss.item() == pytest.approx(value), agg
        assert stats["pg_loss"] == pytest.approx(value)
        assert stats["clip_frac"] == pytest.approx(2 / 4)
        assert stats["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.5 + 0.5) / 4)
        assert stats["approx_kl_max"] == pytest.approx(0.5 - 1 - math.log(0.5))  # rho 0.5 beats 1.5


def test_sequence_aggregations_ignore_empty_rows():
    logp = leaf([[-1.0, -1.0], [-1.0, -1.0]])
    adv = torch.tensor([[1.0, 1.0], [9.0, 9.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx(-2.0)


def test_k3_kl_value_and_gradient():
    logp = leaf([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.tensor([[1, 1]])
    loss, stats = policy_loss(
        logp, logp.detach(), torch.zeros(1, 2), mask, ref_logp=ref, kl_coef=0.5
    )
    loss.backward()
    k3 = math.exp(-0.5) + 0.5 - 1.0  # ref - logp = -0.5 on the first token, 0 on the second
    assert stats["kl_ref"] == pytest.approx(k3 / 2)
    assert loss.item() == pytest.approx(0.5 * k3 / 2)
    # d k3 / d logp = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5 * (1 - math.exp(-0.5)) / 2, 0.0]]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"agg": "sum"}, "agg"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"kl_coef": 0.1}, "ref_logp"),
        ({"kl_coef": -1.0, "ref_logp": torch.zeros(1, 2)}, "kl_coef"),
        ({"ref_logp": torch.zeros(2, 2)}, "ref_logp"),
        ({"clip_ratio_c": 1.2}, "clip_ratio_c"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=message):
        policy_loss(x, x, x, torch.ones(1, 2), **kwargs)


def test_bad_tensors_raise():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="only 0 and 1"):
        policy_loss(x, x, x, torch.full((1, 2), 0.5))
    with pytest.raises(ValueError, match="no token"):
        policy_loss(x, x, x, torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2))


def test_truncated_importance_weights_on_a_hand_worked_batch():
    # Trainer vs engine log-probs of the sampled tokens: the trainer's probability over the
    # engine's is 0.5 (engine drew it more readily), 1 (agree), 4 -> capped at 2, and a masked
    # token with garbage values, whose weight is 1 and never read.
    engine = torch.tensor([[math.log(0.4), math.log(0.3)], [math.log(0.1), float("nan")]])
    train = torch.tensor([[math.log(0.2), math.log(0.3)], [math.log(0.4), float("-inf")]])
    mask = torch.tensor([[1, 1], [1, 0]])
    w = tis_weights(train, engine, mask, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.0], [2.0, 1.0]]))
    # In the loss at ratio 1 (logp == old), each token's gradient is -A w / n.
    logp = leaf(train.masked_fill(~mask.bool(), -1.0).tolist())
    adv = torch.tensor([[1.0, -1.0], [2.0, 7.0]])
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, agg="token-mean", is_weights=w)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 1.0], [-4.0, 0.0]]) / 3)
    assert loss.item() == pytest.approx((-0.5 + 1.0 - 4.0) / 3)
    assert stats["tis_weight_mean"] == pytest.approx((0.5 + 1.0 + 2.0) / 3)
    assert stats["tis_below_one"] == pytest.approx(1 / 3)
    # Weights of 1 are the plain loss; without weights no TIS statistic is reported.
    plain, st = policy_loss(logp, logp.detach(), adv, mask, agg="token-mean")
    ones, _ = policy_loss(logp, logp.detach(), adv, mask, agg="token-mean", is_weights=torch.ones(2, 2))
    assert plain.item() == ones.item() and "tis_weight_mean" not in st
    with pytest.raises(ValueError, match="cap must be >= 1"):
        tis_weights(train, engine, mask, cap=0.5)
    with pytest.raises(ValueError, match="is_weights has shape"):
        policy_loss(logp, logp.detach(), adv, mask, is_weights=torch.ones(3))


def test_engine_mismatch_on_a_hand_worked_batch():
    # log r = train - engine on the three policy tokens: log 0.5, 0, log 2.
    engine = torch.tensor([[math.log(0.4), -1.0, math.log(0.1)], [0.0, 5.0, 5.0]])
    train = torch.tensor([[math.log(0.2), -1.0, math.log(0.2)], [0.0, -5.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    m = engine_mismatch(train, engine, mask)
    k3 = [0.5 - 1 - math.log(0.5), 0.0, 2 - 1 - math.log(2)]
    assert m["mismatch_abs_mean"] == pytest.approx(2 * math.log(2) / 3)
    assert m["mismatch_kl"] == pytest.approx(sum(k3) / 3)
    assert m["mismatch_kl_max"] == pytest.approx(max(k3))
    assert m["mismatch_tokens"] == 3
    assert engine_mismatch(train, train, mask)["mismatch_kl"] == 0.0
    assert engine_mismatch(train, engine, torch.zeros(2, 3)) == {"mismatch_tokens": 0.0}
