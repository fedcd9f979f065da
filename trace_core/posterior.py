"""A per-prompt Beta posterior for the success rate of recurring prompts, shrunk to a prior.

Why: the shared predictor (``trace_core.predictor``) reads a prompt's text. On a family whose
prompts recur (a train pool visited every ~8 steps) a prompt's difficulty is often hidden from its
text: an alias or a homonym in the knowledge base, not a visible cue. Hashed n-grams over a short
replay window never learn it, so the predictor cannot rank prompts (on synth_chain: within-step
root AUC 0.50-0.63), and Stage 1 has nothing to target. The rollouts themselves do carry it: a prompt that
was solved 0 times in 8 is hard, whatever its text says.

The posterior keeps, per prompt id, the successes s and rollouts n observed so far, and predicts

    V~(prompt) = (s + k p) / (n + k)

the mean of Beta(s + k p, n - s + k (1 - p)): a Beta prior whose mean is p, the text predictor's
estimate for that prompt, worth k = ``strength`` pseudo-rollouts. An unseen prompt (n = 0) gets
p exactly; as n grows the estimate moves to the observed rate s / n. The prior enters at predict
time, so a text predictor that improves keeps improving the prompts seen rarely.

Pure numpy; no I/O. ``state_dict`` / ``load_state_dict`` carry the counts across a restart.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class PromptPosterior:
    """Success/rollout counts per prompt id, predicting (s + k p) / (n + k) with p the prior."""

    def __init__(self, strength: float = 4.0):
        strength = float(strength)
        if not np.isfinite(strength) or strength <= 0.0:
            raise ValueError(f"PromptPosterior: strength={strength} must be a finite number > 0 "
                             "(the prior's weight in pseudo-rollouts)")
        self.strength = strength
        self._successes: dict[str, float] = {}
        self._counts: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._counts)

    @staticmethod
    def _ids(prompt_ids: Sequence[str], where: str) -> list[str]:
        if isinstance(prompt_ids, (str, bytes)):
            raise ValueError(f"PromptPosterior.{where}: prompt_ids must be a sequence of ids, "
                             "got a single string")
        ids = list(prompt_ids)
        for i, pid in enumerate(ids):
            if not isinstance(pid, str):
                raise ValueError(f"PromptPosterior.{where}: prompt_ids[{i}] is "
                                 f"{type(pid).__name__}, not str")
        return ids

    def update(self, prompt_ids: Sequence[str], successes: np.ndarray,
               counts: np.ndarray) -> None:
        """Add ``successes[i]`` successes out of ``counts[i]`` rollouts to prompt ``prompt_ids[i]``.

        A prompt id may appear more than once; its entries add up. Successes may be fractional
        (a reward in [0, 1] per rollout).
        """
        ids = self._ids(prompt_ids, "update")
        s = np.asarray(successes, dtype=np.float64)
        n = np.asarray(counts, dtype=np.float64)
        if s.shape != (len(ids),) or n.shape != (len(ids),):
            raise ValueError(f"PromptPosterior.update: {len(ids)} prompt ids but successes has "
                             f"shape {s.shape} and counts {n.shape}; need one of each per id")
        if not (np.all(np.isfinite(s)) and np.all(np.isfinite(n))):
            raise ValueError("PromptPosterior.update: successes and counts must be finite")
        bad = np.flatnonzero((n < 0) | (s < 0) | (s > n))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"PromptPosterior.update: prompt {ids[i]!r} (index {i}) has "
                             f"successes={s[i]} out of counts={n[i]}; need 0 <= successes <= "
                             "counts")
        for pid, si, ni in zip(ids, s, n):
            self._successes[pid] = self._successes.get(pid, 0.0) + float(si)
            self._counts[pid] = self._counts.get(pid, 0.0) + float(ni)

    def counts(self, prompt_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """([B] successes, [B] rollouts) observed so far; zeros for unseen prompts."""
        ids = self._ids(prompt_ids, "counts")
        s = np.array([self._successes.get(pid, 0.0) for pid in ids], dtype=np.float64)
        n = np.array([self._counts.get(pid, 0.0) for pid in ids], dtype=np.float64)
        return s, n

    def predict(self, prompt_ids: Sequence[str], prior: np.ndarray) -> np.ndarray:
        """[B] posterior means (s + k p) / (n + k), ``prior[i]`` = p for ``prompt_ids[i]``."""
        ids = self._ids(prompt_ids, "predict")
        p = np.asarray(prior, dtype=np.float64)
        if p.shape != (len(ids),):
            raise ValueError(f"PromptPosterior.predict: {len(ids)} prompt ids but prior has "
                             f"shape {p.shape}; need one prior per id")
        if not np.all(np.isfinite(p)) or np.any(p < 0.0) or np.any(p > 1.0):
            raise ValueError("PromptPosterior.predict: prior must lie in [0, 1]")
        s, n = self.counts(ids)
        k = self.strength
        return (s + k * p) / (n + k)

    def state_dict(self) -> dict[str, Any]:
        ids = sorted(self._counts)
        return {
            "strength": self.strength,
            "prompt_ids": ids,
            "successes": [self._successes[i] for i in ids],
            "counts": [self._counts[i] for i in ids],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace strength and counts with those of ``state`` (from ``state_dict``)."""
        missing = {"strength", "prompt_ids", "successes", "counts"} - set(state)
        if missing:
            raise ValueError(f"PromptPosterior.load_state_dict: state lacks {sorted(missing)}")
        fresh = PromptPosterior(state["strength"])
        ids = list(state["prompt_ids"])
        if len(set(ids)) != len(ids):
            raise ValueError("PromptPosterior.load_state_dict: duplicate prompt ids in state")
        fresh.update(ids, np.asarray(state["successes"], dtype=np.float64),
                     np.asarray(state["counts"], dtype=np.float64))
        self.strength = fresh.strength
        self._successes = fresh._successes
        self._counts = fresh._counts


