"""The allocation benchmark's rollout trees and what is counted on them: a prompt's tree grown
rollout by rollout (``TreeBuilder``), and per method the running sums behind the table's figures
(``Totals``: effective ratio, mixed-anchor share, sibling contrast pairs, tokens).
Definitions: ``bench.allocation``'s docstring."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trace_core.allocators import bare_prefixes
from trace_core.simulator import Prompt
from trace_core.tree import NO_PARENT, Tree, backup


@dataclass
class TreeBuilder:
    """One prompt's rollout tree as growing arrays (node ids in creation order, so parent < child)."""

    prompt: Prompt
    parent: list[int] = field(default_factory=lambda: [NO_PARENT])
    prefix: list[tuple[str, ...]] = field(default_factory=lambda: [()])  # turns up to each node
    reward: list[float] = field(default_factory=lambda: [np.nan])  # NaN at internal nodes
    bare_leaves: list[int] = field(default_factory=list)
    tokens: int = 0

    def add_rollout(self, at: int, turns: tuple[str, ...], reward: int, tokens: int, bare: bool) -> None:
        """Attach a rollout's new turns as a chain below node ``at``."""
        node = at
        for turn in turns:
            self.parent.append(node)
            self.prefix.append(self.prefix[node] + (turn,))
            self.reward.append(np.nan)
            node = len(self.parent) - 1
        if node == at:
            raise ValueError("a rollout must generate at least one turn")
        self.reward[node] = float(reward)
        self.tokens += tokens
        if bare:
            self.bare_leaves.append(node)

    def prefixes(self, from_root: bool = False) -> tuple[list[int], np.ndarray]:
        """Non-leaf prefixes (depth >= 1) on the bare rollouts, with the bare outcome through each;
        with ``from_root``, also the root (node 0) when the bare outcomes all agree
        (``trace_core.allocators.root_prefix``), as the pipeline's tasks/prefixes.py does."""
        return bare_prefixes(self.parent, self.reward, self.bare_leaves, from_root)

    def tree(self) -> Tree:
        parent = np.asarray(self.parent, dtype=np.int64)
        depth = np.asarray([len(p) for p in self.prefix], dtype=np.int64)
        return Tree(parent=parent, depth=depth, leaf_reward=np.asarray(self.reward, dtype=np.float64))


@dataclass
class Totals:
    """Running sums of one method's figures."""

    roots: int = 0
    mixed_roots: int = 0
    internal: int = 0
    mixed_internal: int = 0
    contrast_pairs: int = 0
    leaves: int = 0
    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    per_step: list[tuple[int, int]] = field(default_factory=list)  # (mixed roots, active roots)

    def add(self, builders: list[TreeBuilder]) -> None:
        self.steps += 1
        mixed_before, roots_before = self.mixed_roots, self.roots
        for b in builders:
            tree = b.tree()
            value, _ = backup(tree.parent, tree.leaf_reward)
            internal = ~tree.is_leaf
            mixed = internal & (value > 0) & (value < 1)
            self.roots += 1
            self.mixed_roots += int(mixed[0])
            self.internal += int(internal.sum())
            self.mixed_internal += int(mixed.sum())
            self.contrast_pairs += sibling_contrast_pairs(tree.parent, value)
            self.leaves += int(tree.is_leaf.sum())
            self.tokens += b.tokens
        self.per_step.append((self.mixed_roots - mixed_before, self.roots - roots_before))

    def figures(self) -> dict[str, float]:
        late = np.asarray(self.per_step[len(self.per_step) // 2 :]).reshape(-1, 2)  # [S/2, 2]
        return {
            "effective_ratio": self.mixed_roots / max(self.roots, 1),
            "effective_ratio_late": late[:, 0].sum() / max(late[:, 1].sum(), 1),
            "mixed_anchor_share": self.mixed_internal / max(self.internal, 1),
            "contrast_per_100_leaves": 100.0 * self.contrast_pairs / max(self.leaves, 1),
            "tokens_per_step": self.tokens / max(self.steps, 1),
            "leaves_per_step": self.leaves / max(self.steps, 1),
            "roots_per_step": self.roots / max(self.steps, 1),
        }


def sibling_contrast_pairs(parent: np.ndarray, value: np.ndarray) -> int:
    """Unordered pairs of siblings (children of one node) whose backed-up values differ."""
    children = parent[1:]  # [n - 1] parent of each non-root node
    # Values are leaf-count ratios; rounding makes equal ratios compare equal.
    keys = np.round(value[1:], 9)
    pairs = 0
    for p in np.unique(children):
        _, counts = np.unique(keys[children == p], return_counts=True)
        k = counts.sum()
        pairs += int(k * (k - 1) // 2 - (counts * (counts - 1) // 2).sum())
    return pairs
