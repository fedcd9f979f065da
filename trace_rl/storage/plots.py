"""Figures logged to MLflow: a rollout tree, predictor calibration, reward-contrast curves.

``render_tree`` draws trace_core's struct-of-arrays tree (parent[i] < i, -1 at a root), the same
arrays the nodes table stores: internal nodes coloured by the backed-up V^(H) (§1 backup
targets), leaves by their reward r. ``calibration_plot`` bins the predictor's V~ against observed
outcomes, the check that V~ is a probability the allocator may trust. ``contrast_curve`` plots a
per-step metric (e.g. the effective ratio) per method. Uses the Agg backend: no display needed.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

_CMAP = "RdYlGn"  # red = fails, green = succeeds


def _as_1d(name: str, x: Sequence[float], n: int | None = None) -> np.ndarray:
    a = np.asarray(x, dtype=float)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if n is not None and len(a) != n:
        raise ValueError(f"{name} has {len(a)} entries, expected {n} (one per node)")
    return a


def tree_layout(parent: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """x, y of each node: leaves at consecutive x in depth-first order, a parent centred over
    its children, y = -depth. Several roots (a forest) sit side by side."""
    par = np.asarray(parent, dtype=int)  # [N]
    n = len(par)
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(par):
        if p >= i or p < -1:
            raise ValueError(f"parent[{i}] = {p}: need -1 (root) or 0 <= parent[i] < i")
        if p >= 0:
            children[p].append(i)
    depth = np.zeros(n, dtype=int)
    for i in range(n):
        if par[i] >= 0:
            depth[i] = depth[par[i]] + 1
    x = np.zeros(n)
    next_x = 0.0
    # Iterative post-order so deep trees do not hit the recursion limit.
    for root in np.flatnonzero(par == -1):
        stack = [(int(root), False)]
        while stack:
            i, expanded = stack.pop()
            if not children[i]:
                x[i], next_x = next_x, next_x + 1.0
            elif expanded:
                x[i] = np.mean(x[children[i]])
            else:
                stack.append((i, True))
                stack.extend((c, False) for c in reversed(children[i]))
        next_x += 0.5  # a gap between trees
    return x, -depth.astype(float)


def render_tree(parent: Sequence[int], value: Sequence[float], reward: Sequence[float],
                labels: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """Draw a rollout tree. ``value`` is V^ per node (NaN where unknown), ``reward`` r per node
    (NaN at internal nodes); a node with a reward is drawn as a leaf (square)."""
    n = len(parent)
    v = _as_1d("value", value, n)
    r = _as_1d("reward", reward, n)
    x, y = tree_layout(parent)
    leaf = ~np.isnan(r)
    colour = np.where(leaf, r, v)  # [N] what each node is coloured by
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * (x.max() + 1)), max(3.0, 0.9 * (1 - y.min()))))
    for i, p in enumerate(parent):
        if p >= 0:
            ax.plot([x[p], x[i]], [y[p], y[i]], color="0.6", lw=0.8, zorder=1)
    norm = matplotlib.colors.Normalize(0.0, 1.0)
    known = ~np.isnan(colour)
    for mask, marker in ((~leaf, "o"), (leaf, "s")):
        m = mask & known
        ax.scatter(x[m], y[m], c=colour[m], cmap=_CMAP, norm=norm, marker=marker, s=70,
                        edgecolors="k", linewidths=0.5, zorder=2)
        u = mask & ~known
        ax.scatter(x[u], y[u], facecolors="white", marker=marker, s=70, edgecolors="0.4",
                   linewidths=0.5, zorder=2)
    if labels is not None:
        if len(labels) != n:
            raise ValueError(f"labels has {len(labels)} entries, expected {n}")
        for i, text in enumerate(labels):
            ax.annotate(text, (x[i], y[i]), textcoords="offset points", xytext=(0, 7), ha="center",
                        fontsize=6)
    fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=_CMAP), ax=ax, label="V^ (circles) / reward (squares)")
    ax.set_yticks(np.unique(y), [str(int(-d)) for d in np.unique(y)])
    ax.set_ylabel("depth (turns)")
    ax.set_xticks([])
    ax.set_title(title or f"rollout tree: {n} nodes, {int(leaf.sum())} leaves")
    fig.tight_layout()
    return fig


def calibration_plot(p: Sequence[float], y: Sequence[float], bins: int = 10,
                     title: str | None = None) -> Figure:
    """Reliability diagram of predictions p in [0, 1] against outcomes y (0/1 or success rates),
    with the expected calibration error and the Brier score in the title."""
    p = _as_1d("p", p)
    y = _as_1d("y", y, len(p))
    if len(p) == 0:
        raise ValueError("calibration_plot needs at least one prediction")
    if np.any((p < 0) | (p > 1)) or np.any(np.isnan(p)):
        raise ValueError("p must lie in [0, 1]")
    edges = np.linspace(0.0, 1.0, bins + 1)
    idx = np.clip(np.digitize(p, edges[1:-1]), 0, bins - 1)  # [N] bin of each prediction
    count = np.bincount(idx, minlength=bins)
    mean_p = np.bincount(idx, weights=p, minlength=bins) / np.maximum(count, 1)
    mean_y = np.bincount(idx, weights=y, minlength=bins) / np.maximum(count, 1)
    ece = float(np.sum(count * np.abs(mean_p - mean_y)) / len(p))
    brier = float(np.mean((p - y) ** 2))
    fig, (ax, hx) = plt.subplots(2, 1, figsize=(4.5, 5.5), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], ls="--", color="0.5", lw=0.8, label="perfect")
    used = count > 0
    ax.plot(mean_p[used], mean_y[used], "o-", label="predictor")
    ax.set_ylabel("observed success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left")
    ax.set_title(title or f"calibration: ECE {ece:.3f}, Brier {brier:.3f}, n={len(p)}")
    hx.bar(edges[:-1], count, width=1.0 / bins, align="edge", color="0.7", edgecolor="k")
    hx.set_xlabel("predicted V~")
    hx.set_ylabel("count")
    fig.tight_layout()
    return fig


def contrast_curve(steps: Sequence[int], series: Mapping[str, Sequence[float]],
                   ylabel: str = "effective ratio (mixed roots)", title: str | None = None) -> Figure:
    """One line per method over training steps, e.g. the share of prompts with mixed outcomes."""
    s = _as_1d("steps", steps)
    if not series:
        raise ValueError("contrast_curve needs at least one series")
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for name, values in series.items():
        ax.plot(s, _as_1d(f"series[{name!r}]", values, len(s)), marker="o", ms=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` values (fewer at the start), one per value."""
    v = _as_1d("values", values)
    if window < 1:
        raise ValueError(f"moving_average: window={window} must be >= 1")
    c = np.concatenate([[0.0], np.cumsum(v)])
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def reward_curve(steps: Sequence[int], rewards: Sequence[float], window: int = 3,
                 evals: Mapping[int, tuple[float, float, float]] | None = None,
                 title: str | None = None) -> Figure:
    """A run's training reward per step, its trailing ``window``-step mean, and held-out accuracy
    with its interval at the steps in ``evals`` (step -> (accuracy, low, high))."""
    s = _as_1d("steps", steps)
    r = _as_1d("rewards", rewards, len(s))
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.plot(s, r, marker="o", ms=3, alpha=0.4, label="reward (leaves of the step)")
    if len(r):
        ax.plot(s, moving_average(r, window), lw=2, label=f"moving average ({window} steps)")
    for i, (step, (acc, lo, hi)) in enumerate(sorted((evals or {}).items())):
        ax.errorbar([step], [acc], yerr=[[acc - lo], [hi - acc]], fmt="s", color="black",
                    capsize=4, label="held-out accuracy (95% CI)" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("success")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
