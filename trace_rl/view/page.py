"""The ``trace view`` page: one self-contained HTML file (inline CSS, JS and SVG, no network),
rendered from ``data.page_data``; the same page is served by ``server.serve`` and written by
``trace view --out``."""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from trace_rl.view.data import open_store, page_data

_MARK = "/*__TRACE_DATA__*/null"


def template() -> str:
    """The page template (package data ``trace_rl/view/page.html``)."""
    return (resources.files("trace_rl.view") / "page.html").read_text(encoding="utf-8")


def render(data: dict[str, Any]) -> str:
    """The page with ``data`` embedded as JSON (safe inside a <script>: no ``</`` survives)."""
    blob = json.dumps(_finite(data), default=str, allow_nan=False, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c")  # no "</script>" or "<!--" can end the data block
    page = template()
    if _MARK not in page:
        raise RuntimeError("trace_rl/view/page.html lost its data marker")
    return page.replace(_MARK, blob, 1)


def _finite(x: Any) -> Any:
    """NaN and infinities (not JSON) as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_page(workdir: str | Path, out: str | Path, run: str | None = None,
               step: int | None = None) -> Path:
    """``trace view --out``: the page of ``run`` (default: the newest) as one file, holding the
    given step or, without one, every step of the run that has trees."""
    store = open_store(workdir)
    data = page_data(store, run, step, all_steps=step is None, mode="file")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(data), encoding="utf-8")
    tmp.replace(out)
    return out


def step_page(store: Any, run_id: str, step: int) -> str:
    """The page of one step (what a training step logs to MLflow), read through ``store`` (the
    writer's own store inside the flow: it reads its latest writes). The step's last phase logs
    it, after every row of the step is written, and an artifact never changes: the page shows
    the step complete, not "running" as the store still has it until the flow marks it."""
    data = page_data(store, run_id, step, mode="file")
    for row in [data["details"][str(step)], *(s for s in data["steps"] if s["step"] == step)]:
        row["status"] = "complete"
    return render(data)
