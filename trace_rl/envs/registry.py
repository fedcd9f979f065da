"""The one registry of task families: family name -> factory of an ``Environment``.

``make_env("synth_arith", difficulty=2)`` builds a family from keyword arguments (the config edge);
code elsewhere never branches on family names. Factories import their module lazily, so listing
families costs nothing and a family whose extra dependencies are missing only fails when built.
"""

from __future__ import annotations

from typing import Any, Callable

from trace_rl.envs.base import Environment

Factory = Callable[..., Environment]
_FACTORIES: dict[str, Factory] = {}
_OPTIONS: dict[str, tuple[str, ...]] = {}


def register(name: str, factory: Factory, options: tuple[str, ...] = ()) -> None:
    """Add a family. Registering a name twice is an error (two families would shadow each other).
    ``options``: ``TrainConfig`` fields the factory takes as keyword arguments of the same names
    (``TrainConfig.env_kwargs`` passes them; e.g. the chain generator's parameters)."""
    if name in _FACTORIES:
        raise ValueError(f"task family {name!r} is already registered")
    _FACTORIES[name] = factory
    _OPTIONS[name] = tuple(options)


def options(name: str) -> tuple[str, ...]:
    """The ``TrainConfig`` fields family ``name`` reads (empty for an unknown family)."""
    return _OPTIONS.get(name, ())


FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "hotpotqa": {"train_split": "train", "eval_split": "dev", "max_new_tokens": 128,
                 "max_turns": 5},
    "bfcl": {"train_split": "live_simple", "eval_split": "simple_python", "max_new_tokens": 256},
    "math": {"max_new_tokens": 256},
}
"""Per-family values of ``TrainConfig`` fields that the user did not set: splits that exist for
the family (HotpotQA has ``train``/``dev``; BFCL has categories, and trains on ``live_simple``
while it evaluates on ``simple_python``) and a turn's token cap long enough for the family's
answers (``tests/test_real_data.py`` measures the gold turns against it); HotpotQA's turn cap
holds a bad search, two hops and the answer (the warm start's recovery traces)."""


def family_defaults(name: str) -> dict[str, Any]:
    """The ``TrainConfig`` values family ``name`` needs where the user set none ({} if none)."""
    return dict(FAMILY_DEFAULTS.get(name, {}))


def families() -> list[str]:
    """Registered family names, sorted."""
    return sorted(_FACTORIES)


def make_env(name: str, **kwargs: Any) -> Environment:
    """Build family ``name`` with its keyword arguments (e.g. ``difficulty``, ``seed``)."""
    if name not in _FACTORIES:
        raise KeyError(f"unknown task family {name!r}; registered: {', '.join(families())}")
    env = _FACTORIES[name](**kwargs)
    if env.family != name:
        raise TypeError(f"factory for {name!r} built an environment of family {env.family!r}")
    return env


def _synthetic(name: str) -> Factory:
    def build(**kwargs: Any) -> Environment:
        from trace_rl.envs.synthetic import FAMILIES, SynthConfig

        return FAMILIES[name](SynthConfig(**kwargs))

    return build


for _name in ("synth_lookup", "synth_arith", "synth_fncall"):
    register(_name, _synthetic(_name))


def _chain(**kwargs: Any) -> Environment:
    from trace_rl.envs.synthetic import ChainConfig, SynthChain

    return SynthChain(ChainConfig(**kwargs))


register("synth_chain", _chain, options=("chain_hops", "chain_hazard_a", "chain_hazard_b",
                                         "chain_alias_share", "chain_train_items",
                                         "chain_facts", "chain_syllables"))


def _real(module: str, cls: str) -> Factory:
    def build(**kwargs: Any) -> Environment:
        import importlib

        return getattr(importlib.import_module(f"trace_rl.envs.{module}"), cls)(**kwargs)

    return build


for _name, _module, _cls in (("hotpotqa", "hotpotqa", "HotpotQAEnv"), ("math", "mathenv", "MathEnv"),
                             ("bfcl", "bfcl", "BFCLEnv")):
    register(_name, _real(_module, _cls))
