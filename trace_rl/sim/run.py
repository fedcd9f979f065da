"""The methods compared and one run of a method over the steps (the project's allocators,
backup and estimators on the simulated trees)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from trace_core.advantages import advantages
from trace_core.allocation import allocate_prefixes
from trace_core.allocators import (
    ALLOCATORS,
    Allocator,
    Budget,
    LeafLedger,
    Oracle,
    PrefixSet,
    RootPool,
    Trace,
    TraceCover,
    _uniform_groups,
)
from trace_core.calibration import Term, batch_terms, estimate
from trace_core.posterior import PromptPosterior
from trace_core.waves import root_waves
from trace_rl.config import TrainConfig
from trace_rl.sim.model import (INIT_PROBS, TOKENS_PER_TURN, ChainParams, Dynamics, Exact, Items,
                                dynamics, exact, make_items, softmax)
from trace_rl.sim.trees import LogisticPredictor, SimStep, features, roll_into

# ----------------------------------------------------------------------------- methods

LOG_KEYS = ("tokens", "train_tokens", "bare_tokens", "bare", "leaves", "mixed", "active", "cosine",
            "accuracy", "signal_turns")
"""What a run logs per step (the records file keeps them all)."""


class PrefixOnly(Trace):
    """Ablation: uniform roots (random_prefix's tree_group per prompt), TRACE's Stage 2."""

    name = "prefix_only"

    def allocate_roots(self, pool: RootPool, leaves: int, rng: np.random.Generator) -> np.ndarray:
        return _uniform_groups(pool.size, self.config.tree_group, leaves, rng)


class CoverOracle(Oracle, TraceCover):
    """trace_cover's stages on the true V (simulation only): the coverage allocator's ceiling."""

    name = "cover_oracle"


SIM_ALLOCATORS = {**ALLOCATORS, PrefixOnly.name: PrefixOnly, CoverOracle.name: CoverOracle}
"""The registry plus the simulator's ablation and oracle rows."""


@dataclass(frozen=True)
class Method:
    """One row of the table: an allocator and how the simulator feeds and uses it."""

    name: str
    allocator: str  # a name in ALLOCATORS, or "prefix_only"
    predictor: str = "learned"  # learned, oracle, constant, posterior
    root_predictor: str | None = None  # Stage 1's predictor when not ``predictor`` (a 2 x 2 study)
    root_sampling: str = "mean"  # "thompson": Stage 1 draws each prompt's value from its posterior
    multiplier: int | None = None  # None = the config's N (the leaf budget stays M (1 + N))
    root_only: bool = False  # Stage 2 leaves all go to fresh rollouts from the root
    count_turns_once: bool | None = None
    joint_split: bool | None = None
    flip_gate: float = 0.0  # Stage 2 drops depth >= 1 prefixes whose predicted flip chance is below
    token_budget: bool = False  # Stage 2 spends the tokens of m_i N full rollouts, not m_i N leaves
    exploration: float | None = None  # None = the config's exploration strength
    match_tokens: bool = False  # a flat method whose leaves per step match the reference's tokens
    root_baseline: str = "tree"  # branch's baseline at the root: the tree's V^, or "predicted" (V~)
    root_targets: str = "tree"  # the predictor's root targets: V^ (all leaves), or "bare" (the
    # rollouts from the root only: unbiased for V(prompt), continuations below a prefix are not)
    role: str = "ablation"  # baseline, trace, cover, plus, ablation


def methods(plus_names: Sequence[str]) -> list[Method]:
    rows = [
        Method(REFERENCE, "trace_cover", role="cover"),
        Method("grpo", "grpo", match_tokens=True, role="baseline"),
        Method("dapo", "dapo", match_tokens=True, role="baseline"),
        Method("prompt_only", "prompt_only", match_tokens=True, role="baseline"),
        Method("random_prefix", "random_prefix", role="baseline"),
        Method("trace", "trace", role="trace"),
        Method("cover_oracle", "cover_oracle", predictor="oracle"),
        Method("cover_joint", "trace_cover", joint_split=True),
        Method("cover_constant", "trace_cover", predictor="constant"),
        Method("cover_root", "trace_cover", root_only=True),
        Method("cover_post", "trace_cover", predictor="posterior"),
        Method("cover_N1", "trace_cover", multiplier=1),
        Method("cover_noexp", "trace_cover", exploration=0.0),
        Method("root_only", "trace", root_only=True),
        Method("prefix_only", "prefix_only"),
        Method("constant_pred", "trace", predictor="constant"),
        Method("oracle_pred", "oracle", predictor="oracle"),
        Method("N=1", "trace", multiplier=1),
        Method("count_turns_once", "trace", count_turns_once=True),
        Method("joint_split", "trace", joint_split=True),
        Method("prompt_only+post", "prompt_only", predictor="posterior", match_tokens=True),
        Method("cover_vbase", "trace_cover", root_baseline="predicted"),
        Method("cover_oracle_vbase", "cover_oracle", predictor="oracle", root_baseline="predicted"),
        Method("cover_bare_targets", "trace_cover", root_targets="bare"),
        # where the predictor costs: the true V in Stage 1, in Stage 2, in both (trace_cover's
        # allocator throughout, exploration included; cover_oracle is the Oracle allocator's)
        Method("cover_exact", "trace_cover", predictor="oracle"),
        Method("cover_exact_roots", "trace_cover", root_predictor="oracle"),
        Method("cover_exact_prefixes", "trace_cover", predictor="oracle", root_predictor="learned"),
        Method("cover_exact_noexp", "trace_cover", predictor="oracle", exploration=0.0),
        # exploration by the posterior's own uncertainty instead of the staleness rule
        Method("cover_post_noexp", "trace_cover", predictor="posterior", exploration=0.0),
        Method("cover_post_thompson", "trace_cover", predictor="posterior", exploration=0.0,
               root_sampling="thompson"),
        # the same root values for the prompt-only baseline: is the gain the trees' or the roots'?
        Method("prompt_only_post_noexp", "prompt_only", predictor="posterior", exploration=0.0,
               match_tokens=True),
    ]
    plus = {m.name: m for m in PLUS}
    unknown = [p for p in plus_names if p not in plus]
    if unknown:
        raise ValueError(f"--plus: unknown {unknown}; choose from {sorted(plus)}")
    return rows + [plus[p] for p in plus_names]


REFERENCE = "trace_cover"
"""The row whose generated tokens per step the matched baselines spend (equal tokens per step)."""

PLUS = (
    Method("trace+post", "trace", predictor="posterior", role="plus"),
    Method("trace+gate", "trace", flip_gate=0.25, role="plus"),
    Method("trace+tokens", "trace", token_budget=True, role="plus"),
    Method("trace+post+gate", "trace", predictor="posterior", flip_gate=0.25, role="plus"),
    Method("trace+post+tokens", "trace", predictor="posterior", token_budget=True, role="plus"),
    Method("trace+post+root", "trace", predictor="posterior", root_only=True, role="plus"),
)
"""Deliverable 5's candidates (all TRACE's allocator with one or two options)."""


@dataclass(frozen=True)
class SimSettings:
    steps: int = 60
    pool_size: int = 32
    train_items: int = 256
    eval_items: int = 400
    learning_rate: float = 0.01
    strength: float = 4.0
    train: TrainConfig = TrainConfig()

    def __post_init__(self) -> None:
        if self.steps < 1 or self.pool_size < 2 or self.eval_items < 2:
            raise ValueError("need --steps >= 1, --pool-size >= 2, --eval-items >= 2")
        if self.train_items < self.pool_size:
            raise ValueError(f"--train-items {self.train_items} must be >= --pool-size {self.pool_size}")


class Run:
    """One method on one seed."""

    def __init__(self, method: Method, settings: SimSettings, train: Items, dyn: Dynamics):
        cfg = settings.train
        self.method, self.settings, self.train, self.dyn = method, settings, train, dyn
        joint = cfg.joint_split if method.joint_split is None else method.joint_split
        n = cfg.multiplier if method.multiplier is None else method.multiplier
        acfg = replace(cfg.allocator_config, joint_split=joint, multiplier=n,
                       exploration=(cfg.exploration if method.exploration is None
                                    else method.exploration),
                       # matched DAPO: half the groups of each step's own leaf budget
                       dapo_batch_groups=None if method.match_tokens else
                       cfg.allocator_config.dapo_batch_groups)
        self.allocator: Allocator = SIM_ALLOCATORS[method.allocator](acfg)
        total = cfg.root_budget * (1 + cfg.multiplier)  # equal leaves whatever N
        if total % (1 + n):
            raise ValueError(f"{method.name}: N = {n} does not divide the leaf budget {total}")
        self.budget = Budget(total // (1 + n), n)
        self.turns_once = cfg.count_turns_once if method.count_turns_once is None else method.count_turns_once
        self.estimator = cfg.advantage
        self.centre = cfg.centre_advantages
        self.theta = np.log(INIT_PROBS)
        self.adam_m = np.zeros_like(self.theta)
        self.adam_v = np.zeros_like(self.theta)
        self.learned = LogisticPredictor()
        self.posterior = PromptPosterior(settings.strength)
        self.constant = 0.5
        self.terms: list[list[Term]] = []
        self.last_sampled = np.full(train.size, -1)
        self.first_offered = np.full(train.size, -1)
        self.log: dict[str, list[float]] = {k: [] for k in LOG_KEYS}
        self.leaf_tokens = 0.0  # generated tokens per leaf of the last step (token matching)
        self._thompson = np.random.default_rng(0)  # root_sampling "thompson"'s draws

    # -- predictions ---------------------------------------------------------------------------

    def _node_features(self, step: SimStep, rows: np.ndarray) -> np.ndarray:
        return features(self.train, step.item[step.trees.tree_of_row[rows]],
                        step.state[rows].reshape(-1, 4), step.firsts[rows])

    def predict_roots(self, idx: np.ndarray, truth: Exact, draw: bool = True) -> np.ndarray:
        """Stage 1's values of train items ``idx``; with ``root_sampling`` "thompson" and
        ``draw``, each a draw from its Beta posterior (the learned prior at the posterior's
        strength, plus the prompt's rollouts so far) instead of the posterior mean."""
        kind = self.method.root_predictor or self.method.predictor
        if kind == "oracle":
            return truth.start[idx]
        if kind == "constant":
            return np.full(len(idx), self.constant)
        x = features(self.train, idx, np.zeros((len(idx), 4), np.int64), np.zeros(len(idx)))
        v = self.learned.predict(x)
        ids = [self.train.ids[i] for i in idx]
        if draw and self.method.root_sampling == "thompson":
            p = np.clip(v, 1e-3, 1 - 1e-3)
            succ, n = self.posterior.counts(ids)
            k = self.posterior.strength
            return self._thompson.beta(succ + k * p, n - succ + k * (1 - p))
        if kind == "posterior":
            v = self.posterior.predict(ids, v)
        return v

    def predict_nodes(self, step: SimStep, rows: np.ndarray, truth: Exact) -> np.ndarray:
        """Predictions for ``rows`` of one tree."""
        kind = self.method.predictor
        root = step.trees.depth[rows] == 0
        if self.method.root_predictor not in (None, kind) and root.any():  # Stage 1's own
            v = self.predict_nodes_as(kind, step, rows, truth)
            item = step.item[step.trees.tree_of_row[rows[root]]]
            v[root] = self.predict_roots(item, truth, draw=False)
            return v
        return self.predict_nodes_as(kind, step, rows, truth)

    def predict_nodes_as(self, kind: str, step: SimStep, rows: np.ndarray, truth: Exact) -> np.ndarray:
        if kind == "oracle":
            return self._true_values(step, rows, truth)
        if kind == "constant":
            return np.full(len(rows), self.constant)
        v = self.learned.predict(self._node_features(step, rows))
        root = step.trees.depth[rows] == 0
        if kind == "posterior" and root.any():
            item = step.item[step.trees.tree_of_row[rows[root]]]
            v[root] = self.predict_roots(item, truth, draw=False)
        return v

    @staticmethod
    def _true_values(step: SimStep, rows: np.ndarray, truth: Exact) -> np.ndarray:
        j, s, d, t = step.state[rows].reshape(-1, 4).T
        return truth.value[t, step.item[step.trees.tree_of_row[rows]], j, s, d]

    def correlation(self):
        if self.method.predictor == "oracle" or self.settings.train.correlation_window == 0:
            return None
        terms = [t for step in self.terms for t in step]
        return estimate(terms, min_terms=self.settings.train.correlation_min_terms)

    # -- one step ------------------------------------------------------------------------------

    def matched_budget(self, target: float, start_leaf_tokens: float) -> Budget:
        """A flat method's budget whose expected generated tokens match ``target``: whole groups
        of ``group_size`` (grpo, dapo; pairs for prompt_only), sized by this method's generated
        tokens per leaf on its last step (the first step: ``start_leaf_tokens``, the reference's
        bare rollouts from the same starting policy)."""
        group = self.settings.train.group_size if self.method.allocator in ("grpo", "dapo") else 2
        per_leaf = self.leaf_tokens or start_leaf_tokens
        return Budget.matched(target, per_leaf, group)

    def step(self, step: int, pool_idx: np.ndarray, rng: np.random.Generator,
             truth: Exact, budget: Budget | None = None) -> tuple[SimStep, np.ndarray]:
        """One step's trees and the prediction each node's allocation used (NaN where none);
        ``budget`` overrides the method's leaf budget for this step."""
        self.budget = budget or self.budget
        alloc, budget = self.allocator, self.budget
        ledger = LeafLedger(budget.total)
        offered = self.first_offered[pool_idx]
        self.first_offered[pool_idx] = np.where(offered >= 0, offered, step)
        last = self.last_sampled[pool_idx]
        rho = self.correlation()
        predicted_roots = self.predict_roots(pool_idx, truth)
        pool = RootPool(predicted=predicted_roots,
                        staleness=np.where(last >= 0, step - last,
                                           step - self.first_offered[pool_idx]).astype(np.float64),
                        true_value=truth.start[pool_idx],
                        correlation=0.0 if rho is None else rho.at(0))
        trees, order, counts = self._root_stage(pool, pool_idx, ledger, rng)
        if alloc.splits_jointly:
            self._joint(trees, order, pool, pool_idx, ledger, rho, truth, rng)
        else:
            self._per_tree(trees, order, counts, ledger, rho, truth, rng)
        return trees, trees.predicted

    def _root_stage(self, pool: RootPool, pool_idx: np.ndarray, ledger: LeafLedger,
                    rng: np.random.Generator) -> tuple[SimStep, list[int], np.ndarray]:
        """Stage 1 and its refill waves (``trace_core.waves.root_waves``): bare rollouts of the
        pool's prompts; (the trees, each tree's pool position, rollouts per position)."""
        trees = SimStep()

        def roll(opened: list[int], tree: list[int]):
            for j in opened:
                trees.new_tree(int(pool_idx[j]), float(pool.predicted[j]))
            roll_into(trees, [(int(trees.trees.roots[k]), True) for k in tree], self.dyn, self.theta, rng)
            return trees.trees

        counts, order = root_waves(self.allocator, pool, self.budget, rng, roll, ledger, self.method.name)
        return trees, order, counts

    def _candidates(self, trees: SimStep) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per tree, Stage 2's candidates (``TreeBatch.candidates``: rows, observed outcomes);
        none where the set is the root alone (no prefix to branch from)."""
        rows, observed = trees.trees.candidates(self.allocator.branches_from_root,
                                                deepest_first=True)
        owner = trees.trees.tree_of_row[rows]
        out = []
        for k, root in enumerate(trees.trees.roots):
            mine = owner == k
            if rows[mine].tolist() == [root]:
                mine[:] = False
            out.append((rows[mine], observed[mine]))
        return out

    def _per_tree(self, trees: SimStep, order: list[int], counts: np.ndarray,
                  ledger: LeafLedger, rho, truth: Exact, rng: np.random.Generator) -> None:
        """Stage 2 tree by tree (each tree's own continuation budget), then the rollouts."""
        alloc, budget = self.allocator, self.budget
        candidates = self._candidates(trees)
        bare = trees.bare_leaves
        where = []
        for k, (nodes, observed) in enumerate(candidates):
            root = int(trees.trees.roots[k])
            leaves = alloc.tree_leaves(int(counts[order[k]]), budget)
            if leaves == 0:
                continue
            if self.method.root_only:
                ledger.spend(leaves, "root-only continuations")
                where += [(root, False)] * leaves
                continue
            pred = self.predict_nodes(trees, nodes, truth) if len(nodes) else np.zeros(0)
            if self.method.flip_gate > 0 and len(nodes):
                flip = np.where(observed == 1, 1 - pred, pred)
                keep = (nodes == root) | (flip >= self.method.flip_gate)
                nodes, observed, pred = nodes[keep], observed[keep], pred[keep]
            if self.method.token_budget and len(nodes):
                leaves = self._token_leaves(trees, k, nodes, observed, pred, rho, leaves)
                ledger.budget += leaves - alloc.tree_leaves(int(counts[order[k]]), budget)
            ledger.spend(leaves, f"{self.method.name} prefix stage")
            if not len(nodes):
                where += [(root, False)] * leaves
                continue
            depth = trees.state[nodes, 3]
            prefixes = PrefixSet(
                predicted=pred, observed=observed, true_value=self._true_values(trees, nodes, truth),
                correlation=None if rho is None else np.array([rho.at(x) for x in depth]),
                seen=np.where(nodes == root, bare[k], 1).astype(np.int64))
            kk = alloc.allocate_prefixes(prefixes, leaves, rng)
            trees.predicted[nodes] = pred
            for n, times in zip(nodes, kk):
                where += [(int(n), False)] * int(times)
        roll_into(trees, where, self.dyn, self.theta, rng)

    def _token_leaves(self, trees: SimStep, k: int, nodes: np.ndarray, observed: np.ndarray,
                      pred: np.ndarray, rho, leaves: int) -> int:
        """Continuation leaves whose expected tokens match those of ``leaves`` full rollouts of
        this prompt (a budget in tokens, not leaves): a continuation from a prefix at turn t is
        taken to cost max(L - t, 1) turns, L the mean length of the prompt's bare rollouts; the
        Stage 2 allocation at ``leaves`` prices the mix, and the leaves are scaled to match."""
        full = trees.turns[k] / trees.bare_leaves[k]
        depth = trees.state[nodes, 3]
        cost = np.maximum(full - depth, 1.0)
        kk = allocate_prefixes(pred, observed, leaves,
                               correlation=0.0 if rho is None else np.array([rho.at(x) for x in depth]))
        per_leaf = float((kk * cost).sum()) / max(int(kk.sum()), 1)
        return max(leaves, int(leaves * full / per_leaf))

    def _joint(self, trees: SimStep, order: list[int], pool: RootPool, pool_idx: np.ndarray,
               ledger: LeafLedger, rho, truth: Exact, rng: np.random.Generator) -> None:
        bare = trees.bare_leaves
        nodes_all, obs_all, pred_all, seen_all = [], [], [], []
        for k, (nodes, observed) in enumerate(self._candidates(trees)):
            if not len(nodes):
                continue
            nodes_all.append(nodes)
            obs_all.append(observed)
            pred_all.append(self.predict_nodes(trees, nodes, truth))
            seen_all.append(np.where(nodes == trees.trees.roots[k], bare[k], 1))
        nodes = np.concatenate(nodes_all) if nodes_all else np.zeros(0, np.int64)
        fresh = np.array([j for j in range(pool.size) if j not in set(order)], np.int64)
        leaves = self.budget.total - ledger.spent
        prefixes = PrefixSet(
            predicted=np.concatenate(pred_all) if pred_all else np.zeros(0),
            observed=np.concatenate(obs_all) if obs_all else np.zeros(0),
            true_value=self._true_values(trees, nodes, truth).astype(np.float64),
            correlation=None if rho is None else np.array([rho.at(x) for x in trees.state[nodes, 3]]),
            seen=(np.concatenate(seen_all) if seen_all else np.zeros(0)).astype(np.int64))
        fresh_pool = RootPool(predicted=pool.predicted[fresh], staleness=pool.staleness[fresh],
                              true_value=pool.true_value[fresh], correlation=pool.correlation)
        m, kk = self.allocator.allocate_joint(prefixes, fresh_pool, leaves, rng)
        ledger.spend(int(m.sum() + kk.sum()), f"{self.method.name} joint split")
        trees.predicted[nodes] = prefixes.predicted
        where = []
        for n, times in zip(nodes, kk):
            where += [(int(n), False)] * int(times)
        for j, times in zip(fresh, m):
            if times:
                k = trees.new_tree(int(pool_idx[j]), float(pool.predicted[j]))
                order.append(int(j))
                where += [(int(trees.trees.roots[k]), True)] * int(times)
        roll_into(trees, where, self.dyn, self.theta, rng)

    # -- learning ------------------------------------------------------------------------------

    def gradient(self, step: SimStep) -> tuple[np.ndarray, int]:
        """The estimated gradient (token-mean over the batch's path turns) and the number of
        mixed trees."""
        trees = step.trees
        probs = softmax(self.theta)
        g = np.zeros_like(self.theta)
        leaves = trees.leaves
        wins = np.bincount(trees.tree_of_row[leaves], weights=trees.reward[leaves], minlength=len(trees))
        mixed = int(np.count_nonzero((wins > 0) & (wins < np.bincount(trees.tree_of_row[leaves],
                                                                       minlength=len(trees)))))
        root_value = (step.predicted[trees.roots] if self.method.root_baseline == "predicted"
                      else None)  # the root's prediction: its allocation input (oracle: exact V)
        a = advantages(trees, self.estimator, centre=self.centre, turns_once=self.turns_once,
                       root_value=root_value)
        node = trees.paths()[:, 1:]  # [L, D]
        ok = node >= 0
        nodes, adv = node[ok], a[ok]
        typ, act = step.typ[nodes], step.action[nodes]
        # generated turns whose advantages over the paths through them do not cancel
        net = np.bincount(nodes, weights=adv, minlength=trees.num_rows)
        # score-function terms: + A on the taken action, - A pi(.) on every action of the turn's
        # type; summed tree by tree (each tree's + terms, then its - terms), the order the
        # floating-point sums of the recorded seeds were taken in
        tree = np.repeat(trees.tree_of_row[trees.leaves], ok.sum(axis=1))  # [E]
        n_act = g.shape[1]
        index = np.r_[typ * n_act + act, (typ[:, None] * n_act + np.arange(n_act)).ravel()]
        value = np.r_[adv, (-adv[:, None] * probs[typ]).ravel()]
        order = np.lexsort((np.arange(len(index)),
                            np.r_[np.zeros(len(adv), int), np.ones(len(adv) * n_act, int)],
                            np.r_[tree, np.repeat(tree, n_act)]))
        flat = g.reshape(-1)
        np.add.at(flat, index[order], value[order])
        self._signal = int(np.count_nonzero(np.abs(net) > 1e-9))
        self._entries = len(nodes)  # path turns = what the update reads (training tokens / turn)
        return g / max(len(nodes), 1), mixed

    def learn(self, step_trees: SimStep, predicted: np.ndarray, step: int,
              pool_grad: np.ndarray) -> None:
        """One optimiser step on ``step_trees`` (``predicted``: each node's allocation input),
        then the predictors and the rho window learn from them."""
        trees = step_trees.trees
        g, mixed = self.gradient(step_trees)
        denom = np.linalg.norm(g) * np.linalg.norm(pool_grad)
        self.log["cosine"].append(float((g * pool_grad).sum() / denom) if denom > 0 else 0.0)
        self.log["mixed"].append(mixed)
        self.log["active"].append(len(trees))
        self.log["leaves"].append(int(trees.is_leaf.sum()))
        self.log["tokens"].append(TOKENS_PER_TURN * int(step_trees.turns.sum()))
        self.log["train_tokens"].append(TOKENS_PER_TURN * self._entries)
        self.log["bare_tokens"].append(TOKENS_PER_TURN * int(step_trees.bare_turns.sum()))
        self.log["bare"].append(int(step_trees.bare_leaves.sum()))
        self.log["signal_turns"].append(self._signal)
        self.leaf_tokens = self.log["tokens"][-1] / max(self.log["leaves"][-1], 1)
        # Adam (the pipeline's optimiser, no weight decay), ascending the return.
        b1, b2 = 0.9, 0.999
        self.adam_m = b1 * self.adam_m + (1 - b1) * g
        self.adam_v = b2 * self.adam_v + (1 - b2) * g * g
        k = len(self.log["cosine"])
        m_hat, v_hat = self.adam_m / (1 - b1 ** k), self.adam_v / (1 - b2 ** k)
        self.theta = self.theta + self.settings.learning_rate * m_hat / (np.sqrt(v_hat) + 1e-8)
        # The predictors and the rho window learn from this step's trees.
        self.last_sampled[step_trees.item] = step
        terms: list[Term] = []
        kinds = {self.method.predictor, self.method.root_predictor or self.method.predictor}
        reads = self.allocator.uses_predictor and kinds != {"oracle"}
        if reads:
            value, n_leaves = trees.backup()
            if self.method.root_targets == "bare":  # each root: its rollouts from the root only
                from_root = step_trees.root_rollouts > 0
                roots = trees.roots[from_root]
                value, n_leaves = value.copy(), n_leaves.copy()
                value[roots] = step_trees.root_successes[from_root] / step_trees.root_rollouts[from_root]
                n_leaves[roots] = step_trees.root_rollouts[from_root]
            internal = np.flatnonzero(~trees.is_leaf)
            if kinds & {"learned", "posterior"}:
                self.learned.fit(self._node_features(step_trees, internal), value[internal],
                                 n_leaves[internal].astype(np.float64))
            terms = batch_terms(trees, predicted)
        self.constant = float(trees.reward[trees.leaves].mean())
        if self.method.predictor == "posterior":
            self.posterior.update([self.train.ids[i] for i in step_trees.item],
                                  step_trees.root_successes, step_trees.root_rollouts.astype(np.float64))
        window = self.settings.train.correlation_window
        if window:
            self.terms = (self.terms + [terms])[-window:]


def run_seed(seed: int, rows: list[Method], params: ChainParams, settings: SimSettings,
             protocol: str = "tokens") -> dict:
    """Every method on one seed: same train pool, candidate order, test items and sampling seeds.
    With ``protocol`` "tokens" the reference row runs first and the matched rows spend its
    generated tokens per step."""
    if protocol not in ("tokens", "leaves"):
        raise ValueError(f"--protocol {protocol!r}: choose tokens or leaves")
    rng = np.random.default_rng([seed, 0])
    train = make_items(settings.train_items, params, rng, "train")
    test = make_items(settings.eval_items, params, rng, "test")
    dyn, dyn_test = dynamics(train), dynamics(test)
    order = np.concatenate([rng.permutation(train.size) for _ in range(
        settings.steps * settings.pool_size // train.size + 1)])
    acc0 = float(exact(dyn_test, np.log(INIT_PROBS), grad=False).start.mean())
    matched = protocol == "tokens" and any(m.match_tokens for m in rows)
    if matched and REFERENCE not in {m.name for m in rows}:
        raise ValueError(f"the tokens protocol needs the reference row {REFERENCE!r}")
    out: dict[str, dict] = {}
    for method in sorted(rows, key=lambda m: m.name != REFERENCE):  # the reference first
        run = Run(method, settings, train, dyn)
        ref = out.get(REFERENCE) if matched and method.match_tokens else None
        for step in range(settings.steps):
            pool_idx = order[step * settings.pool_size:(step + 1) * settings.pool_size]
            truth = exact(dyn, run.theta)
            budget = (run.matched_budget(ref["tokens"][step], ref["bare_tokens"][0] / ref["bare"][0])
                      if ref else None)
            trees, predicted = run.step(step, pool_idx, np.random.default_rng([seed, 1, step]),
                                        truth, budget)
            run.learn(trees, predicted, step, truth.grad.mean(axis=0))
            run.log["accuracy"].append(float(exact(dyn_test, run.theta, grad=False).start.mean()))
        out[method.name] = {"acc0": acc0, **run.log}
    return {m.name: out[m.name] for m in rows}


def at_tokens(log: dict, budget: float) -> float:
    """Held-out accuracy when cumulative generated tokens reach ``budget`` (linear in between)."""
    tokens = np.concatenate([[0.0], np.cumsum(log["tokens"])])
    acc = np.concatenate([[log["acc0"]], log["accuracy"]])
    return float(np.interp(budget, tokens, acc))
