"""Clipped token-level policy-gradient loss with an observation mask and an optional KL term.

DESIGN.md section 1, "Tree-aware policy update": every root-to-leaf path is a sequence, and only
policy-generated tokens (thoughts and actions) carry loss; prompt, tool-call results and
observations are masked out. Per token t of sequence b, with ratio rho = exp(logp - old_logp)::

    pg   = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))     (PPO; DAPO clip-higher)
    pg   = min(pg, -A c)   where A < 0, with clip_ratio_c = c > 1        (dual clip, optional)
    kl   = exp(ref - logp) - (ref - logp) - 1                           (k3 estimator, >= 0)
    loss = agg(pg + kl_coef * kl, mask)

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
    return loss, stats


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
