"""Packing a micro-batch's paths into one row without padding, each shared prefix computed once.

A token's logits depend only on the tokens before it, so where two paths of a micro-batch begin
with the same tokens (the paths of one tree share their prompt and the turns above their branch
point; every prompt shares the system prompt) those positions have the same logits in both. A
``Packed`` row holds every distinct prefix once: the micro-batch's token sequences are merged
into a trie (a token is a node under the token before it), laid out in insertion order, each
token at its position in its path (``positions``, the rotary positions the padded batch would
give it), and a token attends to itself and its ancestors only (``mask``, the tree's causal
mask). ``index`` maps each path position back to its row in the pack, so the per-path log-probs,
and the loss and gradients built on them, are those of the padded batch (to float rounding):
the gradient of a shared position is the sum of its paths' gradients, as it is when each path
computes it separately.

What it saves: the rows of padding, and every repeated prefix. On the default run's steps (48
paths from 16 trees, 8 paths per micro-batch) a micro-batch's 1,300-2,150 padded positions hold
180-650 distinct prefixes. What it costs: attention over the whole row (``mask`` is dense, so a
row of U tokens pays U x U score pairs where the padded batch pays B x T x T); ``worth_packing``
compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Packed:
    """One micro-batch of B paths (the longest T tokens) as one row of U distinct prefixes."""

    ids: torch.Tensor
    """[1, U] token of each row position."""
    positions: torch.Tensor
    """[1, U] its position within its path (0 = a path's first token)."""
    mask: torch.Tensor
    """[1, 1, U, U] bool: query u attends to key v (v is u or an ancestor of u)."""
    index: torch.Tensor
    """[B, T] row position of each path position (0 past a path's end, which the padded batch
    masks out)."""

    @property
    def size(self) -> int:
        return int(self.ids.shape[1])


def pack(token_ids: Sequence[Sequence[int]]) -> Packed:
    """The trie of ``token_ids`` (one sequence per path) as a ``Packed`` row, laid out in the
    sequences' sorted order."""
    T = max(len(s) for s in token_ids)
    index = np.zeros((len(token_ids), T), dtype=np.int64)
    node: dict[tuple[int, int], int] = {}  # (parent row, token) -> row
    ids: list[int] = []
    positions: list[int] = []
    parent: list[int] = []
    # in sorted order: the same paths in any order make the same row (to the last bit)
    for b in sorted(range(len(token_ids)), key=lambda b: list(token_ids[b])):
        seq, up = token_ids[b], -1
        for t, tok in enumerate(seq):
            row = node.get((up, int(tok)))
            if row is None:
                row = node[(up, int(tok))] = len(ids)
                ids.append(int(tok))
                positions.append(t)
                parent.append(up)
            index[b, t] = up = row
    U = len(ids)
    mask = np.zeros((U, U), dtype=bool)
    for u, p in enumerate(parent):  # a parent precedes its children: its row is complete
        if p >= 0:
            mask[u] = mask[p]
        mask[u, u] = True
    return Packed(ids=torch.tensor([ids], dtype=torch.long),
                  positions=torch.tensor([positions], dtype=torch.long),
                  mask=torch.from_numpy(mask)[None, None], index=torch.from_numpy(index))


def worth_packing(packed: Packed, batch: int, length: int, config: Any) -> bool:
    """Whether the packed row costs fewer FLOPs than the padded [batch, length] batch, counting
    per token the decoder's matmuls (about 2 h^2 + 1.5 h i score-pair equivalents per layer, h
    the hidden size and i the MLP width of ``config``) and per attended pair the scores and the
    weighted sum (2 multiply-adds per hidden unit)."""
    h = int(getattr(config, "hidden_size", 0) or 0)
    i = int(getattr(config, "intermediate_size", 0) or 4 * h)
    per_token = 2 * h + 1.5 * i  # a token's matmul FLOPs in units of one attended pair's
    U = packed.size
    return U * per_token + U * U <= batch * length * per_token + batch * length * length


def model_mask(model: Any, packed: Packed) -> torch.Tensor:
    """``packed.mask`` as the model's attention takes a ready 4D mask: bool (True = attend) for
    SDPA and flex attention, additive float (0 or the dtype's minimum) for the eager kernel."""
    inner = getattr(model, "module", model)  # DistributedDataParallel wraps the model
    kind = getattr(inner.config, "_attn_implementation", "sdpa")
    if kind == "eager":
        dtype = next(inner.parameters()).dtype
        return torch.zeros(packed.mask.shape, dtype=dtype).masked_fill(
            ~packed.mask, torch.finfo(dtype).min)
    return packed.mask


VERDICTS: dict[str, bool] = {}
"""Per model shape (``shape_key``): whether a packed micro-batch gave the padded batch's
log-probs when this process first checked (``packing_agrees``). Whether it does depends on the
architecture and its attention code, not on the weights, so every trainer of a process (one per
step in a benchmark, one per resumed run) shares the one check."""


def shape_key(model: Any) -> str:
    """What decides whether packing reproduces the padded batch: the model's class, dtype and
    configuration (without the directory it was loaded from)."""
    import json

    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    return f"{type(model).__name__}:{model.dtype}:{json.dumps(config, sort_keys=True, default=str)}"


def packing_agrees(model: Any, gap: Any, tol: float = 1e-4) -> tuple[bool, float | None]:
    """(whether ``model``'s shape packs right, the gap measured now or None when an earlier
    check of this process decided): ``gap()`` gives the largest |packed - padded| log-prob of a
    micro-batch and runs once per process and shape (``VERDICTS``)."""
    key = shape_key(model)
    if key in VERDICTS:
        return VERDICTS[key], None
    measured = float(gap())
    VERDICTS[key] = measured <= tol
    return VERDICTS[key], measured
