"""The one registry of task families: family name -> what the rest of the code asks of it.

A family is one folder, ``trace_rl/envs/<name>/``, whose ``__init__.py`` registers it once, with
the ``family`` decorator on the factory of its ``Environment``::

    @family("synth_arith", generated=True, bootstrap=Bootstrap(thoughts=expert_thoughts))
    def make(**kwargs):
        from trace_rl.envs.synth_arith.env import SynthArith, SynthConfig
        return SynthArith(SynthConfig(**kwargs))

``families()`` finds the families by listing this package's folders and importing each one's
``__init__.py``, so that file stays light: the factory imports the environment's modules (BM25,
math-verify, ...) only when a family is built. ``make_env("synth_arith", difficulty=2)`` builds a
family from keyword arguments (the config edge). Code elsewhere never tests a family's name: it
reads the family's registered capabilities (``spec(name)``: generated items, a bootstrap recipe,
a warm-start trace builder, data files, grading by replay) and its defaults. docs/families.md,
"Adding a family", walks through one.
"""

from __future__ import annotations

import importlib
import pkgutil
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from trace_rl.envs.base import Action, Environment, TaskItem
from trace_rl.settings import Settings

Factory = Callable[..., Environment]
Thoughts = Callable[[TaskItem, Sequence[Action]], "list[str]"]
"""(item, action script) -> the thought written before each action."""
TraceBuilder = Callable[[Environment, TaskItem, random.Random, bool, Any],
                        "tuple[list[Action], list[str]] | None"]
"""(env, training item, rng, recovery?, the warm start's config) -> (actions, the thought before
each), or None when the item cannot give that trace."""
DataFiles = Callable[["Path | None"], "list[tuple[Path, str]]"]
"""(data directory, or None) -> (path under the data directory, split that needs it) for each
file the family reads; given the directory, also the files its files name (BFCL's multi-turn
function docs)."""


@dataclass(frozen=True)
class Bootstrap:
    """The family can bootstrap the tiny CPU policy (``policy=tiny``): SFT on its expert actions
    (``Environment.expert_actions``), a share of them made imperfect
    (``trace_rl.policy.bootstrap``)."""

    thoughts: Thoughts | None = None
    """The thought before each expert action (None: ``<think></think>``). A ``version``
    attribute on the function enters the bootstrapped policy's cache key."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """``BootstrapConfig`` settings where its defaults do not suit the family."""
    variants: tuple[tuple[Mapping[str, Any], Mapping[str, Any]], ...] = ()
    """(the family options a variant has, its settings over ``settings``)."""


@dataclass(frozen=True)
class Warmstart:
    """The family can warm-start a real model (``trace warmstart family=...``): SFT on ReAct
    traces of its training items (``trace_rl.policy.warmstart``)."""

    trace: TraceBuilder
    settings: Mapping[str, Any] = field(default_factory=dict)
    """``WarmstartConfig`` fields whose defaults (HotpotQA's recipe) do not fit the family."""


@dataclass(frozen=True)
class FamilySpec:
    """Everything the code asks of a family, given once, where it registers."""

    name: str
    factory: Factory
    options: type[Settings] | None = None
    """The family's own options, a ``Settings`` model declared in its folder (each option's
    type, range, default and sentence, once): ``TrainConfig`` takes them by their names when it
    is set to this family (``TrainConfig.options``) and the factory gets them as keyword
    arguments of the same names (``TrainConfig.family_options``)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Values of ``TrainConfig`` fields the family needs where the user set none (splits that
    exist for it, a turn's token cap long enough for its answers)."""
    generated: bool = False
    """Its items come from a seeded generator, not data files: the factory takes the config's
    ``difficulty`` and sizes its own splits."""
    bootstrap: Bootstrap | None = None
    warmstart: Warmstart | None = None
    data_files: DataFiles | None = None
    """It reads a data directory (``$TRACE_DATA_DIR``): the files, for ``trace data check``."""
    score_by_replay: bool = False
    """``trace score`` grades a prediction's ``calls`` by replaying them through the tools and
    grading the state they leave (``env.verify_final``), not with ``env.verify``."""


_FAMILIES: dict[str, FamilySpec] = {}
_FOUND: set[str] = set()
_LOCK = threading.RLock()


def register(name: str, factory: Factory, options: type[Settings] | None = None, *,
             defaults: Mapping[str, Any] | None = None, generated: bool = False,
             bootstrap: Bootstrap | None = None, warmstart: Warmstart | None = None,
             data_files: DataFiles | None = None, score_by_replay: bool = False) -> FamilySpec:
    """Add a family (``FamilySpec``'s fields). Registering a name twice is an error (two families
    would shadow each other). A family's folder calls it through ``family``."""
    with _LOCK:
        if name in _FAMILIES:
            raise ValueError(f"task family {name!r} is already registered")
        if options is not None and not (isinstance(options, type) and issubclass(options, Settings)):
            raise TypeError(f"task family {name!r}: options must be a Settings model, not "
                            f"{options!r}")
        _FAMILIES[name] = FamilySpec(name, factory, options, dict(defaults or {}),
                                     generated, bootstrap, warmstart, data_files, score_by_replay)
        return _FAMILIES[name]


def family(name: str, **capabilities: Any) -> Callable[[Factory], Factory]:
    """Decorator: register the decorated factory as family ``name`` (``register``'s keyword
    arguments). It must sit in the family's own folder, ``.../<name>/__init__.py``."""

    def decorate(factory: Factory) -> Factory:
        folder = factory.__module__.rpartition(".")[2]
        if folder != name:
            raise ValueError(f"task family {name!r} is registered in {factory.__module__}: a "
                             f"family lives in the folder of its name (trace_rl/envs/{name}/)")
        register(name, factory, **capabilities)
        return factory

    return decorate


def _discover() -> None:
    """Import every family folder of this package not imported yet (each registers itself)."""
    import trace_rl.envs as package

    with _LOCK:
        for info in pkgutil.iter_modules(package.__path__):
            if info.ispkg and info.name not in _FOUND:
                _FOUND.add(info.name)
                importlib.import_module(f"{package.__name__}.{info.name}")


def families() -> list[str]:
    """Registered family names, sorted."""
    _discover()
    return sorted(_FAMILIES)


def spec(name: str) -> FamilySpec:
    """Family ``name``'s registration; ``KeyError`` naming the registered ones for another."""
    if name not in _FAMILIES:
        _discover()
    if name not in _FAMILIES:
        raise KeyError(f"unknown task family {name!r}; registered: {', '.join(families())}")
    return _FAMILIES[name]


def _get(name: str) -> FamilySpec | None:
    try:
        return spec(name)
    except KeyError:
        return None


def options(name: str) -> tuple[str, ...]:
    """The names of family ``name``'s own options (empty for an unknown family or one without)."""
    found = _get(name)
    return tuple(found.options.model_fields) if found and found.options else ()


def family_defaults(name: str) -> dict[str, Any]:
    """The ``TrainConfig`` values family ``name`` needs where the user set none ({} if none)."""
    found = _get(name)
    return dict(found.defaults) if found else {}


def is_generated(name: str) -> bool:
    """Whether family ``name`` generates its items (``FamilySpec.generated``)."""
    found = _get(name)
    return bool(found and found.generated)


def make_env(name: str, **kwargs: Any) -> Environment:
    """Build family ``name`` with its keyword arguments (e.g. ``difficulty``, ``seed``)."""
    env = spec(name).factory(**kwargs)
    if env.family != name:
        raise TypeError(f"factory for {name!r} built an environment of family {env.family!r}")
    return env
