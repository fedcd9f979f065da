"""The one typed, frozen configuration of a training run: ``TrainConfig``.

``TrainConfig`` is a tree of the concern sections declared in ``trace_rl.config.sections``
(``cfg.allocation.min_per_root``) and of the family's own options (``cfg.options``: the options
model the family registered, chosen by ``family``); every field is also an attribute, an input
key and a serialised key by its flat name (``cfg.min_per_root``, ``cfg.chain_hops``), so a config
built from flat names, dotted names (``allocation.min_per_root``, ``synth_chain.chain_hops``) or
sections is the same config with the same run id, and its JSON form (what the Prefect UI's form
shows and a run stores) is the flat one. Cross-field rules are one model validator; the
settings for the layers below (``AllocatorConfig``, ``Budget``, ``UpdateSettings``) are derived
by the section that holds their fields and are attributes of the config too (``DERIVED``), so no
default is declared twice. A bad config raises ``ConfigError``, one line per problem.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_serializer, model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

from trace_rl.config.hashing import config_hash as _config_hash
from trace_rl.config.sections import (CONCERNS, FIELDS, SECTIONS, Allocation, Cluster, Eval,
                                      Predictor, Rollout, Run, Task, Update, family_fields)
from trace_rl.envs.registry import families, spec
from trace_rl.settings import Settings

_CONCERN_OF = {name: concern for concern, names in CONCERNS.items() for name in names}


class ConfigError(ValueError):
    """A config that cannot run: one line per problem, each naming the field, the value given
    and what it may be (``config: steps=-1 (int) in overrides: Input should be ...``)."""


class NoOptions(Settings):
    """The options of a family that registered none."""


def options_model(family: str) -> type[Settings]:
    """The options model family ``family`` registered (``NoOptions`` if none); ``KeyError`` for
    an unknown family."""
    return spec(family).options or NoOptions


def concerns() -> dict[str, tuple[str, ...]]:
    """``CONCERNS`` and, as a concern of its own, each family that has options (its name: the
    ``synth_chain.chain_hops`` of a dotted key, the ``synth_chain:`` section of a YAML file)."""
    own = {f: tuple(spec(f).options.model_fields) for f in families() if spec(f).options}
    return {**CONCERNS, **own}


def flat_name(key: str, where: str) -> str:
    """The field a key names: ``allocation.min_per_root`` (by concern, ``concerns``) or the flat
    ``min_per_root``; ``ConfigError`` for a concern that does not hold the field."""
    concern, dot, name = key.partition(".")
    if not dot:
        return key
    known = concerns()
    if concern not in known:
        raise ConfigError(f"config: {key!r} in {where}: no concern {concern!r}; concerns: "
                          f"{', '.join(known)} (or give the flat field name)")
    if name not in known[concern]:
        raise ConfigError(f"config: {key!r} in {where}: {concern} has no field {name!r}; its "
                          f"fields: {', '.join(known[concern])}")
    return name


def flatten(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A mapping with concern sections (``allocation: {min_per_root: 3}``, or a section model)
    and flat or dotted keys, as flat field names; a field given twice is an error. Unknown flat
    keys are kept (validation names them)."""
    out: dict[str, Any] = {}
    known = concerns()

    def put(key: str, value: Any) -> None:
        name = flat_name(key, where)
        if name in out:
            raise ConfigError(f"config: {name!r} is given twice in {where} (flat and by concern)")
        out[name] = value

    for key, value in data.items():
        key = str(key)
        if key in known and isinstance(value, (Mapping, Settings)):
            for sub, v in (value if isinstance(value, Mapping) else dict(value)).items():
                put(f"{key}.{sub}", v)
        elif key in known and key not in FIELDS:
            raise ConfigError(f"config: {key!r} in {where} is a concern and needs a mapping "
                              f"of its fields, e.g. {key}: {{{known[key][0]}: ...}}")
        else:
            put(key, value)
    return out


