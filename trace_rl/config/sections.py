"""The config's fields, each declared once, in one model per concern.

``TrainConfig`` (``trace_rl.config.model``) is the tree of these sections; a field keeps one name
in every form of the config (``min_per_root`` flat, ``allocation.min_per_root`` dotted, the
``allocation`` section of a YAML file), and each field is documented here in one sentence (the
first is the Prefect UI form's help). A family's own options are declared with the family, in its
``options`` model (``trace_rl/envs/<family>/``), and taken by the same flat names
(``family_fields``). Why a default is what it is: docs/results.md, "Why the defaults are what
they are".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from trace_core.advantages import ESTIMATORS
from trace_core.allocators import ALLOCATORS, AllocatorConfig, Budget
from trace_rl.engines import ENGINES
from trace_rl.envs.registry import families, spec
from trace_rl.settings import Settings

if TYPE_CHECKING:
    from trace_rl.policy.update import UpdateSettings

_CLUSTER = r"^$|^local:[1-9][0-9]*$|^auto$|^(ray://)?[A-Za-z0-9_.-]+:[0-9]{1,5}$"
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
"""``trace_core.loss.AGGREGATIONS``' names (a test checks they agree; not imported: that module
pulls in torch, and a config must be checked before anything heavy is imported)."""
_RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # as trace_rl.storage.store and MLflow want
_MAX_SEED = 2**32 - 1  # numpy's legacy seeding and some samplers refuse larger seeds

# The names a field may take, read from the registries they select from. (Oracle allocators need
# the true V, which only a simulation has.) The family is checked when a config is built instead
# (``Task._registered``), so that a family registered after this import is accepted.
AllocatorName = Literal[tuple(n for n, f in ALLOCATORS.items() if not f.simulation_only)]  # type: ignore[misc]
AdvantageName = Literal[tuple(ESTIMATORS)]  # type: ignore[misc]
EngineKind = Literal[("auto", *ENGINES)]  # type: ignore[misc]
LossAggregation = Literal[LOSS_AGGREGATIONS]  # type: ignore[misc]


class Section(Settings):
    """One concern of ``TrainConfig``: a ``Settings`` model whose fields keep their flat names in
    every form of the config. The bootstrap's and the warm start's configs (``trace_rl.policy``)
    are models of the same kind."""


class Run(Section):
    """What the run is called, how long it runs, what it starts from and keeps."""

    run_name: str = Field("trace-default", pattern=_RUN_ID)
    """Human name; the run id is ``<run_name>-<config hash>`` unless ``run_id`` is set."""
    run_id: str = Field("", pattern=f"^$|{_RUN_ID}")
    """Explicit run id (re-using one resumes that run); empty = derived from name + config hash."""
    seed: int = Field(0, ge=0, le=_MAX_SEED)
    """Seed of every random choice (roots, sampling, initialisation)."""
    steps: int = Field(20, ge=1)
    """Training steps (each: roots -> level 0 -> level 1 -> update)."""
    policy: str = Field("tiny", min_length=1)
    """A Hugging Face causal LM directory, a named policy (``smollm2``), or ``tiny`` for the
    project's bootstrapped CPU model."""
    checkpoint_every: int = Field(5, ge=1)
    """Register the policy checkpoint in MLflow (weights and tokenizer, without the optimiser
    state that only the newest local checkpoint keeps) every this many steps and at the last."""
    keep_checkpoints: int = Field(0, ge=0)
    """Policy checkpoints kept in the work dir: 0 keeps every step's weights, N >= 1 the newest N
    and those ``checkpoint_every`` registers (not in the run id: it changes what is kept, not
    what is computed)."""
    plot_every: int = Field(1, ge=0)
    """Render a rollout tree and a calibration plot every this many steps (0 = never)."""


