"""Clipped token-level policy-gradient loss with an observation mask and an optional KL term.

docs/algorithm.md, "trace_core.loss": every root-to-leaf path is a sequence, and only
policy-generated tokens (thoughts and actions) carry loss; prompt, tool-call results and
observations are masked out. Per token t of sequence b, with ratio rho = exp(logp - old_logp)::

    pg   = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))     (PPO; DAPO clip-higher)
    pg   = min(pg, -A c)   where A < 0, with clip_ratio_c = c > 1        (dual clip, optional)
    kl   = exp(ref - logp) - (ref - logp) - 1                           (k3 estimator, >= 0)
    loss = agg(w * pg + kl_coef * kl, mask)

where ``w`` is 1, or with truncated importance sampling on (``tis_weights``) the per-token weight
min(pi_train / pi_engine, C) of the sampled token: the rollout engine (vLLM, or the transformers
engine) samples from numerically different log-probs than the trainer's forward pass computes for
the same weights, so the "on-policy" batch is slightly off-policy; the weight corrects for it,
truncated at C so that a token the engine drew far more often than the trainer would cannot
dominate (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; verl's and OpenRLHF's TIS). ``engine_mismatch`` measures the gap.

Aggregations (``AGGREGATIONS``, chosen by name): "token-mean" averages over all policy tokens of
the batch (DAPO); "seq-mean-token-sum" sums within a sequence and averages over sequences
(Dr. GRPO's unbiased form up to a constant); "seq-mean-token-mean" averages within, then across
sequences (original GRPO). Sequences with no policy token are left out of the sequence means, so
padding rows do not rescale the loss. The paper does not fix these choices; they are knobs.

The dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"; verl's
``clip_ratio_c``) bounds the loss of a negative-advantage token whose ratio has run far above 1:
PPO's max keeps ``-A rho`` there, unbounded and with a gradient proportional to rho, so one such
token can set the direction of a whole norm-clipped step. Past ``rho > c`` it gets no gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Aggregation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()


def _seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows = mask.sum(dim=1) > 0  # [B] sequences with at least one policy token
    return (values * mask).sum(dim=1)[rows].mean()


def _seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    count = mask.sum(dim=1)  # [B]
    rows = count > 0
    return ((values * mask).sum(dim=1)[rows] / count[rows]).mean()


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
}


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    agg: str = "token-mean",
    clip_ratio_c: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (scalar loss, statistics). All tensors are [B, T].

    ``logp`` carries the gradient; ``old_logp`` (the sampling policy) and ``ref_logp`` are treated
    as constants. ``loss_mask`` is 1 on policy-generated tokens and 0 elsewhere; values at masked
    positions of any input (padding, NaN advantages past a path's end, -inf log-probs) are ignored
    and receive zero gradient. Statistics are over policy tokens: ``clip_frac`` (share whose
    gradient the clip removed), ``approx_kl`` (k3 of the sampling policy from the current one;
    ``approx_kl_max`` its largest single-token value),
    ``ratio_mean``, ``ratio_max`` (largest ratio), ``entropy_proxy`` (mean -logp of the sampled
    tokens), ``kl_ref`` (if a reference is given), ``pg_loss``, ``n_tokens`` and, with the dual
    clip on (``clip_ratio_c`` > 1; 0 = off), ``dual_clip_frac`` (share of policy tokens it cut).
    ``is_weights`` ([B, T], constants; None = all 1): per-token weights of the policy-gradient
    term (``tis_weights``); with them, ``tis_weight_mean`` and ``tis_below_one`` (share of policy
    tokens weighted below 1).
    """
    _check(logp, old_logp, advantages, loss_mask, ref_logp, clip_low, clip_high, kl_coef, agg)
    if clip_ratio_c != 0.0 and not clip_ratio_c > 1.0 + clip_high:
        raise ValueError(f"clip_ratio_c must be 0 (off) or > 1 + clip_high = {1.0 + clip_high}, "
                         f"got {clip_ratio_c}")
    mask = loss_mask.to(logp.dtype)  # [B, T]
    keep = loss_mask.bool()  # [B, T]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # torch.where (not multiplication) so that inf/NaN at masked positions cannot leak into the
    # loss or its gradient.
    logp = torch.where(keep, logp, zero)
    old = torch.where(keep, old_logp.detach().to(logp.dtype), zero)
    adv = torch.where(keep, advantages.detach().to(logp.dtype), zero)

    log_ratio = logp - old  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -adv * ratio  # [B, T]
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    pg = torch.maximum(unclipped, clipped)  # [B, T]
    dual = None
    if clip_ratio_c:
        dual = (adv < 0) & (pg > -adv * clip_ratio_c)  # [B, T] where the dual clip binds
        pg = torch.where(dual, -adv * clip_ratio_c, pg)
    per_token = pg
    if is_weights is not None:
        if is_weights.shape != logp.shape:
            raise ValueError(f"is_weights has shape {tuple(is_weights.shape)}, logp has {tuple(logp.shape)}")
        w = torch.where(keep, is_weights.detach().to(logp.dtype), zero)
        per_token = w * pg
    kl_ref = None
    if ref_logp is not None:
        ref = torch.where(keep, ref_logp.detach().to(logp.dtype), zero)
        kl_ref = torch.exp(ref - logp) - (ref - logp) - 1.0  # [B, T] k3, >= 0
        per_token = pg + kl_coef * kl_ref
    loss = AGGREGATIONS[agg](per_token, mask)

    with torch.no_grad():
        n = mask.sum()
        stats = {
            "pg_loss": float(AGGREGATIONS[agg](pg, mask)),
            "clip_frac": float(((clipped > unclipped).to(mask.dtype) * mask).sum() / n),
            "approx_kl": float(((ratio - 1.0 - log_ratio) * mask).sum() / n),
            "approx_kl_max": float(((ratio - 1.0 - log_ratio) * mask).max()),
            "ratio_mean": float((ratio * mask).sum() / n),
            "ratio_max": float(torch.where(keep, ratio, zero).max()),
            "entropy_proxy": float((-logp * mask).sum() / n),
            "n_tokens": float(n),
        }
        if dual is not None:
            stats["dual_clip_frac"] = float((dual.to(mask.dtype) * mask).sum() / n)
        if kl_ref is not None:
            stats["kl_ref"] = float((kl_ref * mask).sum() / n)
        if is_weights is not None:
            stats["tis_weight_mean"] = float((w * mask).sum() / n)
            stats["tis_below_one"] = float(((w < 1.0).to(mask.dtype) * mask).sum() / n)
    return loss, stats


