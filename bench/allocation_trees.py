"""The allocation benchmark's rollout trees (``Grower``: a step's trees as one ``TreeBatch`` with
each node's turns) and per method the running sums behind its table (``Totals``); definitions:
docs/algorithm.md, "Allocation benchmark (bench/allocation.py): definitions"."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trace_core.simulator import Prompt, Simulator
from trace_core.tree import TreeBatch, sibling_contrast_pairs


def objects(items: list) -> np.ndarray:
    """A 1-D object array of ``items`` (tuples stay elements, not rows)."""
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


@dataclass
class Grower:
    """One step's trees while they are rolled out: the batch, each node's turns from its root
    (``prefix``), each tree's prompt and generated tokens."""

    trees: TreeBatch = field(default_factory=TreeBatch.empty)
    prefix: np.ndarray = field(default_factory=lambda: objects([]))
    prompts: list[Prompt] = field(default_factory=list)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def new_tree(self, prompt: Prompt) -> None:
        """Open a tree (a root with no rollout yet)."""
        self.trees = self.trees.with_new_trees(1)
        self.prefix = np.r_[self.prefix, objects([()])]
        self.prompts.append(prompt)
        self.tokens = np.r_[self.tokens, 0]

    def history(self, row: int) -> tuple[Prompt, tuple[str, ...]]:
        """Row ``row`` as the simulator takes it: its tree's prompt and its turns."""
        return self.prompts[self.trees.tree_of_row[row]], self.prefix[row]

    def roll(self, sim: Simulator, at: np.ndarray, level: int, rng: np.random.Generator) -> None:
        """One rollout of ``sim`` from each row of ``at``, in order, each hung below its row as a
        chain of its turns (nodes at ``level``)."""
        out = [sim.rollout(*self.history(a), rng) for a in at]
        self.trees, growth = self.trees.grow(at, [len(r.turns) for r in out],
                                             [float(r.reward) for r in out], level)
        self.prefix = growth.place(self.prefix, objects(
            [self.prefix[a] + r.turns[:i + 1] for a, r in zip(at, out) for i in range(len(r.turns))]))
        self.tokens = self.tokens + np.bincount(self.trees.tree_of_row[growth.leaf],
                                                weights=[r.tokens for r in out],
                                                minlength=len(self.prompts)).astype(np.int64)


@dataclass
class Totals:
    """One method's counts per step behind the table's figures, and its seconds."""

    per_step: list[dict[str, int]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, trees: TreeBatch, tokens: np.ndarray) -> None:
        """One step's trees and each tree's generated tokens."""
        value, _ = trees.backup()
        internal = ~trees.is_leaf
        mixed = internal & (value > 0) & (value < 1)
        self.per_step.append({"roots": len(trees), "mixed_roots": int(mixed[trees.roots].sum()),
                              "internal": int(internal.sum()), "mixed_internal": int(mixed.sum()),
                              "contrast_pairs": sibling_contrast_pairs(trees.up, value),
                              "leaves": int(trees.is_leaf.sum()), "tokens": int(tokens.sum())})

    def figures(self) -> dict[str, float]:
        steps = len(self.per_step)
        total, late = ({k: sum(s[k] for s in part) for k in self.per_step[0]}
                       for part in (self.per_step, self.per_step[steps // 2:]))
        return {"effective_ratio": total["mixed_roots"] / max(total["roots"], 1),
                "effective_ratio_late": late["mixed_roots"] / max(late["roots"], 1),
                "mixed_anchor_share": total["mixed_internal"] / max(total["internal"], 1),
                "contrast_per_100_leaves": 100.0 * total["contrast_pairs"] / max(total["leaves"], 1),
                **{f"{k}_per_step": total[k] / max(steps, 1) for k in ("tokens", "leaves", "roots")}}
