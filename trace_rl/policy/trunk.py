"""Reusing a frozen trunk's output across the passes of one policy update.

With only the top decoder layers trainable (``trace_rl.policy.freeze``), the frozen layers below
compute the same hidden states for a micro-batch in every pass of an update: the old log-probs,
each PPO epoch's forward and backward, and the KL guard's re-scoring. ``FrozenTrunk`` keeps the
output of the last frozen layer from the first pass (the old log-probs, which the update computes
anyway) and later passes run only the trainable layers on it, fed to the model as
``inputs_embeds`` with its layer list cut to the layers above the trunk. The model's own code
still builds the causal mask and the rotary position embeddings (they depend on positions and the
attention mask, not on the hidden states), so the logits are the full forward's.

Cost: one hidden-state tensor per micro-batch ([paths, tokens, hidden size] floats) held for the
update. Saving: the frozen layers' forward in every pass after the first; with SmolLM2-135M and
``trainable_layers=6`` those are 24 of 30 layers (``studies/trunk_reuse.py`` measures it).

A model whose forward does more to ``inputs_embeds`` than to its own embeddings (Gemma scales
both) would give other logits on the cut model; ``PolicyTrainer`` compares the two paths once on
its first micro-batch and turns the reuse off, with a warning, where they differ.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


class FrozenTrunk:
    """The frozen lower ``len(layers) - trainable_layers`` decoder layers of ``model`` (whose
    decoder layers are ``model.model.layers``, as ``freeze_lower_layers`` requires)."""

    def __init__(self, model: Any, trainable_layers: int):
        self.inner = model.model
        self.layers = self.inner.layers
        self.depth = len(self.layers) - trainable_layers
        if not 0 < self.depth < len(self.layers):
            raise ValueError(f"FrozenTrunk: trainable_layers={trainable_layers} leaves no frozen "
                             f"trunk below trainable layers (the model has {len(self.layers)})")

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Within it, each forward of the whole model appends the last frozen layer's output
        (detached) to the yielded list."""
        out: list[torch.Tensor] = []

        def keep(_module: Any, _args: Any, result: Any) -> None:
            hidden = result[0] if isinstance(result, tuple) else result
            out.append(hidden.detach())

        handle = self.layers[self.depth - 1].register_forward_hook(keep)
        try:
            yield out
        finally:
            handle.remove()

    @contextlib.contextmanager
    def top_only(self) -> Iterator[None]:
        """Within it, the model's layer list holds only the trainable layers, so a forward with
        ``inputs_embeds`` = a captured trunk output is the whole model's forward."""
        self.inner.layers = torch.nn.ModuleList(list(self.layers)[self.depth:])
        try:
            yield
        finally:
            self.inner.layers = self.layers