class Task(Section):
    """The task family and the items it gives."""

    family: str = Field("synth_arith", json_schema_extra=lambda s: s.update(enum=families()))
    """Task family, a name registered in ``trace_rl.envs.registry`` (checked when the config is
    built, so a family registered later is accepted)."""
    difficulty: int = Field(1, ge=1)
    """Difficulty knob of a generated (synthetic) family; real families ignore it."""
    train_split: str = Field("train", min_length=1)
    """Split (or data file, for real families) that roots are drawn from."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Family-specific options passed to the environment factory."""

    @field_validator("family", mode="before")
    @classmethod
    def _registered(cls, v: Any) -> Any:
        names = [repr(n) for n in families()]
        if not isinstance(v, str) or repr(v) not in names:
            raise PydanticCustomError("literal_error", "Input should be {expected}",
                                      {"expected": f"{', '.join(names[:-1])} or {names[-1]}"})
        return v


class Rollout(Section):
    """How an episode is generated."""

    engine: EngineKind = "auto"
    """Rollout engine: ``hf`` (transformers), ``vllm``, or ``auto`` (per-device default chosen by
    bench/engines.py)."""
    max_turns: int = Field(4, ge=1)
    """Turn cap of an episode."""
    max_new_tokens: int = Field(48, ge=1)
    """Token cap of one turn."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of rollouts."""
    tool_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit of one tool call."""


class Allocation(Section):
    """Where a step's rollout budget goes (Stage 1 across prompts, Stage 2 across prefixes); the
    knobs the allocators share are documented in ``trace_core.allocators.AllocatorConfig``."""

    allocator: AllocatorName = "trace"
    """Budget allocator: trace, trace_cover (coverage-aware Stage 1), grpo, dapo, prompt_only,
    random_prefix."""
    pool_size: int = Field(32, ge=1)
    """Candidate prompts scored by the predictor per step (Stage 1 pool)."""
    root_budget: int = Field(16, ge=2)
    """M: bare rollouts per step, shared across the pool by Stage 1."""
    multiplier: int = Field(2, ge=0)
    """N: continuation multiplier; Stage 2 spends m_i * N continuations on prompt i."""
    min_per_root: int = Field(2, ge=2)
    """Smallest non-zero root allocation (``AllocatorConfig.min_per_root``)."""
    max_per_root: int = Field(8, ge=2)
    """Cap on rollouts per prompt (``AllocatorConfig.max_per_root``)."""
    group_size: int = Field(4, ge=2)
    """Rollouts per prompt of the flat baselines (``AllocatorConfig.group_size``)."""
    tree_group: int = Field(2, ge=2)
    """Uniform bare rollouts per prompt of random_prefix (``AllocatorConfig.tree_group``)."""
    branch_from_root: bool = True
    """Whether TRACE's Stage 2 may also continue a tree from its root
    (``AllocatorConfig.branch_from_root``); off, as in the paper, only depth >= 1 prefixes."""
    joint_split: bool = False
    """Whether TRACE splits the continuation leaves across the whole step, between any tree's
    prefixes and fresh prompts (``AllocatorConfig.joint_split``); off, the paper's split: m_i N
    continuations inside tree i."""
    exploration: float = Field(0.1, ge=0, le=1)
    """Stage 1's pull of long-unsampled prompts' predictions toward 0.5, 0 = off
    (``AllocatorConfig.exploration``)."""
    correlation_window: int = Field(4, ge=0)
    """Previous steps whose stored trees Stage 1 and 2 (trace, prompt_only) estimate rho from,
    the correlation of a node's rollout outcomes given its prediction, to allocate on
    Beta-posterior gains (``tasks.correlation``, ``trace_core.calibration``); 0 = independent
    Bernoulli(V~) draws, the paper's formulas."""
    correlation_min_terms: int = Field(16, ge=1)
    """Nodes a depth needs in the window before its own rho estimate is used (else the pooled
    prefixes' estimate, else 0)."""
    root_posterior: float = Field(0.0, ge=0)
    """Stage 1 (trace, prompt_only): strength k of a per-prompt posterior over the predictor's
    root estimate, V~(x) = (s + k p) / (n + k) from s successes in n earlier bare rollouts of
    prompt x (``trace_core.posterior``); 0 = off (it helps only where prompts recur)."""
    root_oracle: bool = False
    """Whether Stage 1 (trace, prompt_only) scores prompts by the family's oracle
    (``Environment.oracle_success``, scaled to the policy's success so far by
    ``trace_core.posterior.oracle_values``) instead of the predictor, the reference for a
    perfect ranking."""
    oracle_rollouts: int = Field(0, ge=0)
    """Stage 1 and Stage 2 score each candidate (prompt, prefix) by the success rate of this many
    extra rollouts of the current policy from it instead of the predictor, a Monte-Carlo oracle
    for a policy whose true success rates are unknown (0 = off): seeded per step, not trained
    on, not stored in the trees or the ledger; their cost is the step's ``predictor/oracle_*``
    metrics."""

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
        """The allocators' knobs, from this section. DAPO's batch target (half the groups the
        leaf budget affords) is set explicitly: a resumed step may refill with an allocator
        object that never ran the step's first wave."""
        return AllocatorConfig(
            group_size=self.group_size, tree_group=self.tree_group,
            min_per_root=self.min_per_root, max_per_root=self.max_per_root,
            exploration=self.exploration, branch_from_root=self.branch_from_root,
            joint_split=self.joint_split, multiplier=self.multiplier,
            dapo_batch_groups=max(1, self.leaf_budget // self.group_size // 2))


class Update(Section):
    """The tree advantages and the policy update; the update's knobs are documented in
    ``trace_rl.policy.update.UpdateSettings`` where they are its own."""

    advantage: AdvantageName = "branch"
    """Tree advantage estimator (trace_core.advantages): branch, treepo, tree_grpo, segment, grpo."""
    centre_advantages: bool = False
    """Shift each tree's advantages so that its paths' advantages sum to zero
    (``trace_core.advantages.centred``); a no-op for flat groups and zero-sum estimators."""
    count_turns_once: bool = False
    """Divide each turn's advantage by the number of paths that share it
    (``trace_core.advantages.per_node``), so a prefix continued K times weighs once in the loss."""
    learning_rate: float = Field(1e-4, gt=0)
    """AdamW learning rate of the policy (for the tiny CPU policy; about 1e-6 suits a
    multi-billion-parameter model)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many RL steps (0 = off): step s (0-based) uses
    ``learning_rate * (s + 1) / lr_warmup_steps`` until the full rate."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO ratio clip below 1."""
    clip_high: float = Field(0.28, ge=0)
    """PPO ratio clip above 1 (DAPO clip-higher)."""
    clip_ratio_c: float = Field(0.0, ge=0)
    """The policy loss's dual clip, 0 = off (``UpdateSettings.clip_ratio_c``)."""
    tis_cap: float = Field(0.0, ge=0)
    """Truncated importance sampling's cap on pi_train / pi_engine, 0 = off
    (``UpdateSettings.tis_cap``)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty to the initial policy (0 disables it)."""
    loss_agg: LossAggregation = "seq-mean-token-sum"
    """How token losses are averaged (trace_core.loss.AGGREGATIONS): token-mean,
    seq-mean-token-sum, seq-mean-token-mean."""
    ppo_epochs: int = Field(4, ge=1)
    """Passes over a step's paths, each of ``mini_batches`` optimiser steps."""
    micro_batch: int = Field(8, ge=1)
    """Paths per forward/backward pass (memory); gradients are accumulated over micro-batches."""
    mini_batches: int = Field(1, ge=1)
    """Optimiser steps per pass over a step's paths (``UpdateSettings.mini_batches``)."""
    target_kl: float = Field(0.1, ge=0)
    """Trust-region guard of the policy update, 0 = off (``UpdateSettings.target_kl``)."""
    target_position_kl: float = Field(0.0, ge=0)
    """Position-wise trust-region guard, 0 = off (``UpdateSettings.target_position_kl``)."""
    trainable_layers: int = Field(0, ge=0)
    """Decoder layers trained from the top, 0 = all (``UpdateSettings.trainable_layers``)."""

    @property
    def update_settings(self) -> "UpdateSettings":
        """The policy update's settings, from this section (imports torch)."""
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


class Predictor(Section):
    """The shared predictor's online fit."""

    predictor_epochs: int = Field(5, ge=0)
    """Epochs of the predictor's online regression per step."""
    predictor_lr: float = Field(3e-3, gt=0)
    """Learning rate of the predictor head."""


class Eval(Section):
    """The held-out evaluation before the first step and after the last."""

    eval_split: str = Field("test", min_length=1)
    """Held-out split for ``evaluate`` and the train flow's before/after evaluation."""
    eval_items: int = Field(200, ge=0)
    """Held-out items the train flow evaluates the policy on before the first step and after the
    last, paired (same items, same sampling seeds; 0 = none; a bootstrapped policy's own
    selection and report items are skipped)."""
    eval_samples: int = Field(4, ge=1)
    """Rollouts per held-out item, at the training temperature; an item's score is their mean."""


class Cluster(Section):
    """Where rollouts and updates run (docs/cluster.md); none of it enters the run id."""

    cluster: str = Field("", pattern=_CLUSTER)
    """Where rollouts and updates run: empty = this one process (Ray is never imported),
    ``local:N`` = N simulated Ray nodes on this machine, ``auto`` or ``HOST:PORT``
    (``ray://HOST:PORT``) = an existing Ray cluster."""
    rollout_engines: int = Field(1, ge=1, le=1024)
    """Engine actors of the rollout pool when ``cluster`` is set (one tree's requests go to one
    engine, for its prefix cache)."""
    trainer_ranks: int = Field(1, ge=1, le=1024)
    """Trainer actors (torch.distributed ranks, gloo on CPU, NCCL on GPU) of the policy update
    when ``cluster`` is set, together computing one process's update."""
    trainer_strategy: Literal["ddp", "fsdp2"] = "ddp"
    """How the trainer ranks share the update: ``ddp`` (each holds the whole model, gradients
    all-reduced) or ``fsdp2`` (parameters, gradients and AdamW state sharded;
    trace_rl/cluster/fsdp.py)."""
    weight_sync: Literal["disk", "broadcast"] = "disk"
    """How new weights reach the engine actors: ``disk`` (each loads the checkpoint directory,
    on a file system every node sees) or ``broadcast`` (trainer rank 0 sends the tensors over a
    process group of their own)."""


SECTIONS: dict[str, type[Section]] = {
    "run": Run, "task": Task, "rollout": Rollout,
    "allocation": Allocation, "update": Update, "predictor": Predictor, "eval": Eval,
    "cluster": Cluster}
"""The concerns of ``TrainConfig``, in the order its fields are listed (and shown in the UI form)."""
FIELDS: dict[str, FieldInfo] = {n: f for s in SECTIONS.values() for n, f in s.model_fields.items()}
"""Every field of ``TrainConfig`` by its flat name (its ``FieldInfo``: type, default, docstring)."""
CONCERNS: dict[str, tuple[str, ...]] = {c: tuple(s.model_fields) for c, s in SECTIONS.items()}
"""The flat names of each concern's fields; every field is in exactly one."""


def family_fields() -> dict[str, tuple[str, FieldInfo]]:
    """Every registered family's options by flat name: (the family, its ``FieldInfo``). Read
    from the registry when asked, so a family registered later is included; ``TypeError`` for an
    option named as a field of ``FIELDS`` or as another family's option (a flat name names one
    field)."""
    out: dict[str, tuple[str, FieldInfo]] = {}
    for name in families():
        model = spec(name).options
        for field, info in (model.model_fields.items() if model is not None else ()):
            if field in FIELDS or field in out:
                other = "a config field" if field in FIELDS else f"an option of {out[field][0]}"
                raise TypeError(f"family {name!r}: option {field!r} is also {other}; name it "
                                "after the family")
            out[field] = (name, info)
    return out


def fields() -> dict[str, FieldInfo]:
    """Every flat name a ``TrainConfig`` takes: ``FIELDS`` and every family's options."""
    return {**FIELDS, **{n: info for n, (_, info) in family_fields().items()}}
