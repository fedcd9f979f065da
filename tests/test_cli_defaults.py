"""A setting has one default, the config's: a ``trace`` option or a flow parameter that sets a
config field (``trace eval --samples`` sets ``eval_samples``) declares no default of its own. The
option defaults to None (the config's value is used), and the flow parameter to None or to an
expression that reads the field's default, never a literal copy of it."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

import typer.main

from trace_rl.config import FIELDS
from trace_rl.policy.bootstrap import BootstrapConfig
from trace_rl.policy.warmstart import WarmstartConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = {**{n: f.default for n, f in WarmstartConfig.model_fields.items()},
            **{n: f.default for n, f in BootstrapConfig.model_fields.items()},
            **{n: f.default for n, f in FIELDS.items()}}
"""Each config field's default, by name (a train config's where a name is in several)."""
SETS = {"samples": "eval_samples", "split": "eval_split"}
"""Options and parameters named otherwise than the field they set."""
NOT_A_SETTING = {("replay", "seed"): "the seed of the replay's own Monte Carlo draws",
                 ("replay", "allocator"): "the allocators the replay compares, a list",
                 ("flows.retrain_predictor:retrain_predictor", "epochs"):
                     "the refit's passes over a run's steps, not the warm start's SFT epochs"}
"""Options and parameters named as a field that set something else, and what."""
FLOWS = ["flows.train:train", "flows.evaluate:evaluate", "flows.bootstrap:bootstrap",
         "flows.warmstart:warmstart", "flows.retrain_predictor:retrain_predictor",
         "deployments.retrain:retrain_latest"]


def field_of(name: str) -> str | None:
    name = SETS.get(name, name)
    return name if name in DEFAULTS else None


def commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """(its words, the command) of each command of a click group (typer's own click)."""
    out = []
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            out += commands(command, (*path, name))
        else:
            out.append((" ".join((*path, name)), command))
    return out


def test_a_trace_option_that_sets_a_config_field_leaves_its_default_to_the_config():
    from cli.app import app

    found, own = [], []
    for name, command in commands(typer.main.get_command(app)):
        for param in command.params:
            if param.param_type_name != "option" or (name, param.name) in NOT_A_SETTING:
                continue
            if field_of(param.name):
                found.append(f"{name} --{param.name}")
                if param.default is not None:
                    own.append(f"trace {name} --{param.name}: {param.default!r}")
    assert {"eval --samples", "eval --temperature", "eval --split", "warmstart --engine",
            "bootstrap --seed"} <= set(found), found
    assert not own, own


def test_a_flow_parameter_that_sets_a_config_field_reads_its_default():
    own = []
    for target in FLOWS:
        module, name = target.split(":")
        fn = getattr(importlib.import_module(module), name).fn
        path = Path(inspect.getsourcefile(fn))
        [node] = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(
            n, ast.FunctionDef) and n.name == fn.__name__]
        args = node.args.args + node.args.kwonlyargs
        defaults = dict(zip([a.arg for a in node.args.args][::-1], node.args.defaults[::-1]))
        defaults |= {a.arg: d for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d}
        for arg in args:
            field, given = field_of(arg.arg), defaults.get(arg.arg)
            if field is None or given is None or (target, arg.arg) in NOT_A_SETTING:
                continue
            value = inspect.signature(fn).parameters[arg.arg].default
            if isinstance(given, ast.Constant) and given.value is not None:
                own.append(f"{target} {arg.arg}={given.value!r} (a copy of {field}'s default)")
            elif value is not None and value != DEFAULTS[field]:
                own.append(f"{target} {arg.arg}={value!r} but {field} defaults to "
                           f"{DEFAULTS[field]!r}")
    assert not own, own