def oracle_values(text: np.ndarray, oracle: np.ndarray, seen_oracle: np.ndarray,
                  successes: np.ndarray, rollouts: np.ndarray) -> np.ndarray:
    """c o_i for each candidate, o_i its oracle success rate and c the policy's success relative
    to the oracle: ``successes`` over the o-weighted ``rollouts`` of the prompts seen so far
    (``seen_oracle``, one per seen prompt); before any, the text predictions' mean ``text``
    against the candidates' mean o. Clipped to [0, 1]."""
    o = np.asarray(oracle, dtype=np.float64)
    if len(seen_oracle):
        mass = float(np.dot(seen_oracle, rollouts))
        c = float(np.sum(successes)) / mass if mass > 0 else 0.0
    else:
        c = float(np.mean(text)) / float(np.mean(o)) if np.mean(o) > 0 else 0.0
    return np.clip(c * o, 0.0, 1.0)


def root_values(text: np.ndarray, item_ids: Sequence[str], seen_ids: Sequence[str],
                successes: np.ndarray, rollouts: np.ndarray, *, strength: float = 0.0,
                oracle: np.ndarray | None = None, seen_oracle: np.ndarray | None = None,
                measured: np.ndarray | None = None) -> np.ndarray:
    """Stage 1's V~ of the candidates ``item_ids``: the text predictor's ``text``; with
    ``measured``, the candidates' success rates measured by extra rollouts of the current policy
    (a Monte-Carlo oracle), as they are: already the policy's own, nothing to scale; with
    ``oracle`` (and ``seen_oracle``), ``oracle_values``; else with ``strength`` > 0 the
    per-prompt posterior of the bare rollouts so far (``seen_ids``: ``successes`` of
    ``rollouts`` each) shrunk towards ``text``."""
    text = np.asarray(text, dtype=np.float64)
    if measured is not None:
        return np.clip(np.asarray(measured, dtype=np.float64), 0.0, 1.0)
    if oracle is not None:
        return oracle_values(text, oracle, np.asarray(seen_oracle, np.float64), successes,
                             rollouts)
    if strength > 0:
        posterior = PromptPosterior(strength)
        posterior.update(list(seen_ids), np.asarray(successes, np.float64),
                         np.asarray(rollouts, np.float64))
        return posterior.predict(list(item_ids), text)
    return text
