"""What the ``trace`` commands print: the run summary, replay tables, query results and the warm
start's measurements, on one console whose lines stay copy-pastable."""

from __future__ import annotations

import json
import os
import sys

import typer
from rich.console import Console, ConsoleDimensions
from rich.table import Table

PIPE_WIDTH = 400  # a table printed into a pipe or file keeps whole cells for grep and diff


class _Console(Console):
    """Rich's console with its width decided at each print, not once at import: ``COLUMNS`` as it
    is now, else the width of the terminal printed to, else (a pipe or file, whatever
    ``FORCE_COLOR`` says) ``PIPE_WIDTH``, so ``trace runs | grep`` sees whole run ids and field
    names whatever the shell exported."""

    @property
    def size(self) -> ConsoleDimensions:
        columns = os.environ.get("COLUMNS", "")
        if columns.isdigit() and int(columns) > 0:
            return ConsoleDimensions(int(columns), 25)
        try:
            if self.file.isatty():
                width, height = os.get_terminal_size(self.file.fileno())
                if width > 0:
                    return ConsoleDimensions(width, height or 25)
        except (AttributeError, ValueError, OSError):  # no descriptor: a test's or a wrapper's
            pass
        return ConsoleDimensions(PIPE_WIDTH, 25)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


console = _Console(soft_wrap=True, highlight=False)  # commands it prints must stay copy-pastable


def print_summary(summary: dict) -> None:
    """What the run achieved: held-out accuracy before/after with intervals, then per step."""
    b, a, g = summary["before"], summary["after"], summary["gain"]
    if b and a:
        t = Table("held-out accuracy", "value", "95% CI", title=f"run {summary['run_id']}")
        for name, e in ((f"before (step {b['step']})", b), (f"after (step {a['step']})", a)):
            t.add_row(name, f"{e['accuracy']:.3f}", "-" if e["ci_low"] is None
                      else f"[{e['ci_low']:.3f}, {e['ci_high']:.3f}]")
        if g:
            t.add_row(f"gain, paired over {b['items']} items x {b['samples']} samples",
                      f"{g['mean']:+.3f}", f"[{g['low']:+.3f}, {g['high']:+.3f}]")
        console.print(t)
        if g:
            from trace_core.stats import verdict

            console.print(f"training changed held-out accuracy by {100 * g['mean']:+.1f} points: "
                          f"{verdict(g['mean'], g['low'], g['high'])}")
    t = Table("step", "reward", "effective ratio", "leaves", "generated tokens")
    for st in summary["steps"]:
        t.add_row(str(st["step"]), f"{st['reward']:.3f}", f"{st['effective_ratio']:.2f}",
                  str(st["leaves"]), str(st["generated_tokens"]))
    console.print(t)
    console.print(f"spent {summary['leaves']} leaves and {summary['generated_tokens']} generated "
                  "tokens in training")


def print_replay(run: str, budget, steps: list[int], env, replays) -> None:
    """Per step and overall: expected contrastive groups (effective ratio) per allocator."""
    kappa = ", ".join(f"{d}: {k:.2f}" for d, k in sorted(env.kappa.items())) or "none stored"
    console.print(f"replay of {run}: {len(steps)} steps, budget {budget.total} leaves per step "
                  f"(M = {budget.roots}, N = {budget.multiplier}); prompt kappa "
                  f"{env.root_kappa:.2f}, prefix kappa by depth {{{kappa}}}")
    t = Table("step", *[f"{r.allocator}: groups (eff. ratio)" for r in replays])
    for i, s in enumerate(steps):
        t.add_row(str(s), *[f"{r.steps[i].groups:.2f} ± {r.steps[i].groups_se:.2f} "
                            f"({r.steps[i].effective_ratio:.2f})" for r in replays])
    overall = [r.overall() for r in replays]
    t.add_row("mean per step [95% CI]", *[f"{o['groups']:.2f} [{o['groups_low']:.2f}, "
                                          f"{o['groups_high']:.2f}] ({o['effective_ratio']:.2f})"
                                          for o in overall])
    t.add_row("leaves per step", *[f"{o['leaves']:.1f}" for o in overall])
    console.print(t)
    if not env.identified:
        console.print("no continuation is stored in this run: prefix values are taken to scatter "
                      "around their prompt's with kappa = 4 (not estimated)")


def print_query(result, fmt: str, max_rows: int) -> None:
    """``trace sql``'s result as a table (the first ``max_rows`` rows), CSV or JSON."""
    if fmt == "json":
        print(json.dumps(result.to_pylist(), default=str))
    elif fmt == "csv":
        import pyarrow.csv as pacsv

        pacsv.write_csv(result, sys.stdout.buffer)
    elif fmt == "table":
        table = Table(*result.column_names)
        for row in result.slice(0, max_rows).to_pylist():
            table.add_row(*[_cell(v) for v in row.values()])
        console.print(table)
        if result.num_rows > max_rows:
            console.print(f"... {result.num_rows - max_rows} more rows (use --max-rows or --format csv)")
    else:
        raise typer.BadParameter(f"--format {fmt!r}: choose table, csv or json")


def print_runs(rows: list[dict]) -> None:
    """``trace runs``: one row per run, oldest first."""
    def pct(v: object) -> str:
        return "-" if v is None else f"{100 * float(v):.1f}%"

    table = Table("run", "status", "family", "allocator", "steps", "reward", "tokens",
                  "held-out before", "after", "created (UTC)")
    for r in rows:
        table.add_row(r["run_id"], r["status"], str(r["family"]), str(r["allocator"]), r["steps"],
                      "-" if r["reward"] is None else f"{r['reward']:.3f}", f"{r['tokens']:,}",
                      pct(r["before"]), pct(r["after"]), r["created_at"])
    console.print(table)


def print_fields(rows: list[dict]) -> None:
    """``trace config --fields``: one row per field, grouped by concern."""
    table = Table("concern", "field", "default", "may be", "what it does", show_lines=False)
    for r in rows:
        table.add_row(r["concern"], r["name"], repr(r["default"]), r["allowed"], r["doc"])
    console.print(table)
    console.print(f"{len(rows)} fields; set any as key=value after trace train, or in a YAML file "
                  "(trace config prints one)", markup=False)


def _cell(v: object) -> str:
    s = str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def print_warmstart(result: dict, cfg) -> None:
    """The warm start's success before and after SFT, per stage measured, and how to train it."""
    record = result["record"] or {}
    for stage in ("before", "after", "after_t1", "after_greedy"):
        m = record.get(stage)
        if m:
            types = ", ".join(f"{k[8:]} {v:.3f} ({m['items_' + k[8:]]} items)"
                              for k, v in m.items() if k.startswith("success_"))
            console.print(f"{stage.split('_')[0]} SFT: success {m['success']:.3f} at temperature "
                          f"{m['temperature']:g} on {m['items']} {record['eval_split']} items x "
                          f"{record['eval_samples']}; {types}")
    console.print(f"policy: {result['policy_dir']}")
    console.print(f"train it: trace train policy={result['policy_dir']} (family {cfg.family}, "
                  f"its settings and held-out split {cfg.eval_split} come from its warmstart.json)")
