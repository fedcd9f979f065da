"""Per-token log-probabilities of a causal LM and the position-wise KL the update's guard reads
(``trace_rl.policy.update``): the log-prob of each sampled token given its prefix, the top-k of
each next-token distribution, and KL(old || new) of that distribution at one position."""

from __future__ import annotations

import torch

from trace_rl.policy.packing import Packed, model_mask


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor,
                   hidden: torch.Tensor | None = None, packed: Packed | None = None
                   ) -> torch.Tensor:
    """[B, T] log-prob of each token given its prefix (position 0 gets 0: it has no prefix).
    ``hidden``: the model's layers start from it instead of ``ids``' embeddings (a frozen trunk's
    output, with the model cut to the layers above it: ``trace_rl.policy.trunk``). ``packed``:
    the model runs on the batch's packed row (``trace_rl.policy.packing``) instead of the padded
    ``ids``, and ``hidden`` is the packed row's."""
    if packed is None:
        return _token_logprobs(_next_token_logprobs(model, ids, attn, hidden), ids)
    rows = _packed_logprobs(model, packed, hidden)  # [U, V]
    return torch.nn.functional.pad(rows[packed.index[:, :-1], ids[:, 1:]], (1, 0))


TOP_K = 16
"""Tokens of the sampling policy's next-token distribution kept per position for the
position-wise KL (``position_kl``): its top-k, the rest pooled into one outcome."""


def _packed_logprobs(model: torch.nn.Module, packed: Packed,
                     hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[U, V] log-softmax of the logits at each position of the packed row (row u predicts the
    token after u in every path through u)."""
    kw = {"attention_mask": model_mask(model, packed), "position_ids": packed.positions}
    if hidden is None:
        logits = model(input_ids=packed.ids, **kw).logits
    else:
        logits = model(inputs_embeds=hidden, use_cache=False, **kw).logits
    return torch.log_softmax(logits[0].float(), dim=-1)


def _next_token_logprobs(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor,
                         hidden: torch.Tensor | None = None, packed: Packed | None = None
                         ) -> torch.Tensor:
    """[B, T-1, V] log-softmax of the logits at positions 0 .. T-2 (each predicts the next token)."""
    if packed is not None:
        return _packed_logprobs(model, packed, hidden)[packed.index[:, :-1]]
    if hidden is None:
        logits = model(input_ids=ids, attention_mask=attn).logits.float()  # [B, T, V]
    else:
        logits = model(inputs_embeds=hidden, attention_mask=attn, use_cache=False).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1)


def _token_logprobs(dist: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(dist.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))  # [B, T]


def with_top(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor,
             keep: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
             packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``token_logprobs``; ids [B, T, k] and their next-token log-probs [B, T, k] per token
    position: the ids of ``keep``, or (None) the top ``TOP_K`` of the distribution). Used only
    without gradient (the guard), so the training forward pays nothing for it. ``hidden``: as
    ``token_logprobs``', and so is ``packed``."""
    dist = _next_token_logprobs(model, ids, attn, hidden, packed)  # [B, T-1, V]
    if keep is None:
        top = dist.topk(min(TOP_K, dist.shape[-1]), dim=-1).indices  # [B, T-1, k]
    else:
        top = keep[:, 1:]
    part = torch.nn.functional.pad(dist.gather(-1, top), (0, 0, 1, 0))  # [B, T, k]; position 0: none
    return _token_logprobs(dist, ids), torch.nn.functional.pad(top, (0, 0, 1, 0)), part


def position_kl(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[B, T] KL(old || new) of the next-token distribution at each position, on the partition
    {the old distribution's top-k ids, everything else} (a lower bound of the full KL, exact
    when the rest carries no mass). ``old``/``new``: [B, T, k] log-probs of the same ids.

    Where the sampled-token k3 of ``policy_loss`` is largest when a rare sampled token gains
    (ratio >> 1), this is largest when the mass of a likely token moves: a turn's first token
    falling from 0.94 to 0.02 gives ~3.5 here and ~2.8 as k3, while a sampled 0.01 -> 0.3 gives
    ~0.3 here and ~26 as k3. Hence a guard on this, not on k3, for a collapsing first token."""
    p_old, p_new = old.exp(), new.exp()
    rest_old = (1.0 - p_old.sum(-1)).clamp_min(0.0)  # [B, T]
    rest_new = (1.0 - p_new.sum(-1)).clamp_min(1e-12)
    top = (p_old * (old - new)).sum(-1)
    rest = torch.where(rest_old > 1e-12, rest_old * (rest_old.clamp_min(1e-12).log() - rest_new.log()),
                       torch.zeros_like(rest_old))
    return (top + rest).clamp_min(0.0)
