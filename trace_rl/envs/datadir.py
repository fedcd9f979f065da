"""Where the real task families find their data, and which files each needs there.

The data directory is ``$TRACE_DATA_DIR``; unset, the ``shared/data`` folder beside the
repository (where this project's developers keep it). ``expected_files(family)`` lists the files
a family reads under it, as the family registered them (``FamilySpec.data_files``, taken from its
loader's own split table), and ``check_data_dir`` says which are missing (``trace data check``;
docs/families.md, "Data").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


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


def data_families() -> list[str]:
    """The families that read a data directory (the others generate their items), sorted."""
    from trace_rl.envs.registry import families, spec

    return [f for f in families() if spec(f).data_files is not None]


def expected_files(family: str, data_dir: Path | None = None) -> list[DataFile]:
    """The files ``family`` reads under a data directory (``FamilySpec.data_files``); given
    ``data_dir``, also the files its files name there. ``ValueError`` for a family that reads
    none."""
    from trace_rl.envs.registry import spec

    files = spec(family).data_files
    if files is None:
        raise ValueError(f"family {family!r} reads no data directory; the ones that do: "
                         f"{', '.join(data_families())}")
    return _merge(family, files(data_dir))


def check_data_dir(data_dir: Path, families: Sequence[str] | None = None
                   ) -> dict[str, tuple[list[DataFile], list[DataFile]]]:
    """family -> (its expected files, those missing under ``data_dir``), for ``families``
    (default: every family that reads a data directory)."""
    out = {}
    for family in data_families() if families is None else families:
        files = expected_files(family, data_dir)
        out[family] = (files, [f for f in files if not (data_dir / f.path).is_file()])
    return out
