"""The one typed, frozen configuration of a training run.

``TrainConfig`` is a pydantic model: every field has a type, a range and a docstring (its
description in the Prefect UI's run form, whose JSON schema comes from this model), names are
checked against the registries they select from, and cross-field rules are one model validator.
The CLI, YAML files, the flows' parameters, deployments and benchmarks all build this model, and
the settings below it (``AllocatorConfig``, ``UpdateSettings``, ``Budget``) are derived from it,
so no default is declared twice. A bad config raises ``ConfigError``, one line per problem.

This module is the declaration; around it: ``trace_rl.config_load`` builds it from mappings, YAML
files and ``key=value`` overrides (``load_config``, ``config_from_mapping``; also importable from
here), ``trace_rl.config_checks`` checks the files it names (``check_inputs``), and
``trace_rl.config_hash`` makes the hash in its run id.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from trace_core.advantages import ESTIMATORS
from trace_core.allocators import ALLOCATORS, AllocatorConfig, Budget
from trace_rl.config_hash import config_hash as _config_hash
from trace_rl.engines import ENGINES
from trace_rl.envs.registry import families

if TYPE_CHECKING:
    from trace_rl.policy.update import UpdateSettings

_CLUSTER = r"^$|^local:[1-9][0-9]*$|^auto$|^(ray://)?[A-Za-z0-9_.-]+:[0-9]{1,5}$"
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
"""``trace_core.loss.AGGREGATIONS``' names (a test checks they agree; not imported: that module
pulls in torch, and a config must be checked before anything heavy is imported)."""
_RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # as trace_rl.storage.store and MLflow want
_MAX_SEED = 2**32 - 1  # numpy's legacy seeding and some samplers refuse larger seeds

# The names a field may take, read from the registries they select from. (Oracle allocators need
# the true V, which only a simulation has.)
AllocatorName = Literal[tuple(n for n, f in ALLOCATORS.items() if not f.simulation_only)]  # type: ignore[misc]
AdvantageName = Literal[tuple(ESTIMATORS)]  # type: ignore[misc]
EngineKind = Literal[("auto", *ENGINES)]  # type: ignore[misc]
LossAggregation = Literal[LOSS_AGGREGATIONS]  # type: ignore[misc]


CONCERNS: dict[str, tuple[str, ...]] = {
    "run": ("run_name", "run_id", "seed", "steps", "policy", "checkpoint_every", "keep_checkpoints",
            "plot_every"),
    "task": ("family", "difficulty", "train_split", "extra", "chain_hops", "chain_hazard_a",
             "chain_hazard_b", "chain_alias_share", "chain_train_items", "chain_facts",
             "chain_syllables"),
    "rollout": ("engine", "max_turns", "max_new_tokens", "temperature", "tool_timeout_s"),
    "allocation": ("allocator", "pool_size", "root_budget", "multiplier", "min_per_root",
                   "max_per_root", "group_size", "tree_group", "branch_from_root", "joint_split",
                   "exploration", "correlation_window", "correlation_min_terms", "root_posterior",
                   "root_oracle"),
    "update": ("advantage", "centre_advantages", "count_turns_once", "learning_rate",
               "lr_warmup_steps", "clip_low", "clip_high", "clip_ratio_c", "tis_cap", "kl_coef",
               "loss_agg", "ppo_epochs", "micro_batch", "mini_batches", "target_kl",
               "target_position_kl", "trainable_layers"),
    "predictor": ("predictor_epochs", "predictor_lr"),
    "eval": ("eval_split", "eval_items", "eval_samples"),
    "cluster": ("cluster", "rollout_engines", "trainer_ranks", "trainer_strategy", "weight_sync"),
}
"""``TrainConfig``'s fields by concern: every field in exactly one (tests/test_config.py checks).
A config may name a field by its concern, ``allocation.min_per_root=3`` on the command line or
``allocation: {min_per_root: 3}`` in YAML, or by its flat name (``min_per_root=3``); both are the
same field, so the run id is the same (``trace_rl.config_load``)."""


class ConfigError(ValueError):
    """A config that cannot run: one line per problem, each naming the field, the value given
    and what it may be (``config: steps=-1 (int) in overrides: Input should be ...``)."""


class TrainConfig(BaseModel):
    """A TRACE training run. ``trace train`` with no config runs these defaults: 20 steps of
    the tiny CPU policy on a synthetic family, evaluated on held-out items before and after, small
    enough for a 2-core machine (figures: docs/results.md, "The default run")."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    run_name: str = Field("trace-default", pattern=_RUN_ID)
    """Human name; the run id is ``<run_name>-<config hash>`` unless ``run_id`` is set."""
    run_id: str = Field("", pattern=f"^$|{_RUN_ID}")
    """Explicit run id (re-using one resumes that run); empty = derived from name + config hash."""
    family: str = Field("synth_arith", json_schema_extra=lambda s: s.update(enum=families()))
    """Task family, one registered when the config is built (``trace_rl.envs.registry``):
    synth_arith, synth_lookup, synth_fncall, synth_chain, hotpotqa, math, bfcl."""
    difficulty: int = Field(1, ge=1)
    """Difficulty knob of a synthetic family (ignored by real families). At 1 the bootstrapped
    tiny policy starts at 28-45% sampled success on synth_arith (five seeds), so groups mix; at 2
    it started at 19% (docs/results.md, "Tiny policy bootstrap")."""
    train_split: str = Field("train", min_length=1)
    """Split (or data file, for real families) that roots are drawn from."""
    eval_split: str = Field("test", min_length=1)
    """Held-out split for ``evaluate`` and the train flow's before/after evaluation."""
    eval_items: int = Field(200, ge=0)
    """Held-out items the train flow evaluates the policy on before the first step and after the
    last (paired: same items, same sampling seeds; 0 = no evaluation). A bootstrapped policy's
    own selection and report items are skipped. The interval of the gain over 200 items x 4
    samples is about +-4 points, narrower than the gains RL makes (docs/results.md, "The default
    run")."""
    eval_samples: int = Field(4, ge=1)
    """Rollouts per held-out item, at the training temperature; an item's score is their mean."""
    policy: str = Field("tiny", min_length=1)
    """A Hugging Face causal LM directory, or ``tiny`` for the project's bootstrapped CPU model."""
    engine: EngineKind = "auto"
    """Rollout engine: ``hf`` (transformers), ``vllm``, or ``auto`` (per-device default chosen by
    bench/engines.py)."""
    allocator: AllocatorName = "trace"
    """Budget allocator: trace, trace_cover (coverage-aware Stage 1), grpo, dapo, prompt_only,
    random_prefix."""
    advantage: AdvantageName = "branch"
    """Tree advantage estimator (trace_core.advantages): branch, treepo, tree_grpo, segment, grpo.
    ``branch`` (each turn against the value of the last branch point above it; on a flat group
    r - mean, so the flat baselines are unaffected) because it is zero-sum at every branch point:
    TRACE on the pool of uneven prompts 33.2 +- 2.2 with no broken run, against 26.1 +- 8.2 with
    ``treepo``, whose per-leaf average is not zero-sum at a branch point and gave one run's shared
    format tokens a net push until it broke; at d = 1 78.7 +- 1.2 against 79.6 +- 1.9."""
    centre_advantages: bool = False
    """Shift each tree's advantages so that its paths' advantages sum to zero
    (``trace_core.advantages.centred``); a no-op for flat groups and zero-sum estimators."""
    count_turns_once: bool = False
    """Divide each turn's advantage by the number of paths that share the turn
    (``trace_core.advantages.per_node``), so a prefix continued K times weighs once in the loss,
    not K + 1 times; a no-op for flat groups. Off because it bought nothing measurable: TRACE +0.6
    points with the joint split (inside the seeds' spread; one random_prefix run of three broke),
    -1.9 +- 2.6 with the paper's split, -0.1 in bench.learning_sim."""
    steps: int = Field(20, ge=1)
    """Training steps (each: roots -> level 0 -> level 1 -> update). 20 because at 10 one seed's
    gain of five held zero in its interval, at 20 none did (docs/results.md, "The default run")."""
    pool_size: int = Field(32, ge=1)
    """Candidate prompts scored by the predictor per step (Stage 1 pool)."""
    root_budget: int = Field(16, ge=2)
    """M: bare rollouts per step, shared across the pool by Stage 1."""
    multiplier: int = Field(2, ge=0)
    """N: continuation multiplier; Stage 2 spends m_i * N continuations on prompt i."""
    min_per_root: int = Field(2, ge=2)
    """Smallest non-zero root allocation (one rollout can never be mixed)."""
    max_per_root: int = Field(8, ge=2)
    """Cap on rollouts per prompt."""
    group_size: int = Field(4, ge=2)
    """n: rollouts per prompt for the flat baselines (grpo, dapo)."""
    tree_group: int = Field(2, ge=2)
    """Bare rollouts per prompt for random_prefix's uniform roots."""
    branch_from_root: bool = True
    """TRACE's Stage 2 also offers the root of a tree whose bare rollouts all agree (a
    continuation from it is one more bare rollout, scored by the same q^K (1 - q) gain as any
    prefix). Off: only depth >= 1 prefixes, as in the paper's description."""
    joint_split: bool = False
    """TRACE: after the bare rollouts, split the step's M N continuation leaves between
    continuations of any tree's prefixes and bare rollouts of pool prompts not yet rolled out,
    each leaf where it buys the most expected mixed groups (``trace_core.allocation.
    allocate_joint``). False (default): m_i N continuations inside tree i, the paper's split.
    Works with ``correlation_window`` > 0: read as independent draws, continuations look likelier
    to flip than they are. Off (the paper's split) because at N = 2 the paper's split reaches
    1.41x and 1.68x GRPO's effective ratio against the joint split's 1.03x, with 30% fewer
    generated tokens, at held-out accuracy within the seeds' noise."""
    exploration: float = Field(0.1, ge=0, le=1)
    """Strength of the exploration rule that pulls long-unsampled prompts' predictions toward 0.5."""
    correlation_window: int = Field(4, ge=0)
    """Stage 1 and Stage 2 (trace, prompt_only) estimate rho, the correlation of a node's rollout
    outcomes given its prediction, from the stored trees of this many previous steps (more if
    they hold too little evidence; ``tasks.correlation``, ``trace_core.calibration``), and
    allocate on the Beta-posterior gains of ``trace_core.allocation``. 0 = off: rollouts read as
    independent Bernoulli(V~) draws, the paper's formulas. On (4) because continuations repeat
    their prefix's outcome far more often than independent draws would (rho ~ 0.75 at depth 1
    on synth_arith), and allocating on the calibrated rho raised TRACE's effective ratio from
    0.65 to 0.74."""
    correlation_min_terms: int = Field(16, ge=1)
    """Nodes a depth needs in the window before its own rho estimate is used (else the pooled
    prefixes' estimate, else 0)."""
    max_turns: int = Field(4, ge=1)
    """Turn cap of an episode."""
    max_new_tokens: int = Field(48, ge=1)
    """Token cap of one turn."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of rollouts."""
    tool_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit of one tool call."""
    learning_rate: float = Field(1e-4, gt=0)
    """AdamW learning rate of the policy (suits the tiny CPU policy, whose SFT peaks at 2e-3; use
    about 1e-6 for a multi-billion-parameter model). 1e-4 rather than 2e-4 because at 2e-4 6 of 33
    runs of the tiny policy broke (lost the tool-call format), spread over four methods, against
    1 of 39 at 1e-4."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many RL steps (0 = off): step s (0-based) uses
    ``learning_rate * (s + 1) / lr_warmup_steps`` until the full rate. AdamW's first steps move
    every parameter by about the learning rate whatever its gradient's size (the moment
    estimates hold one or two samples), which is what warm-up tempers (OpenRLHF's
    ``lr_warmup_ratio``, verl's ``lr_warmup_steps``)."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO ratio clip below 1."""
    clip_high: float = Field(0.28, ge=0)
    """PPO ratio clip above 1 (DAPO clip-higher)."""
    clip_ratio_c: float = Field(0.0, ge=0)
    """Dual clip (0 = off; else > 1 + ``clip_high``, verl's ``clip_ratio_c`` is 3): a token with
    negative advantage whose ratio has run above this gets no gradient. Without it PPO keeps
    ``-A rho`` for such a token, unbounded, and one of them can set the direction of a whole
    norm-clipped step (``trace_core.loss``)."""
    tis_cap: float = Field(0.0, ge=0)
    """Truncated importance sampling (0 = off; else the cap C >= 1): each policy token's loss is
    weighted by min(pi_train / pi_engine, C), correcting for the rollout engine's log-probs
    differing from the trainer's; every step logs the mismatch either way (docs/metrics.md)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty to the initial policy (0 disables it)."""
    loss_agg: LossAggregation = "seq-mean-token-sum"
    """How token losses are averaged (trace_core.loss.AGGREGATIONS): token-mean,
    seq-mean-token-sum, seq-mean-token-mean. seq-mean-token-sum because seq-mean-token-mean gives
    each token of a short path more weight (1/|o|), and a lucky 7-token direct answer once
    outweighed 30 tool-call paths. With
    seq-mean-token-sum every method of the d = 1 learning benchmark ended higher (no run broke
    against 1 of 15); on the pool of uneven prompts the methods moved -1.7 ... +2.0 points, bar one
    TRACE run that broke there (none had with seq-mean-token-mean). Its gradient norms reach ~130
    (medians 7-12), so ``max_grad_norm`` clips nearly every optimiser step to norm 1. token-mean
    was worst of the three (10 steps took the tiny policy from 16.3% to 9.3% / 6.7% greedy
    accuracy)."""
    ppo_epochs: int = Field(4, ge=1)
    """Passes over a step's paths (each pass: ``mini_batches`` optimiser steps). Default 4 with
    ``mini_batches`` 1, four AdamW steps on the whole batch, because with 4 steps on quarters of
    the batch TRACE's ~5 mixed trees per step gave each step 1.2 prompts; on the whole batch
    every method's final held-out accuracy rose (+0.7 to +5.8 points; mean of the five 80.3 ->
    83.4) at 1.4-2.0x a run's training wall time (the whole benchmark's: 1.27x)."""
    micro_batch: int = Field(8, ge=1)
    """Paths per forward/backward pass (memory); gradients are accumulated over micro-batches."""
    mini_batches: int = Field(1, ge=1)
    """Optimiser steps per PPO epoch (verl's ppo_mini_batch): a step's paths are split into this
    many mini-batches of whole trees (at most one per ``micro_batch`` paths), gradients
    accumulated over their micro-batches. Whole trees keep each step's advantages centred: a
    mini-batch of mostly negative-advantage paths from split groups once moved the KL to 0.16 in
    one step. What counts is the optimiser steps per RL step (``ppo_epochs`` x ``mini_batches``)
    and the prompts each sees (synth_arith d=1, 10 steps: 4 steps reached 78.0% (GRPO) / 68.2%
    (TRACE) held-out sampled accuracy from 48.0%, one step 62.3% / 56.2%; 4 steps on the whole
    batch beat 4 on quarters of it for every method). Default 1 with ``ppo_epochs`` 4."""
    target_kl: float = Field(0.1, ge=0)
    """Trust-region guard of the policy update (0 = off): an optimiser step after which the
    approximate KL of the sampling policy from the new one, on the mini-batch it used, exceeds
    this is undone and the step's update ends (``UpdateSettings.target_kl``). A guard against
    the rare catastrophic step, not a tight trust region. 0.1 because, on synth_arith d=1 at
    learning rate 2e-4, without it one AdamW step moved the KL to 0.16 and broke the tiny
    policy's tool-call format for the rest of the run (TRACE and prompt_only, seed 2); at
    0.1 those runs learn and 0-2 steps of 20 are undone; at 0.02 half of GRPO's steps were cut
    short and it learned far slower (65.0% vs 78.8% after 20 steps)."""
    target_position_kl: float = Field(0.0, ge=0)
    """Position-wise trust-region guard (0 = off): as ``target_kl``, on the largest KL of the
    next-token distribution at one policy-token position of the mini-batch
    (``trace_rl.policy.update.position_kl``), which catches one likely token moved far (a turn's
    first token collapsing) that the mean over a path's tokens dilutes."""
    trainable_layers: int = Field(0, ge=0)
    """Train only the top this-many decoder layers and the final norm (0 = every parameter), as
    the HotpotQA warm start does (6 of 30), so that a CPU step fits (``trace_rl.policy.freeze``)."""
    predictor_epochs: int = Field(5, ge=0)
    """Epochs of the predictor's online regression per step."""
    predictor_lr: float = Field(3e-3, gt=0)
    """Learning rate of the predictor head."""
    seed: int = Field(0, ge=0, le=_MAX_SEED)
    """Seed of every random choice (roots, sampling, initialisation)."""
    checkpoint_every: int = Field(1, ge=1)
    """Register the policy checkpoint in MLflow (artifacts + a model version, weights and
    tokenizer without the optimiser state) every this many steps, and always at the last step.
    Every step's weights stay in the work dir's checkpoints; only the newest keeps its optimiser
    state (for resuming)."""
    keep_checkpoints: int = Field(0, ge=0)
    """Policy checkpoints kept in the work dir: 0 keeps every step's weights; N >= 1 keeps the
    newest N and every one that ``checkpoint_every`` registers in MLflow, and deletes the other
    steps' once a later step is complete (a SmolLM2-135M checkpoint is 0.54 GB: 20 steps kept
    11 GB a run). Not in the run id: it changes what is kept, not what is computed."""
    plot_every: int = Field(1, ge=0)
    """Render a rollout tree and a calibration plot every this many steps (0 = never)."""
    root_posterior: float = Field(0.0, ge=0)
    """Stage 1 (trace, prompt_only): strength k of a per-prompt posterior over the text
    predictor's root estimate, V~(x) = (s + k p) / (n + k) with s successes in n earlier bare
    rollouts of prompt x (``trace_core.posterior``, counts rebuilt from the stored trees, so a
    resumed run has them too) and p the text predictor's estimate; 0 = off (the text predictor
    alone). Worth it where prompts recur (synth_chain's train pool: every ~8 steps)."""
    root_oracle: bool = False
    """Stage 1 (trace, prompt_only) scores prompts by the family's oracle instead of a predictor
    (``Environment.oracle_success``: synth_chain's hazards, 0.5 per homonym), scaled to the
    policy's success so far (``tasks.roots.oracle_roots``): the benchmark's reference for what a
    predictor that ranks prompts perfectly by their hidden structure would give. Stage 2 keeps the
    shared predictor."""
    chain_hops: str = Field("2:0.35,3:0.40,4:0.25",
                            pattern=r"^\s*\d+\s*:\s*[0-9.]+\s*(,\s*\d+\s*:\s*[0-9.]+\s*)*$")
    """synth_chain: hop distribution of the items, ``HOPS:WEIGHT`` entries (normalised)."""
    chain_hazard_a: float = Field(0.5, gt=0)
    """synth_chain: a of the Beta(a, b) that draws each item's hazard rate (aliases and
    homonyms along its chain)."""
    chain_hazard_b: float = Field(1.0, gt=0)
    """synth_chain: b of that Beta(a, b)."""
    chain_alias_share: float = Field(0.5, ge=0, le=1)
    """synth_chain: share of the hazards that are aliases (recoverable: a retry costs a turn);
    the rest are homonyms (unrecoverable: the wrong copy derails the chain)."""
    chain_train_items: int = Field(256, ge=1)
    """synth_chain: items of the train split, the pool prompts are drawn from (at pool_size 32
    a prompt recurs every ~8 steps)."""
    chain_facts: int = Field(2, ge=1, le=2)
    """synth_chain: facts per record. 2: a record also lists another relation, so the agent must
    pick the question's k-th relation (the tiny policy does not learn that pick: docs/results.md);
    1: only the chain's relation, the hazards alone keep the outcome open."""
    chain_syllables: int = Field(2, ge=1, le=2)
    """synth_chain: syllables per name. 2: 256 names ("Kalo"), two tokens each for the tiny
    policy; 1: the 16 one-syllable names ("Ka"), one token each (an alias is written "Ka-")."""
    cluster: str = Field("", pattern=_CLUSTER)
    """Where rollouts and updates run (docs/cluster.md): empty = this one process, as always
    (Ray is never imported); ``local:N`` = N simulated Ray nodes on this machine
    (``ray.cluster_utils.Cluster``); ``auto`` or ``HOST:PORT`` (``ray://HOST:PORT``) = an existing
    Ray cluster. The flow stays in this process and is the only writer of DuckDB and MLflow; only
    the engines and the trainer ranks become Ray actors. Not part of the run id."""
    rollout_engines: int = Field(1, ge=1, le=1024)
    """Engine actors of the rollout pool when ``cluster`` is set (requests of one tree go to one
    engine, for its prefix cache). Not part of the run id."""
    trainer_ranks: int = Field(1, ge=1, le=1024)
    """Trainer actors (torch.distributed DDP ranks, gloo on CPU, NCCL on GPU) of the policy
    update when ``cluster`` is set; the loss normaliser is summed over ranks, so R ranks compute
    one process's update. Not part of the run id."""
    trainer_strategy: Literal["ddp", "fsdp2"] = "ddp"
    """How the trainer ranks share the update when ``trainer_ranks`` > 1: ``ddp`` = every rank
    holds the whole model and optimiser, gradients all-reduced; ``fsdp2`` = parameters, gradients
    and AdamW state sharded over the ranks (``torch.distributed.fsdp.fully_shard``;
    trace_rl/cluster/fsdp.py). Both compute one process's update and write the same checkpoint.
    Not part of the run id."""
    weight_sync: Literal["disk", "broadcast"] = "disk"
    """How new weights reach the engine actors after an update when ``cluster`` is set: ``disk``
    = each engine loads the checkpoint directory (a file system every node sees); ``broadcast`` =
    trainer rank 0 sends the tensors to every engine over a process group of their own. The
    checkpoint is written either way (resume). Not part of the run id."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Family-specific options passed to the environment factory."""

    @field_validator("*", mode="before")
    @classmethod
    def _float_literals(cls, v: Any, info: Any) -> Any:
        """A float field given as an int (``lr: 1``) or as YAML 1.1 reads ``1e-4`` (a string:
        PyYAML wants a dot in a float's mantissa) becomes a float, so the config hash does not
        depend on how a number was written."""
        if cls.model_fields[info.field_name].annotation is float:
            if isinstance(v, int) and not isinstance(v, bool):
                return float(v)
            if isinstance(v, str) and _FLOAT_LITERAL.match(v.strip()):
                return float(v)
        return v

    @field_validator("family", mode="before")
    @classmethod
    def _registered(cls, v: Any) -> Any:
        if v not in families():
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": (
                ", ".join(map(repr, families()[:-1])) + f" or {families()[-1]!r}")})
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        """The rules that tie fields together, all reported at once."""
        bad = []
        if self.max_per_root < self.min_per_root:
            bad.append(f"max_per_root={self.max_per_root} < min_per_root={self.min_per_root}")
        if self.root_budget < self.min_per_root:
            bad.append(f"root_budget={self.root_budget}; must be >= min_per_root={self.min_per_root}")
        if self.pool_size * self.max_per_root < self.root_budget:
            bad.append(f"pool_size * max_per_root = {self.pool_size * self.max_per_root} cannot "
                       f"hold root_budget={self.root_budget}; raise pool_size or max_per_root")
        if self.tis_cap and self.tis_cap < 1.0:
            bad.append(f"tis_cap={self.tis_cap} must be 0 (off) or >= 1 (the cap on "
                       "pi_train / pi_engine)")
        if self.clip_ratio_c and self.clip_ratio_c <= 1.0 + self.clip_high:
            bad.append(f"clip_ratio_c={self.clip_ratio_c} must be 0 (off) or > 1 + clip_high = "
                       f"{1.0 + self.clip_high}")
        if self.cluster.startswith("local:") and not re.fullmatch(r"local:[1-9][0-9]*", self.cluster):
            bad.append(f"cluster={self.cluster!r}: local:N needs N >= 1 simulated nodes")
        if not self.cluster and (self.rollout_engines > 1 or self.trainer_ranks > 1):
            bad.append(f"rollout_engines={self.rollout_engines}, trainer_ranks="
                       f"{self.trainer_ranks} need a Ray cluster; set cluster=local:N, auto or "
                       "HOST:PORT (or leave both at 1)")
        if bad:
            raise ValueError("\n".join(bad))
        return self

    @property
    def leaf_budget(self) -> int:
        """Trajectories per step at equal cost: M bare rollouts + M * N continuations."""
        return self.root_budget * (1 + self.multiplier)

    @property
    def budget(self) -> Budget:
        """The per-step leaf budget the allocators share (M, N)."""
        return Budget(roots=self.root_budget, multiplier=self.multiplier)

    @property
    def allocator_config(self) -> AllocatorConfig:
        """The allocators' knobs, from this config. DAPO's batch target (half the groups the leaf
        budget affords) is set explicitly: a resumed step may refill with an allocator object
        that never ran the step's first wave."""
        return AllocatorConfig(
            group_size=self.group_size, tree_group=self.tree_group,
            min_per_root=self.min_per_root, max_per_root=self.max_per_root,
            exploration=self.exploration, branch_from_root=self.branch_from_root,
            joint_split=self.joint_split, multiplier=self.multiplier,
            dapo_batch_groups=max(1, self.leaf_budget // self.group_size // 2))

    @property
    def update_settings(self) -> "UpdateSettings":
        """The policy update's settings, from this config (imports torch)."""
        from trace_rl.policy.update import UpdateSettings

        return UpdateSettings(learning_rate=self.learning_rate, clip_low=self.clip_low,
                              clip_high=self.clip_high, kl_coef=self.kl_coef,
                              epochs=self.ppo_epochs, micro_batch=self.micro_batch,
                              agg=self.loss_agg, mini_batches=self.mini_batches,
                              target_kl=self.target_kl,
                              target_position_kl=self.target_position_kl,
                              clip_ratio_c=self.clip_ratio_c,
                              tis_cap=self.tis_cap,
                              trainable_layers=self.trainable_layers)

    @property
    def config_hash(self) -> str:
        """Stable hash of everything that changes results (not the run name or id; rules and
        reasons: ``trace_rl.config_hash``)."""
        return _config_hash(self)

    def family_options(self) -> dict[str, Any]:
        """The fields the family registered as its options (``trace_rl.envs.registry.options``),
        by name: e.g. synth_chain's ``chain_*`` generator parameters."""
        from trace_rl.envs.registry import options

        return {name: getattr(self, name) for name in options(self.family)}

    def env_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the family's factory: ``difficulty`` for a generated family
        (``trace_rl.envs.registry.is_generated``), ``family_options()``, then ``extra``."""
        from trace_rl.envs.registry import is_generated

        kwargs: dict[str, Any] = {"difficulty": self.difficulty} if is_generated(self.family) else {}
        kwargs.update(self.family_options())
        kwargs.update(self.extra)
        return kwargs

    @property
    def resolved_run_id(self) -> str:
        return self.run_id or f"{self.run_name}-{self.config_hash}"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


_FLOAT_LITERAL = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


_MOVED = {"config_from_mapping": "trace_rl.config_load", "load_config": "trace_rl.config_load",
          "check_inputs": "trace_rl.config_checks", "check_policy": "trace_rl.config_checks",
          "check_split": "trace_rl.config_checks"}
"""Names that moved to their own modules, still importable from here. Looked up on first use
(PEP 562) rather than imported: those modules import ``TrainConfig`` from this one."""


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
