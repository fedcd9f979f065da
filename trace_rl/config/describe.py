"""The config as a person reads it (``trace config``): a resolved ``TrainConfig`` as YAML that
``trace train --config`` takes back unchanged, and every field with its default, what it may be
and its one sentence of documentation."""

from __future__ import annotations

import re
import typing
from typing import Any

import yaml
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic.fields import FieldInfo

from trace_rl.config.model import TrainConfig
from trace_rl.config.sections import CONCERNS, SECTIONS, family_fields

_BOUNDS = ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<"),
           (MinLen, "min_length", "length >="), (MaxLen, "max_length", "length <="))


def _first_sentence(text: str) -> str:
    """Up to the first full stop followed by a space (not one inside ``e.g.``)."""
    return re.split(r"(?<!e\.g)(?<!i\.e)\.\s", text, maxsplit=1)[0].rstrip(".") + "." if text else ""


def as_yaml(cfg: TrainConfig) -> str:
    """Every field of ``cfg`` by its flat name, grouped by concern under a comment (the family's
    options after the task's fields): ``trace train --config`` reads it back as ``cfg``."""
    flat = cfg.model_dump(mode="json")
    own = list(cfg.family_options())
    parts = []
    for concern, names in CONCERNS.items():
        doc = _first_sentence(" ".join((SECTIONS[concern].__doc__ or "").split()))
        block = {n: flat[n] for n in names}
        parts.append(f"# {concern}: {doc}\n" + yaml.safe_dump(block, sort_keys=False))
        if concern == "task" and own:
            parts.append(f"# the options of family {cfg.family}\n"
                         + yaml.safe_dump({n: flat[n] for n in own}, sort_keys=False))
    return "\n".join(parts)


def allowed(info: FieldInfo) -> str:
    """What a field may be, in a few words: its choices, or its type and bounds."""
    kind = info.annotation
    if typing.get_origin(kind) is typing.Literal:
        return " | ".join(str(c) for c in typing.get_args(kind))
    name = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
    bounds = [f"{sign} {getattr(m, attr)}" for m in info.metadata
              for cls, attr, sign in _BOUNDS if isinstance(m, cls)]
    pattern = next((getattr(m, "pattern", None) for m in info.metadata
                    if getattr(m, "pattern", None)), None)
    return ", ".join([name, *bounds] + ([f"matching {pattern}"] if pattern else []))


def field_rows(match: str = "") -> list[dict[str, Any]]:
    """Every flat name ``TrainConfig`` takes, in concern order then the families' options: its
    concern (or family), default, what it may be and the first sentence of its docstring;
    ``match``: only names containing it (case-insensitive)."""
    rows = [(concern, name, SECTIONS[concern].model_fields[name])
            for concern, names in CONCERNS.items() for name in names]
    rows += [(f"family {family}", name, info) for name, (family, info) in family_fields().items()]
    out = []
    for where, name, info in rows:
        if match.lower() not in name.lower():
            continue
        doc = " ".join((info.description or "").split())
        first = _first_sentence(doc)
        out.append({"concern": where, "name": name, "default": info.get_default(call_default_factory=True),
                    "allowed": allowed(info), "doc": first})
    return out
