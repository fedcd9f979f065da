"""``trace data check``: does a data directory hold the files the real families read?"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from cli.output import console
from trace_rl.envs.datadir import check_data_dir, data_families, default_data_dir

data_app = typer.Typer(add_completion=False, no_args_is_help=True,
                       help="The real families' data directory ($TRACE_DATA_DIR).")


@data_app.command()
def check(
    families: List[str] = typer.Argument(None, help="Families to check (default: every family "
                                         "that reads one)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Data directory to check "
                                            "(default: $TRACE_DATA_DIR)."),
) -> None:
    """Name each file a family reads that is missing from the data directory.

    Each missing file is named with the family and splits that need it; exit 1 if any is missing
    (layout and sources: docs/families.md)."""
    readers = data_families()
    wanted = list(dict.fromkeys(families or readers))
    unknown = [f for f in wanted if f not in readers]
    if unknown:
        console.print(f"trace data check: no data directory is read by {', '.join(unknown)}; "
                      f"the families that read one: {', '.join(readers)}",
                      style="red", markup=False)
        raise typer.Exit(2)
    if data_dir is not None:
        root, where = data_dir, "--data-dir"
    else:
        root = default_data_dir()
        where = "$TRACE_DATA_DIR" if os.environ.get("TRACE_DATA_DIR") else \
            "default: shared/data beside the repository; set TRACE_DATA_DIR"
    console.print(f"data directory: {root} ({where})", markup=False)
    if not root.is_dir():
        console.print(f"  {root} is not a directory", style="red", markup=False)
    short = 0
    for family, (files, missing) in check_data_dir(root, wanted).items():
        if not missing:
            console.print(f"{family}: ok, all {len(files)} files", markup=False)
            continue
        short += 1
        console.print(f"{family}: {len(missing)} of {len(files)} files missing", style="red",
                      markup=False)
        for f in missing:
            console.print(f"  missing {f.path} (family {family}, split{'s' * (len(f.splits) > 1)} "
                          f"{', '.join(f.splits)})", markup=False)
    if short:
        console.print("Where each file comes from, and the layout: docs/families.md (Data).",
                      markup=False)
        raise typer.Exit(1)
