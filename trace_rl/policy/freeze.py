"""Training only the top decoder layers of a causal LM: what the HotpotQA warm start does, and
what RL on top of it may do (``TrainConfig.trainable_layers``) so that an update of a 135M-parameter
model fits a CPU step. Frozen layers get no gradient, so the backward pass stops at the first
trainable one."""

from __future__ import annotations

from typing import Any

import torch


def freeze_lower_layers(model: Any, trainable_layers: int) -> int:
    """Leave only the top ``trainable_layers`` decoder layers and the final norm trainable (0:
    every parameter); return the number of trainable parameters. The model must keep its decoder
    layers in ``model.model.layers`` and its final norm in ``model.model.norm`` (Llama, Qwen,
    Mistral, SmolLM and the project's tiny preset do)."""
    if trainable_layers <= 0:
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        norm = getattr(inner, "norm", None)
        if layers is None or norm is None:
            raise ValueError(f"trainable_layers={trainable_layers}: {type(model).__name__} keeps no "
                             "decoder layers in model.model.layers and final norm in model.model.norm;"
                             " use trainable_layers=0 (every parameter) for this model")
        if trainable_layers > len(layers):
            raise ValueError(f"trainable_layers={trainable_layers}: the model has only {len(layers)} "
                             "decoder layers")
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in list(layers)[-trainable_layers:]:
            for p in layer.parameters():
                p.requires_grad_(True)
        for p in norm.parameters():
            p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad and
               isinstance(p, torch.nn.Parameter))
