"""``trace --help`` lists each command by a one-line summary: typer shows a docstring's whole first
paragraph there, line breaks included, so a summary wrapped over two source lines printed as a
sentence broken in the middle. Each command's first paragraph is one line; details follow a blank
line and appear only in the command's own ``--help``."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from cli.app import app


def _commands(group: typer.Typer, prefix: str = "trace"):
    for info in group.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        yield f"{prefix} {name}", info.callback
    for sub in group.registered_groups:
        yield from _commands(sub.typer_instance, f"{prefix} {sub.name}")


def test_every_command_has_a_one_line_summary():
    found = list(_commands(app))
    assert len(found) >= 10 and any(n == "trace data check" for n, _ in found)
    bad = {}
    for name, callback in found:
        doc = (callback.__doc__ or "").strip()
        summary = doc.split("\n\n")[0]
        if not doc or "\n" in summary or len(summary) > 100:
            bad[name] = summary
    assert not bad, f"commands whose --help summary is not one line of <= 100 characters: {bad}"


def test_the_listing_shows_summaries_not_details():
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
    assert "Evaluate a policy (a checkpoint directory, or a named policy: smollm2)." in out
    assert "Prints accuracy" not in out  # the second paragraph stays in `trace eval --help`
    detail = CliRunner().invoke(app, ["eval", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
    assert "Prints accuracy" in detail
