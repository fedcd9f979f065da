"""Shared machinery of the synthetic task families: config, seeded splits, JSONL round trip, and a
small JSON-schema argument checker.

Every item is generated from ``random.Random(f"{family}:{seed}:{difficulty}:{split}:{index}")``
(string seeds hash with SHA-512, so items are identical across processes and platforms). An item
belongs to the split picked by a hash of its problem key (``item_key``, the question by default),
so train and test never share a problem, even at difficulties whose problem space is small (each
split then repeats its own problems).
"""

from __future__ import annotations

import abc
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from trace_rl.envs.base import Environment, TaskItem, ToolError
from trace_rl.envs.io import item_from_row, item_to_row, load_jsonl, write_jsonl
from trace_rl.envs.prompt import system_prompt

SPLITS = ("train", "test")
TEST_BUCKETS = 10
"""One problem key in this many belongs to the test split."""
MAX_DIFFICULTY = 5


@dataclass(frozen=True)
class SynthConfig:
    """Knobs shared by the synthetic families."""

    difficulty: int = 1
    """1 (easiest) to 5: hops, operations or calls per task; each family documents its scaling."""
    seed: int = 0
    """Seed of item generation; the same seed gives the same items everywhere."""
    n_train: int = 2000
    """Items in the train split."""
    n_test: int = 400
    """Items in the test split (disjoint from train by problem key): room for the 144 a
    bootstrapped policy is selected and reported on and the train flow's 200 held-out items after
    them (item k does not depend on n_test)."""
    mix: tuple[int, ...] = ()
    """Difficulties of the items, taken in turn (item k of a split has difficulty
    ``mix[k % len(mix)]``), for a pool of prompts of uneven difficulty as in real datasets.
    Empty: every item at ``difficulty``. The environment itself (tools, turn cap) is that of
    ``difficulty``, which must be at least ``max(mix)``."""

    def __post_init__(self) -> None:
        if not 1 <= self.difficulty <= MAX_DIFFICULTY:
            raise ValueError(f"SynthConfig.difficulty={self.difficulty}: use 1..{MAX_DIFFICULTY}")
        object.__setattr__(self, "mix", tuple(self.mix))  # a list from JSON/YAML is fine too
        for d in self.mix:
            if not isinstance(d, int) or not 1 <= d <= self.difficulty:
                raise ValueError(f"SynthConfig.mix={list(self.mix)}: each entry must be an integer "
                                 f"in 1..difficulty={self.difficulty}")
        if self.n_train < 0 or self.n_test < 0:
            raise ValueError(f"SynthConfig: n_train={self.n_train}, n_test={self.n_test} "
                             "must be >= 0")


