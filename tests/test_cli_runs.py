"""``trace runs``: the work dir's runs in one table, read from a real store (test_store's
hand-worked step): status, steps done of the configured steps, the newest complete step's reward,
generated tokens from the ledger, held-out accuracy before and after; a work dir without a store
exits 2 saying so."""

from __future__ import annotations

import json

from typer.testing import CliRunner
from test_store import LEDGER, LEVEL0, LEVEL1, _eval_row, table

from cli.app import app
from trace_rl.storage import TreeStore
from trace_rl.view.data import open_store, run_table

WIDE = {"COLUMNS": "240", "NO_COLOR": "1"}


def test_runs_lists_each_run_with_its_progress_and_held_out_accuracy(tmp_path):
    s = TreeStore(tmp_path)
    s.init_run("run1", {"family": "synth_arith", "allocator": "trace", "steps": 3})
    s.write_level("run1", 0, 0, table(LEVEL0), None, LEDGER)          # 40 generated tokens
    s.write_level("run1", 0, 1, table(LEVEL1), None, LEDGER)          # and 40 more
    s.mark_step("run1", 0, "running")
    s.mark_step("run1", 0, "complete", {"rollout/reward_mean": 0.25})
    s.mark_step("run1", 1, "running")
    s.mark_step("run1", 1, "complete", {"rollout/reward_mean": 0.5})
    s.mark_step("run1", 2, "running")                                 # not complete
    s.record_eval(_eval_row(0, 0.30))
    s.record_eval(_eval_row(3, 0.55))
    s.init_run("run2", {"family": "bfcl", "allocator": "grpo", "steps": 10})

    rows = run_table(open_store(tmp_path))
    assert [r["run_id"] for r in rows] == ["run1", "run2"]
    one, two = rows
    assert (one["steps"], one["reward"], one["tokens"], one["before"], one["after"]) == (
        "2/3", 0.5, 80, 0.30, 0.55)
    assert (two["steps"], two["reward"], two["tokens"], two["before"], two["after"]) == (
        "0/10", None, 0, None, None)

    out = CliRunner().invoke(app, ["runs", "--workdir", str(tmp_path)], env=WIDE)
    assert out.exit_code == 0, out.output
    line = next(x for x in out.output.splitlines() if "run1" in x)
    for cell in ("synth_arith", "trace", "2/3", "0.500", "80", "30.0%", "55.0%"):
        assert cell in line, (cell, line)
    as_json = CliRunner().invoke(app, ["runs", "-w", str(tmp_path), "--format", "json"], env=WIDE)
    assert as_json.exit_code == 0 and json.loads(as_json.output) == rows
    assert CliRunner().invoke(app, ["runs", "-w", str(tmp_path), "-f", "csv"], env=WIDE).exit_code == 2


def test_runs_without_a_store_exits_2_saying_so(tmp_path):
    out = CliRunner().invoke(app, ["runs", "--workdir", str(tmp_path / "none")], env=WIDE)
    assert out.exit_code == 2 and "no TRACE database" in out.output


def test_a_piped_table_keeps_whole_cells_whatever_columns_was_at_import(tmp_path, monkeypatch):
    """CI exported COLUMNS=80 before the console was built and cut 'synth_arith' to 'synt…':
    the width is read at each print, and output into a pipe without COLUMNS is printed whole."""
    s = TreeStore(tmp_path)
    s.init_run("a_run_id_longer_than_eighty_columns_would_leave_whole_" + "x" * 30,
               {"family": "synth_arith", "allocator": "trace_cover", "steps": 3})
    monkeypatch.setenv("COLUMNS", "80")
    from cli.output import _Console

    built_at_80 = _Console(soft_wrap=True)
    monkeypatch.delenv("COLUMNS")
    assert built_at_80.width > 200                      # not a terminal, no COLUMNS now: wide
    out = CliRunner().invoke(app, ["runs", "--workdir", str(tmp_path)], env={"COLUMNS": None})
    assert out.exit_code == 0, out.output
    for cell in ("synth_arith", "trace_cover", "x" * 30):
        assert cell in out.output, (cell, out.output)
    monkeypatch.setenv("COLUMNS", "100")
    assert built_at_80.width == 100                     # COLUMNS as it is now wins
    monkeypatch.delenv("COLUMNS")
    monkeypatch.setenv("FORCE_COLOR", "1")              # colour forced: still not a terminal
    assert _Console(soft_wrap=True).width > 200