class TrainConfig(BaseModel):
    """A TRACE training run. ``trace train`` with no config runs these defaults: 20 steps of
    the tiny CPU policy on a synthetic family, evaluated on held-out items before and after, small
    enough for a 2-core machine (figures: docs/results.md, "The default run")."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    run: Run = Field(default_factory=Run)
    task: Task = Field(default_factory=Task)
    options: Settings = Field(default_factory=NoOptions)
    """The family's own options: an instance of the options model its family registered
    (``options_model``), a union keyed by ``family``; each option is also a flat name."""
    rollout: Rollout = Field(default_factory=Rollout)
    allocation: Allocation = Field(default_factory=Allocation)
    update: Update = Field(default_factory=Update)
    predictor: Predictor = Field(default_factory=Predictor)
    eval: Eval = Field(default_factory=Eval)
    cluster_section: Cluster = Field(default_factory=Cluster, alias="cluster")

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        """Flat, dotted and sectioned keys (``flatten``) grouped into the sections and the
        family's options; unknown keys stay at the top, where validation names them. Another
        family's option is dropped at its default (the flat form lists every family's options)
        and refused otherwise."""
        if not isinstance(data, Mapping):
            return data
        flat = flatten(data, "TrainConfig")
        family = flat.get("family", FIELDS["family"].default)
        nested: dict[str, Any] = {"options": flat.pop("options", {})}
        owners = family_fields()
        for name, value in flat.items():
            owner, info = owners.get(name, (None, None))
            if name in _CONCERN_OF:
                nested.setdefault(_CONCERN_OF[name], {})[name] = value
            elif owner is None:
                nested[name] = value
            elif owner == family and isinstance(nested["options"], dict):
                nested["options"][name] = value
            elif value != info.default and family in families():
                raise ConfigError(f"{name}={value!r} is an option of family {owner}, not of "
                                  f"family={family!r}")
        return nested

    @field_validator("options", mode="before")
    @classmethod
    def _family_options(cls, value: Any, info: Any) -> Any:
        """The options as the model of the family validated before them (none if the family
        was refused: that error is reported)."""
        task = info.data.get("task")
        model = options_model(task.family) if task is not None else NoOptions
        if isinstance(value, Settings) and not isinstance(value, model):
            raise ValueError(f"options of family {task.family!r} must be {model.__name__}, "
                             f"not {type(value).__name__}")
        return model.model_validate(value) if isinstance(value, Mapping) else value

    @model_validator(mode="wrap")
    @classmethod
    def _flat_errors(cls, data: Any, handler: Any) -> "TrainConfig":
        """Each error at the field's flat name (``steps``, not ``run.steps``): the name the
        Prefect form, the server's schema and the command line use, so a flow run refused by
        the worker names the field as the form does (``config.steps``)."""
        try:
            return handler(data)
        except ValidationError as exc:
            raise ValidationError.from_exception_data(exc.title, [
                InitErrorDetails(type=PydanticCustomError(e["type"], e["msg"]), input=e["input"],
                                 loc=e["loc"][1:] if len(e["loc"]) > 1 and e["loc"][0] in
                                 (*SECTIONS, "options") else e["loc"])
                for e in exc.errors()]) from None

    @model_serializer(mode="plain")
    def _flat(self) -> dict[str, Any]:
        """Serialised by flat names (what a run stores, MLflow's params, the UI form's values):
        the family's options after the task's fields."""
        out: dict[str, Any] = {}
        for concern in SECTIONS:
            out.update(self.section(concern).model_dump())
            if concern == "task":
                out.update(self.options.model_dump())
        return out

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        """The flat form: one property per field, as the Prefect UI renders it and the server
        enforces it on a deployment's runs."""
        props: dict[str, Any] = {}
        for concern, section in SECTIONS.items():
            props.update(section.model_json_schema()["properties"])
            if concern == "task":  # every family's options: the form is one for all families
                for family in families():
                    if spec(family).options:
                        props.update(spec(family).options.model_json_schema()["properties"])
        return {"title": cls.__name__, "description": " ".join((cls.__doc__ or "").split()),
                "type": "object", "properties": props, "additionalProperties": False}

    def section(self, concern: str) -> Settings:
        """The section of ``concern`` (``cfg.section("cluster")``: ``cfg.cluster`` is that
        section's field of the same name, the Ray address)."""
        return self.__dict__["cluster_section" if concern == "cluster" else concern]

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
        if self.root_oracle and self.oracle_rollouts:
            bad.append(f"root_oracle and oracle_rollouts={self.oracle_rollouts}: Stage 1 takes one "
                       "oracle, the family's or the Monte-Carlo one")
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
    def config_hash(self) -> str:
        """Stable hash of everything that changes results (not the run name or id; rules and
        reasons: ``trace_rl.config.hashing``)."""
        return _config_hash(self.model_dump(), {name: info.default for name, info in
                                                type(self.options).model_fields.items()})

    def family_options(self) -> dict[str, Any]:
        """The family's own options by name (``options``): e.g. synth_chain's ``chain_*``
        generator parameters; {} for a family without."""
        return self.options.model_dump()

    def __getattr__(self, name: str) -> Any:
        """A family option by its flat name (``cfg.chain_hops``: ``cfg.options.chain_hops``)."""
        options = self.__dict__.get("options")
        if options is not None and name in type(options).model_fields:
            return getattr(options, name)
        return super().__getattr__(name)  # type: ignore[misc]

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
        """The flat form: every field by its flat name."""
        return self.model_dump()


DERIVED = {"leaf_budget": "allocation", "budget": "allocation", "allocator_config": "allocation",
           "update_settings": "update"}
"""The settings a section derives from its fields for the layers below (``Allocation.budget``,
``Update.update_settings``), each also an attribute of ``TrainConfig`` by its name."""


def _flat_attribute(concern: str, name: str) -> property:
    doc = FIELDS[name].description if name in FIELDS else getattr(SECTIONS[concern], name).__doc__
    return property(lambda self: getattr(self.section(concern), name), doc=doc)


for _name, _concern in {**_CONCERN_OF, **DERIVED}.items():  # cfg.budget: cfg.allocation.budget
    setattr(TrainConfig, _name, _flat_attribute(_concern, _name))