def tis_weights(train_logp: torch.Tensor, engine_logp: torch.Tensor, loss_mask: torch.Tensor,
                cap: float) -> torch.Tensor:
    """Truncated importance weights min(exp(train_logp - engine_logp), cap), [B, T], 1 at masked
    positions: ``train_logp`` is the trainer's log-prob of each sampled token under the weights
    that sampled it (the update's old log-probs), ``engine_logp`` the engine's for the same token."""
    if not cap >= 1.0:
        raise ValueError(f"the TIS cap must be >= 1 (a weight above 1 is allowed up to it), got {cap}")
    if train_logp.shape != engine_logp.shape or train_logp.shape != loss_mask.shape:
        raise ValueError(f"tis_weights: shapes differ: train {tuple(train_logp.shape)}, engine "
                         f"{tuple(engine_logp.shape)}, mask {tuple(loss_mask.shape)}")
    keep = loss_mask.bool()
    gap = torch.where(keep, train_logp.detach() - engine_logp.detach().to(train_logp.dtype), 0.0)
    return torch.clamp(torch.exp(gap), max=cap)


def engine_mismatch(train_logp: torch.Tensor, engine_logp: torch.Tensor,
                    loss_mask: torch.Tensor) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the trainer's for the same tokens, over
    the policy tokens of a batch ([B, T] each): ``mismatch_abs_mean`` (mean |delta log p|),
    ``mismatch_kl`` (mean k3 estimate of KL(engine || trainer) from the engine's samples:
    r - 1 - log r with r = pi_train / pi_engine, >= 0), ``mismatch_kl_max`` (its largest token),
    ``mismatch_tokens`` (how many tokens were compared)."""
    if train_logp.shape != engine_logp.shape or train_logp.shape != loss_mask.shape:
        raise ValueError(f"engine_mismatch: shapes differ: train {tuple(train_logp.shape)}, engine "
                         f"{tuple(engine_logp.shape)}, mask {tuple(loss_mask.shape)}")
    keep = loss_mask.bool()
    n = int(keep.sum())
    if n == 0:
        return {"mismatch_tokens": 0.0}
    gap = (train_logp.detach().double() - engine_logp.detach().double())[keep]  # [n] log r
    k3 = torch.exp(gap) - 1.0 - gap
    return {"mismatch_abs_mean": float(gap.abs().mean()), "mismatch_kl": float(k3.mean()),
            "mismatch_kl_max": float(k3.max()), "mismatch_tokens": float(n)}


def _check(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    agg: str,
) -> None:
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    named = {"old_logp": old_logp, "advantages": advantages, "loss_mask": loss_mask}
    if ref_logp is not None:
        named["ref_logp"] = ref_logp
    for name, tensor in named.items():
        if tensor.shape != logp.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, logp has {tuple(logp.shape)}"
            )
    if not torch.all((loss_mask == 0) | (loss_mask == 1)):
        raise ValueError("loss_mask must hold only 0 and 1")
    if not torch.any(loss_mask.bool()):
        raise ValueError("loss_mask selects no token: nothing to train on")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if not kl_coef >= 0.0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0.0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs ref_logp")
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {sorted(AGGREGATIONS)}, got {agg!r}")