class SyntheticEnv(Environment):
    """A generated family: subclasses write ``make_item`` and ``check_item`` plus the tools."""

    instructions: str = ""
    """Family-specific first line of the system prompt."""

    def __init__(self, config: SynthConfig | None = None):
        self.config = config or SynthConfig()

    @abc.abstractmethod
    def make_item(self, rng: random.Random, item_id: str) -> TaskItem:
        """One item drawn with ``rng``."""

    @abc.abstractmethod
    def check_item(self, item: TaskItem) -> None:
        """Raise ``ValueError`` naming the field when a stored item cannot be used."""

    def item_key(self, item: TaskItem) -> str:
        """What makes two items the same problem (the question, unless a family says more)."""
        return item.question

    def split_of(self, item: TaskItem) -> str:
        """``test`` for one key in ``TEST_BUCKETS`` (by a hash of ``item_key``), else ``train``."""
        digest = hashlib.sha256(self.item_key(item).encode()).digest()
        return "test" if int.from_bytes(digest[:4], "big") % TEST_BUCKETS == 0 else "train"

    def _generate(self, split: str, n: int) -> list[TaskItem]:
        c = self.config
        if c.mix:
            # Each difficulty's items come from an environment of that difficulty (same seeds and
            # ids as a plain run at it), interleaved so that any prefix of the split is balanced.
            mix = list(c.mix)
            counts = [n // len(mix) + (i < n % len(mix)) for i in range(len(mix))]
            pools = {d: type(self)(SynthConfig(difficulty=d, seed=c.seed))._generate(
                split, sum(k for e, k in zip(mix, counts) if e == d)) for d in set(mix)}
            return [pools[d].pop(0) for d in (mix[k % len(mix)] for k in range(n))]
        return self._draw_items(n, split, f"{self.family}:{c.seed}:{c.difficulty}:{split}",
                                f"{self.family}-d{c.difficulty}-s{c.seed}-{split}", self.make_item,
                                f"{split} items at difficulty {c.difficulty}")

    def _draw_items(self, n: int, bucket: str, seed_key: str, id_prefix: str,
                    make: Callable[[random.Random, str], TaskItem], what: str) -> list[TaskItem]:
        """The first ``n`` items ``make(Random(f"{seed_key}:{k}"), f"{id_prefix}-{k}")``,
        k = 0, 1, ..., whose problem key falls in split ``bucket`` (``split_of``)."""
        items: list[TaskItem] = []
        index = 0
        while len(items) < n:
            if index >= 50 * n + 1000:
                raise ValueError(f"{self.family}: could not draw {n} {what} (only {len(items)}); "
                                 "the problem space is too small")
            item = make(random.Random(f"{seed_key}:{index}"), f"{id_prefix}-{index}")
            index += 1
            if self.split_of(item) == bucket:
                items.append(item)
        return items

    def load(self, split: str, limit: int | None = None) -> list[TaskItem]:
        """``train`` or ``test`` (generated), or the path of a JSONL file written by ``save``."""
        if split not in SPLITS:
            return self._load_file(split, limit)
        n = self.config.n_train if split == "train" else self.config.n_test
        return self._generate(split, n if limit is None else min(limit, n))

    def _load_file(self, path: str, limit: int | None) -> list[TaskItem]:
        if not Path(path).suffix == ".jsonl":
            raise ValueError(f"{self.family}.load: split must be one of {SPLITS} or a .jsonl path, "
                             f"got {path!r}")

        def parse(row: dict[str, Any]) -> TaskItem:
            item = item_from_row(row)
            if item.family != self.family:
                raise ValueError(f"row is of family {item.family!r}, not {self.family!r}")
            self.check_item(item)
            return item

        return load_jsonl(path, parse, limit=limit)

    @staticmethod
    def save(path: str | Path, items: list[TaskItem]) -> Path:
        """Write items as JSONL (``load(path)`` reads them back)."""
        return write_jsonl(path, (item_to_row(i) for i in items))

    def system_prompt(self) -> str:
        return system_prompt(self.instructions, self.tools())


def function_tool(name: str, description: str, properties: Mapping[str, Any],
                  required: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A tool schema in the OpenAI function format; every property is required unless told."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": dict(properties),
                       "required": list(properties if required is None else required)}}}


_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,),
                                            "number": (int, float), "boolean": (bool,)}


def check_arguments(tool: Mapping[str, Any], arguments: Mapping[str, Any]) -> None:
    """Validate ``arguments`` against the ``parameters`` of a function-format ``tool`` (types
    string/integer/number/boolean, ``enum``, ``minimum``/``maximum``, required, no extras).
    Raises ``ToolError`` saying which argument is wrong."""
    fn = tool["function"]
    params = fn["parameters"]
    props: Mapping[str, Any] = params.get("properties", {})
    for key in params.get("required", []):
        if key not in arguments:
            raise ToolError(f"{fn['name']}: missing required argument {key!r}")
    for key, value in arguments.items():
        if key not in props:
            raise ToolError(f"{fn['name']}: unexpected argument {key!r}; expected {sorted(props)}")
        spec = props[key]
        types = _JSON_TYPES[spec["type"]]
        # JSON true is not an integer argument, although Python's bool subclasses int.
        if not isinstance(value, types) or (isinstance(value, bool) and spec["type"] != "boolean"):
            raise ToolError(f"{fn['name']}: argument {key!r} must be {spec['type']}, "
                            f"got {value!r:.40}")
        if "enum" in spec and value not in spec["enum"]:
            raise ToolError(f"{fn['name']}: argument {key!r} must be one of {spec['enum']}, "
                            f"got {value!r:.40}")
        if "minimum" in spec and value < spec["minimum"] or "maximum" in spec and value > spec["maximum"]:
            raise ToolError(f"{fn['name']}: argument {key!r}={value} is outside "
                            f"[{spec.get('minimum')}, {spec.get('maximum')}]")


def need(cond: bool, why: str) -> None:
    """``check_item`` helper: raise ``ValueError(why)`` unless ``cond``."""
    if not cond:
        raise ValueError(why)
