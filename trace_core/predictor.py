"""The shared value predictor V~(H) ~ V(H) = P(r = 1 | H), for roots and prefixes alike.

docs/algorithm.md: Stage 1 scores prompts (depth-0 histories) and Stage 2 scores turn-level
prefixes with the same predictor; after each step it regresses V~(H_y) onto the backed-up
target V^(y) (MSE, optionally weighted by the leaf count n_y), online, on that step's trees,
with a replay window of recent steps.

A predictor is a featuriser (histories -> [B, F] float tensor) followed by a head (a small MLP
with a sigmoid output). ``HashedNgramFeaturizer`` needs no download; a text encoder or the
policy's hidden states plug in as another ``Featurizer``.

Also here: calibration and ranking metrics (Brier, ECE, AUC) in pure numpy.

Departures from the paper: the paper's predictor architecture is not given in the paper; the
hashed n-gram head is this project's download-free default.
"""

from __future__ import annotations

import copy
import hashlib
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from trace_core.seeds import GLOBAL_TORCH_RNG


class Predictor(Protocol):
    """Histories in, V~ in [0, 1] out; learns online from (history, target, weight)."""

    def predict(self, histories: Sequence[str]) -> np.ndarray:
        """[B] predicted success probabilities."""
        ...

    def fit(
        self, histories: Sequence[str], targets: np.ndarray, weights: np.ndarray | None = None
    ) -> dict[str, float]:
        """One online update on these examples (and any replay); returns statistics."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Featurizer(Protocol):
    """Maps histories to a fixed-width float feature matrix."""

    dim: int

    def __call__(self, histories: Sequence[str]) -> torch.Tensor:
        """[B, dim] float32 features, dense or sparse COO."""
        ...


# ---- hashed n-gram featuriser ------------------------------------------------------------------


@dataclass(frozen=True)
class HashedNgramConfig:
    """Hashed bag of word n-grams and character n-grams."""

    dim: int = 4096
    """Number of hash buckets F (the feature width)."""
    word_ngrams: tuple[int, ...] = (1, 2)
    """Word n-gram orders (whitespace tokens)."""
    char_ngrams: tuple[int, ...] = ()
    """Character n-gram orders within words; empty disables them."""

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"HashedNgramConfig.dim must be >= 1, got {self.dim}")
        if any(n < 1 for n in self.word_ngrams + self.char_ngrams):
            raise ValueError("HashedNgramConfig: n-gram orders must be >= 1")
        if not self.word_ngrams and not self.char_ngrams:
            raise ValueError("HashedNgramConfig: enable at least one of word_ngrams, char_ngrams")


class HashedNgramFeaturizer:
    """log(1 + count) of hashed n-grams. Hashing uses blake2b, so features are stable across runs
    (Python's built-in ``hash`` is salted per process)."""

    def __init__(self, config: HashedNgramConfig = HashedNgramConfig()):
        self.config = config
        self.dim = config.dim
        self._sparse = lru_cache(maxsize=200_000)(self._sparse_uncached)

    def __call__(self, histories: Sequence[str]) -> torch.Tensor:
        # Sparse COO [B, F]: a history has a few dozen n-grams out of F buckets, and repeated
        # dense [B, F] buffers fragment the allocator's heap over a long online run.
        rows, cols, vals = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0)]
        for row, text in enumerate(histories):
            idx, val = self._sparse(text)
            rows.append(torch.full_like(idx, row))
            cols.append(idx)
            vals.append(val)
        indices = torch.stack([torch.cat(rows), torch.cat(cols)])  # [2, nnz]
        shape = (len(histories), self.dim)
        # Indices are unique per row (np.unique), so the tensor is valid without the check.
        return torch.sparse_coo_tensor(indices, torch.cat(vals), shape, check_invariants=False).coalesce()

    def _sparse_uncached(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        words = text.split()
        grams = [" ".join(words[i : i + n]) for n in self.config.word_ngrams for i in range(len(words) - n + 1)]
        for n in self.config.char_ngrams:
            for w in words:
                padded = f"<{w}>"
                grams += ["#" + padded[i : i + n] for i in range(len(padded) - n + 1)]
        buckets = np.fromiter((_bucket(g, self.dim) for g in grams), dtype=np.int64, count=len(grams))
        idx, counts = np.unique(buckets, return_counts=True)
        return torch.from_numpy(idx), torch.from_numpy(np.log1p(counts).astype(np.float32))


@lru_cache(maxsize=500_000)
def _bucket(gram: str, dim: int) -> int:
    return int.from_bytes(hashlib.blake2b(gram.encode(), digest_size=8).digest(), "little") % dim


# ---- featuriser + head ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadConfig:
    """The regression head and its online training."""

    hidden: int = 64
    """Hidden width of the MLP head; 0 gives a linear (logistic) head."""
    lr: float = 3e-3
    """Adam learning rate."""
    weight_decay: float = 1e-5
    """Adam (L2) weight decay."""
    epochs: int = 3
    """Passes over the replay window per ``fit`` call."""
    batch_size: int = 256
    """Minibatch size."""
    replay_steps: int = 4
    """How many recent ``fit`` calls (steps) the replay window keeps, this one included."""
    seed: int = 0
    """Seeds the head's initialisation and minibatch shuffling (an explicit torch.Generator)."""

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "replay_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"HeadConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden < 0 or self.lr <= 0 or self.weight_decay < 0:
            raise ValueError("HeadConfig: hidden >= 0, lr > 0 and weight_decay >= 0 are required")


class FeaturePredictor:
    """V~(H) = sigmoid(head(featurize(H))), fit by weighted MSE on a replay window."""

    def __init__(self, featurizer: Featurizer, config: HeadConfig = HeadConfig()):
        self.featurizer = featurizer
        self.config = config
        self._gen = torch.Generator().manual_seed(config.seed)
        with GLOBAL_TORCH_RNG:  # no other thread seeds or draws in between
            torch_state = torch.random.get_rng_state()
            # nn.Linear draws its init from the global CPU generator. Seeded alone:
            # torch.manual_seed also queues a CUDA seeding with a formatted stack trace while
            # CUDA is not initialised (~5 ms a call deep inside a flow, the queue growing a call).
            torch.random.default_generator.manual_seed(config.seed)
            try:
                first = torch.nn.Linear(featurizer.dim, config.hidden or 1)
                rest = (
                    torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(config.hidden, 1))
                    if config.hidden
                    else torch.nn.Identity()
                )
                self.head = torch.nn.ModuleDict({"first": first, "rest": rest})
            finally:
                torch.random.set_rng_state(torch_state)
        self.optimizer = torch.optim.Adam(self.head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        # One entry per fit call: (histories, targets [n], weights [n]).
        self._replay: deque[tuple[list[str], np.ndarray, np.ndarray]] = deque(maxlen=config.replay_steps)

    def predict(self, histories: Sequence[str]) -> np.ndarray:
        if len(histories) == 0:
            return np.zeros(0)
        with torch.no_grad():
            out = [self._forward(histories[i : i + 4096]) for i in range(0, len(histories), 4096)]
        return torch.cat(out).double().numpy()  # [B]

    def fit(
        self, histories: Sequence[str], targets: np.ndarray, weights: np.ndarray | None = None
    ) -> dict[str, float]:
        targets = np.asarray(targets, dtype=np.float64)
        weights = np.ones_like(targets) if weights is None else np.asarray(weights, dtype=np.float64)
        if targets.shape != (len(histories),) or weights.shape != targets.shape:
            raise ValueError(
                f"fit: histories ({len(histories)}), targets {targets.shape} and weights {weights.shape} must have equal length"
            )
        if not np.all((targets >= 0) & (targets <= 1)):
            raise ValueError("fit: targets must lie in [0, 1] (no NaN)")
        if not np.all(weights >= 0) or not np.isfinite(weights).all():
            raise ValueError("fit: weights must be finite and >= 0")
        self._replay.append((list(histories), targets, weights))
        hist = [text for step_hist, _, _ in self._replay for text in step_hist]
        y = torch.from_numpy(np.concatenate([t for _, t, _ in self._replay])).float()  # [N]
        w = torch.from_numpy(np.concatenate([w for _, _, w in self._replay])).float()  # [N]
        if len(hist) == 0 or float(w.sum()) == 0.0:
            return {"loss": float("nan"), "examples": float(len(hist))}
        w = w / w.mean()
        losses = []
        self.head.train()
        for _ in range(self.config.epochs):
            order = torch.randperm(len(hist), generator=self._gen)
            for start in range(0, len(hist), self.config.batch_size):
                batch = order[start : start + self.config.batch_size]
                pred = self._forward([hist[i] for i in batch])  # [b]
                loss = (w[batch] * (pred - y[batch]) ** 2).mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()
                losses.append(loss.item())
        self.head.eval()
        return {"loss": float(np.mean(losses[-max(1, len(losses) // self.config.epochs) :])), "examples": float(len(hist))}

    def _forward(self, histories: Sequence[str]) -> torch.Tensor:
        x = self.featurizer(histories)  # [B, F]
        first = self.head["first"]
        z = (torch.sparse.mm(x, first.weight.t()) if x.is_sparse else x @ first.weight.t()) + first.bias  # [B, H]
        return torch.sigmoid(self.head["rest"](z).squeeze(-1))  # [B]

    def state_dict(self) -> dict[str, Any]:
        # A snapshot: torch's state dicts hold live references to parameters and Adam moments.
        return copy.deepcopy(
            {
                "head": self.head.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generator": self._gen.get_state(),
                "replay": [(list(h), t, w) for h, t, w in self._replay],
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._gen.set_state(state["generator"])
        self._replay.clear()
        self._replay.extend((list(h), np.asarray(t), np.asarray(w)) for h, t, w in state["replay"])


class HashedNgramPredictor(FeaturePredictor):
    """The download-free default: hashed n-gram features + MLP head."""

    def __init__(self, features: HashedNgramConfig = HashedNgramConfig(), head: HeadConfig = HeadConfig()):
        super().__init__(HashedNgramFeaturizer(features), head)


class ConstantPredictor:
    """Predicts the weighted mean target seen so far (the base rate): the reference for Brier."""

    def __init__(self, prior: float = 0.5):
        self._sum, self._weight, self._prior = 0.0, 0.0, prior

    @property
    def value(self) -> float:
        return self._sum / self._weight if self._weight > 0 else self._prior

    def predict(self, histories: Sequence[str]) -> np.ndarray:
        return np.full(len(histories), self.value)

    def fit(
        self, histories: Sequence[str], targets: np.ndarray, weights: np.ndarray | None = None
    ) -> dict[str, float]:
        targets = np.asarray(targets, dtype=np.float64)
        weights = np.ones_like(targets) if weights is None else np.asarray(weights, dtype=np.float64)
        self._sum += float(weights @ targets)
        self._weight += float(weights.sum())
        return {"value": self.value}

    def state_dict(self) -> dict[str, Any]:
        return {"sum": self._sum, "weight": self._weight, "prior": self._prior}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sum, self._weight, self._prior = state["sum"], state["weight"], state["prior"]


# ---- metrics ---------------------------------------------------------------------------------------


def _check_pair(p: np.ndarray, y: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(p, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if p.ndim != 1 or p.shape != y.shape:
        raise ValueError(f"{name}: p and y must be 1-D of equal length, got {p.shape} and {y.shape}")
    if p.size == 0:
        raise ValueError(f"{name}: empty input")
    if not (np.all((p >= 0) & (p <= 1)) and np.all((y >= 0) & (y <= 1))):
        raise ValueError(f"{name}: p and y must lie in [0, 1] (no NaN)")
    return p, y


def brier(p: np.ndarray, y: np.ndarray) -> float:
    """Mean squared error between probabilities p and outcomes (or target rates) y."""
    p, y = _check_pair(p, y, "brier")
    return float(np.mean((p - y) ** 2))


def ece(p: np.ndarray, y: np.ndarray, n_bins: int = 10) -> float:
    """Expected calibration error: sum_b (n_b / n) |mean p_b - mean y_b| over equal-width bins
    [0, 1/n_bins), ..., [1 - 1/n_bins, 1] (p = 1 falls in the last bin)."""
    p, y = _check_pair(p, y, "ece")
    if n_bins < 1:
        raise ValueError(f"ece: n_bins must be >= 1, got {n_bins}")
    bins = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)  # [n]
    # n_b |mean p_b - mean y_b| = |sum p_b - sum y_b|
    gap = np.abs(np.bincount(bins, weights=p, minlength=n_bins) - np.bincount(bins, weights=y, minlength=n_bins))
    return float(gap.sum() / p.size)


def auc(p: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve = P(p_pos > p_neg) + 0.5 P(p_pos = p_neg), by average ranks."""
    p, y = _check_pair(p, y, "auc")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("auc: y must be binary (0 or 1)")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("auc: y must hold both classes")
    order = np.argsort(p, kind="mergesort")
    sorted_p = p[order]
    ranks = np.empty(p.size)
    # Tied scores share the average of the ranks they span (1-based).
    starts = np.flatnonzero(np.r_[True, sorted_p[1:] != sorted_p[:-1]])
    ends = np.r_[starts[1:], p.size]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
