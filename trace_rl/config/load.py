"""Building a config from a mapping, a YAML file and ``key=value`` overrides.

Defaults, then the file, then the overrides, validated once; every problem is reported at once,
one line each naming the field, the value given, where it came from and what it may be
(``ConfigError``). The command line's override strings are read as their field's type here, so
that a value that does not parse is reported with the others rather than on its own. A
``TrainConfig`` is read by ``load_config``; any other config model (the warm start's) by
``load_settings``, the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TypeVar, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from trace_rl.config.checks import check_inputs
from trace_rl.config.model import ConfigError, TrainConfig, flat_name, flatten
from trace_rl.config.sections import FIELDS, fields

if TYPE_CHECKING:
    from trace_rl.policy.warmstart.config import WarmstartConfig

Model = TypeVar("Model", bound=BaseModel)


def _explain(exc: ValidationError, where: str, known: Iterable[str] = FIELDS) -> ConfigError:
    """One line per error of ``exc``: the field, the value and type given, what it may be."""
    lines = []
    for e in exc.errors():
        field = ".".join(str(p) for p in e["loc"])  # a flat name (``TrainConfig._flat_errors``)
        if e["type"] == "extra_forbidden":
            lines.append(f"config: unknown field {field!r} in {where}; known: "
                         f"{', '.join(known)}")
        elif not field:  # the model validator: already names its fields
            msg = e["msg"].removeprefix("Value error, ")
            lines += [f"config: {m} (in {where})" for m in msg.splitlines()]
        else:
            v = e["input"]
            lines.append(f"config: {field}={v!r} ({type(v).__name__}) in {where}: "
                         f"{e['msg'].removeprefix('Value error, ')}")
    return ConfigError("\n".join(lines))


def config_from_mapping(data: Mapping[str, Any] | TrainConfig, where: str = "config") -> TrainConfig:
    """Defaults updated by ``data``; every unknown key or bad value is reported at once, naming
    ``where`` it came from."""
    if isinstance(data, TrainConfig):
        return data
    values = flatten(data, where)
    for k, v in warmstart_defaults(values.get("policy"), values.get("family")).items():
        values.setdefault(k, v)  # the settings the warm start trained and measured with
    family = values.get("family", FIELDS["family"].default)
    for k, v in _family_defaults(family).items():
        values.setdefault(k, v)  # splits and token caps that suit the family, unless given
    return _validated(TrainConfig, values, where)


def _validated(model: type[Model], values: Mapping[str, Any], where: str) -> Model:
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise _explain(exc, where, fields() if model is TrainConfig else model.model_fields) from None


WARMSTART_RECORD = "warmstart.json"
"""The record ``trace warmstart`` writes beside a policy's weights
(``trace_rl.policy.warmstart.config.RECORD``; named here to keep this module's imports light)."""


def warmstart_defaults(policy: Any, family: Any = None) -> dict[str, Any]:
    """The ``TrainConfig`` values a warm-started policy directory implies where the user set
    none: its family, the family settings its traces were built with as ``extra`` (HotpotQA's
    ``top_k``/``max_chars``: the observations RL shows it must be the ones SFT taught it to read),
    the top layers it trained (a CPU step updates those, not all 135M parameters), and its
    measured split as ``eval_split``, which no training trace came from (HotpotQA:
    ``dev_heldout``; the family default ``dev`` holds the 400 ``dev_rest`` items the traces were
    built from). Turn and token caps stay the family's (the recipes' own equal them). {} for
    anything else: a named policy, a directory without a ``warmstart.json``, or one warm-started
    for another family than ``family``."""
    from trace_rl.policy.cache import read_record

    if not isinstance(policy, str):
        return {}
    path = Path(policy) / WARMSTART_RECORD
    try:
        record = read_record(policy, WARMSTART_RECORD)
        if record is None:
            return {}
        ws = record["config"]
        out = {"family": ws["family"], "eval_split": ws["eval_split"],
               "trainable_layers": int(ws["trainable_layers"])}
        env_args = dict(ws.get("env_args") or {})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"config: policy={policy!r}: cannot read the warm start's settings from "
                          f"{path}: {type(exc).__name__}: {exc}") from None
    if family is not None and family != out["family"]:
        return {}
    if env_args:
        out["extra"] = env_args
    return out


def _family_defaults(family: Any) -> dict[str, Any]:
    from trace_rl.envs.registry import family_defaults

    return family_defaults(family) if isinstance(family, str) else {}


def _coerce(kind: Any, raw: str) -> Any:
    """A command-line override string as the field's type ``kind``; left as it is when it does
    not parse, so that validation reports it with the other problems."""
    try:
        if kind is bool:
            return {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False,
                    "no": False, "off": False}.get(raw.lower(), raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if get_origin(kind) in (dict, tuple, list):
            return json.loads(raw)
    except ValueError:
        return raw
    return raw


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                train_split: bool = True) -> TrainConfig:
    """Defaults, then a YAML file, then ``key=value`` overrides, validated once (every problem
    reported at once), then its inputs checked (``check_inputs``; ``train_split=False``: all
    but the training split, for a command that does not read it)."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"config: cannot read {path} as a YAML mapping: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config: {path} must hold a mapping of field: value")
        values.update(flatten(data, str(path)))
    values.update(read_overrides(overrides, fields(), "overrides", flat_name))
    where = "overrides" if path is None else (f"{path} + overrides" if overrides else str(path))
    return check_inputs(config_from_mapping(values, where), train_split=train_split)


def read_overrides(items: Sequence[str], fields: Mapping[str, Any], where: str,
                   name_of: Callable[[str, str], str] | None = None) -> dict[str, Any]:
    """``key=value`` strings as values of ``fields`` (their ``FieldInfo`` by name), each read as
    its field's type; ``name_of`` maps a key to its field (``flat_name``: dotted keys)."""
    values: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"config: override {item!r} must look like key=value")
        k, raw = item.split("=", 1)
        name = name_of(k.strip(), where) if name_of else k.strip()
        values[name] = _coerce(fields[name].annotation if name in fields else str, raw)
    return values


def load_settings(model: type[Model], args: Sequence[str], where: str,
                  defaults: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None) -> Model:
    """``key=value`` arguments as a config ``model`` other than ``TrainConfig`` (the warm
    start's), read and reported as ``load_config`` reads overrides; ``defaults(values)`` gives
    values for the fields the arguments leave out."""
    values = read_overrides(args, model.model_fields, where)
    return _validated(model, {**(defaults(values) if defaults else {}), **values}, where)


def warmstart_config(args: Sequence[str]) -> "WarmstartConfig":
    """``trace warmstart``'s ``key=value`` arguments (``family=hotpotqa epochs=1``) as a
    ``WarmstartConfig``, the family's own settings (``family_settings``) filling the fields not given."""
    from trace_rl.policy.warmstart.config import WarmstartConfig, family_settings

    family = WarmstartConfig.model_fields["family"].default
    return load_settings(WarmstartConfig, args, "trace warmstart",
                         lambda values: family_settings(values.get("family", family)))
