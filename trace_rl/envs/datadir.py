"""Where the real task families find their data, and which files each needs there.

The data directory is ``$TRACE_DATA_DIR``; unset, the ``shared/data`` folder beside the
repository (where this project's developers keep it). ``expected_files(family)`` lists the files
a family reads under it, taken from the loaders' own split tables (``hotpotqa.SPLITS``,
``mathenv.SPLITS``, BFCL's ``CATEGORIES``), and ``check_data_dir`` says which are missing
(``trace data check``; docs/families.md, "Data").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

REAL_FAMILIES = ("hotpotqa", "math", "bfcl")
"""The task families that read a data directory (the synthetic ones generate their items)."""


def default_data_dir() -> Path:
    """``$TRACE_DATA_DIR`` when set, else the ``shared/data`` folder next to the repository."""
    env = os.environ.get("TRACE_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


@dataclass(frozen=True)
class DataFile:
    """One file a family reads: its path under the data directory and the splits that need it."""

    family: str
    path: Path
    splits: tuple[str, ...]


def _merge(family: str, pairs: list[tuple[Path, str]]) -> list[DataFile]:
    """(path, split) pairs as one ``DataFile`` per path, in first-seen order."""
    splits: dict[Path, list[str]] = {}
    for path, split in pairs:
        splits.setdefault(path, []).append(split)
    return [DataFile(family, path, tuple(s)) for path, s in splits.items()]


def _hotpotqa() -> list[tuple[Path, str]]:
    from trace_rl.envs.hotpotqa import SPLITS

    folder = Path("multihop_qa")  # HotpotQAEnv.load's folder
    return [(folder / f, split) for split, files in SPLITS.items() for f in files if f]


def _math() -> list[tuple[Path, str]]:
    from trace_rl.envs.mathenv import SPLITS

    return [(Path("math") / f, split) for split, f in SPLITS.items()]  # MathEnv.load's folder


def _bfcl() -> list[tuple[Path, str]]:
    from trace_rl.envs.bfcl.constants import BFCL_DIR, CATEGORIES, IRRELEVANCE

    pairs = []
    for category in CATEGORIES:  # BFCLEnv.load and load_bfcl_file
        name = f"BFCL_v4_{category}.json"
        pairs.append((BFCL_DIR / name, category))
        if category not in IRRELEVANCE:
            pairs.append((BFCL_DIR / "possible_answer" / name, category))
    return pairs


_FILES = {"hotpotqa": _hotpotqa, "math": _math, "bfcl": _bfcl}


def expected_files(family: str) -> list[DataFile]:
    """The files ``family`` reads under a data directory (``ValueError`` for a family that
    reads none)."""
    if family not in _FILES:
        raise ValueError(f"family {family!r} reads no data directory; the ones that do: "
                         f"{', '.join(REAL_FAMILIES)}")
    return _merge(family, _FILES[family]())


def _multi_turn_docs(data_dir: Path) -> list[DataFile]:
    """The function docs that BFCL's multi-turn rows name (``involved_classes``), read from the
    question file as ``load_bfcl_file`` reads them; none when the file or bfcl-eval (which maps
    a class to its doc file) is missing: the question file is then reported, or loading says
    what to install."""
    from trace_rl.envs.bfcl.constants import BFCL_DIR, MULTI_TURN

    try:
        from trace_rl.envs.bfcl.backends import bfcl_eval_backends

        mapping = bfcl_eval_backends().MULTI_TURN_FUNC_DOC_FILE_MAPPING
    except ImportError:
        return []
    pairs = []
    for category in MULTI_TURN:
        question = data_dir / BFCL_DIR / f"BFCL_v4_{category}.json"
        if not question.is_file():
            continue
        with question.open(encoding="utf-8") as fh:
            classes = {c for line in fh if line.strip()
                       for c in json.loads(line).get("involved_classes", [])}
        pairs += [(BFCL_DIR / "multi_turn_func_doc" / mapping[c], category)
                  for c in sorted(classes) if c in mapping]
    return _merge("bfcl", pairs)


def check_data_dir(data_dir: Path, families: tuple[str, ...] | list[str] = REAL_FAMILIES
                   ) -> dict[str, tuple[list[DataFile], list[DataFile]]]:
    """family -> (its expected files, those missing under ``data_dir``)."""
    out = {}
    for family in families:
        files = expected_files(family)
        if family == "bfcl":
            files += _multi_turn_docs(data_dir)
        out[family] = (files, [f for f in files if not (data_dir / f.path).is_file()])
    return out
