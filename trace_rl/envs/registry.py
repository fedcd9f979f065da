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
_DEFAULTS: dict[str, dict[str, Any]] = {}
_GENERATED: set[str] = set()


def register(name: str, factory: Factory, options: tuple[str, ...] = (), *,
             defaults: dict[str, Any] | None = None, generated: bool = False) -> None:
    """Add a family, with everything the rest of the code asks of it. Registering a name twice is
    an error (two families would shadow each other).

    ``options``: ``TrainConfig`` fields the factory takes as keyword arguments of the same names
    (``TrainConfig.env_kwargs`` passes them; e.g. the chain generator's parameters), beside a
    generated family's ``difficulty``.
    ``defaults``: values of ``TrainConfig`` fields the family needs where the user set none
    (splits that exist for it, a turn's token cap long enough for its answers).
    ``generated``: its items come from a seeded generator, not data files: it takes the
    config's ``difficulty``, sizes its own splits, and the tiny CPU policy can be bootstrapped on
    it from its expert actions (``policy=tiny``)."""
    if name in _FACTORIES:
        raise ValueError(f"task family {name!r} is already registered")
    _FACTORIES[name] = factory
    _OPTIONS[name] = tuple(options)
    _DEFAULTS[name] = dict(defaults or {})
    if generated:
        _GENERATED.add(name)


def options(name: str) -> tuple[str, ...]:
    """The ``TrainConfig`` fields family ``name`` reads (empty for an unknown family)."""
    return _OPTIONS.get(name, ())


def family_defaults(name: str) -> dict[str, Any]:
    """The ``TrainConfig`` values family ``name`` needs where the user set none ({} if none)."""
    return dict(_DEFAULTS.get(name, {}))


def is_generated(name: str) -> bool:
    """Whether family ``name`` generates its items (``register``'s ``generated``)."""
    return name in _GENERATED


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
    register(_name, _synthetic(_name), generated=True)


def _chain(**kwargs: Any) -> Environment:
    from trace_rl.envs.synthetic import ChainConfig, SynthChain

    return SynthChain(ChainConfig(**kwargs))


register("synth_chain", _chain, options=("chain_hops", "chain_hazard_a", "chain_hazard_b",
                                         "chain_alias_share", "chain_train_items",
                                         "chain_facts", "chain_syllables"), generated=True)


def _real(module: str, cls: str) -> Factory:
    def build(**kwargs: Any) -> Environment:
        import importlib

        return getattr(importlib.import_module(f"trace_rl.envs.{module}"), cls)(**kwargs)

    return build


# HotpotQA has train/dev splits and a turn cap that holds a bad search, two hops and the answer
# (the warm start's recovery traces); BFCL trains on live_simple and evaluates on simple_python;
# tests/test_real_data.py measures the gold turns against each family's max_new_tokens.
register("hotpotqa", _real("hotpotqa", "HotpotQAEnv"),
         defaults={"train_split": "train", "eval_split": "dev", "max_new_tokens": 128, "max_turns": 5})
register("math", _real("mathenv", "MathEnv"), defaults={"max_new_tokens": 256})
register("bfcl", _real("bfcl", "BFCLEnv"),
         defaults={"train_split": "live_simple", "eval_split": "simple_python", "max_new_tokens": 256})
