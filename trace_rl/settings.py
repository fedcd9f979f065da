"""The one kind of model a setting is declared in: ``Settings``.

The train config's sections (``trace_rl.config.sections``), a family's own options (its
``options`` model, ``trace_rl/envs/<family>/``) and the bootstrap's and the warm start's configs
(``trace_rl.policy``) are ``Settings``; it sits below those packages, so that a family declares
its options where it lives without importing the config.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

_FLOAT_LITERAL = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class Settings(BaseModel):
    """A frozen, strictly typed group of settings, each with a range and a docstring (its one
    sentence of documentation). A float field given as an int (``lr: 1``) or as YAML 1.1 reads
    ``1e-4`` (a string: PyYAML wants a dot in a float's mantissa) becomes a float, so a hash of
    the settings does not depend on how a number was written."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _float_literals(cls, v: Any, info: Any) -> Any:
        if cls.model_fields[info.field_name].annotation is float:
            if isinstance(v, int) and not isinstance(v, bool):
                return float(v)
            if isinstance(v, str) and _FLOAT_LITERAL.match(v.strip()):
                return float(v)
        return v
