"""Checking the files a ``TrainConfig`` reads, before any work starts.

A config can be valid field by field and still name a policy directory or a data file that is
not there, or a split too small for its pool: these checks open them (the family's loader, the
policy's ``config.json``) and say what to fix, so that ``trace train`` fails in seconds rather
than after Prefect, the engines and the SFT bootstrap have started.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trace_rl.config.model import TrainConfig


def check_inputs(cfg: TrainConfig, train_split: bool = True) -> TrainConfig:
    """Check the files a run reads before any work starts: the policy directory (unless
    ``tiny``) and the training split, which must load through its family (a data file: UTF-8
    text whose every row parses; errors name the file and line) and hold at least
    ``pool_size`` items. Raises ``ValueError`` (``DatasetError`` for a bad row) saying what to fix.
    ``train_split=False``: the policy and the family only (``trace eval`` reads no training
    split, and checks the split or ``--data`` file it does read itself)."""
    from trace_rl.envs.registry import make_env

    check_policy(cfg)
    try:
        env = make_env(cfg.family, **cfg.env_kwargs())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config: family={cfg.family!r} with extra={dict(cfg.extra)!r}: {exc}") from exc
    if not train_split:
        return cfg
    # Only the training split: the train flow reads nothing else, and a family's default
    # eval_split ("test") need not exist (hotpotqa names its splits differently).
    split = cfg.train_split
    items = check_split(cfg, split, "train_split", env)
    if len(items) < cfg.pool_size:
        raise ValueError(f"config: train_split={split!r} of family {cfg.family!r} holds "
                         f"{len(items)} items; pool_size={cfg.pool_size} needs as many")
    caps = [c for c in (env.turn_cap(it) for it in items) if c is not None]
    if caps and cfg.max_turns < max(caps):
        raise ValueError(f"config: max_turns={cfg.max_turns} is below the turn cap of some "
                         f"{cfg.family} items ({max(caps)}: hops + 3); set max_turns={max(caps)} "
                         f"or more (each item keeps its own cap)")
    return cfg


def check_policy(cfg: TrainConfig) -> None:
    """The policy must be ``tiny`` on a family that can bootstrap it (``Bootstrap`` registered:
    the synthetic ones), a named policy
    (``trace_rl.policy.named``: ``smollm2``) or a Hugging Face model directory; ``ValueError``
    says which to give otherwise."""
    from trace_rl.envs.registry import spec
    from trace_rl.policy.named import NAMED, check_named

    names = ", ".join(f"{k} ({v[0]})" for k, v in NAMED.items())
    if cfg.policy == "tiny":
        if spec(cfg.family).bootstrap is None:
            raise ValueError(f"config: policy=tiny is bootstrapped on the synthetic families only, "
                             f"not on family={cfg.family!r}; give policy=<Hugging Face model "
                             f"directory>, a named policy ({names}), or warm-start one with "
                             f"`trace warmstart family={cfg.family}`")
        return
    if cfg.policy in NAMED:
        check_named(cfg.policy)
        return
    policy = Path(cfg.policy)
    if not (policy / "config.json").is_file():
        raise ValueError(f"config: policy={cfg.policy!r} is not a Hugging Face model directory "
                         f"(no {policy / 'config.json'}); give one, a named policy ({names}), or "
                         f"'tiny' for the bootstrapped CPU policy of a synthetic family")
    layers = json.loads((policy / "config.json").read_text()).get("num_hidden_layers")
    if isinstance(layers, int) and cfg.trainable_layers > layers:
        raise ValueError(f"config: trainable_layers={cfg.trainable_layers} but policy="
                         f"{cfg.policy!r} has {layers} decoder layers")


def check_split(cfg: TrainConfig, split: str, what: str, env: Any = None) -> list[Any]:
    """The items of ``split`` (a split name or a data file) of ``cfg``'s family; raises
    ``ValueError`` in one line naming ``what`` (``train_split``, ``eval_split``, ``--data``) and,
    for a split the family lacks, its valid splits (``DatasetError`` for a bad row)."""
    from trace_rl.envs.base import DatasetError
    from trace_rl.envs.io import check_text_file
    from trace_rl.envs.registry import make_env

    if env is None:
        env = make_env(cfg.family, **cfg.env_kwargs())
    if Path(split).suffix or Path(split).is_file():  # a data file rather than a split name
        check_text_file(split)
    try:
        return env.load(split)
    except DatasetError:
        raise  # names the file and line already
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise ValueError(f"config: {what}={split!r} of family {cfg.family!r}: {exc}") from exc
