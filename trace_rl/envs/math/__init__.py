"""``math``: GSM8K, MATH-500 and AIME 2024 with a sandboxed ``python`` tool (``env``; the box is
``trace_rl.sandbox``), graded by math-verify equivalence."""

from __future__ import annotations

from pathlib import Path

from trace_rl.envs.registry import family


def data_files(data_dir: Path | None) -> list[tuple[Path, str]]:
    """Every split's file, under ``math/`` (``MathEnv.load``)."""
    from trace_rl.envs.math.env import SPLITS

    return [(Path("math") / f, split) for split, f in SPLITS.items()]


@family("math", defaults={"max_new_tokens": 256}, data_files=data_files)
def make(**kwargs):
    from trace_rl.envs.math.env import MathEnv

    return MathEnv(**kwargs)
