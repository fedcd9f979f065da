"""Where the real task families find their data: ``$TRACE_DATA_DIR``, else ``<repo>/../shared/data``."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    """``$TRACE_DATA_DIR`` when set, else the ``shared/data`` folder next to the repository."""
    env = os.environ.get("TRACE_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"
