"""The ``trace`` command: train, evaluate, bootstrap, query and grade.

Every command takes ``--workdir DIR`` (default ``./trace_runs``, or $TRACE_WORKDIR): the DuckDB
file, the MLflow store, checkpoints and cached task results live there. Flows run in-process with
Prefect's embedded default (no server needed); set PREFECT_API_URL to use a server instead.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from trace_rl import environ

environ.apply()  # Prefect's start-up limit and quiet defaults, before any flow imports prefect

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="TRACE: tree rollout allocation for sample-efficient agentic RL.")
console = Console(soft_wrap=True, highlight=False)  # commands it prints must stay copy-pastable
WORKDIR_HELP = "Work dir holding trace.duckdb, the MLflow store and checkpoints."
DEFAULT_WORKDIR = "trace_runs"


def _workdir(workdir: Optional[str]) -> str:
    return str(Path(workdir or os.environ.get("TRACE_WORKDIR", DEFAULT_WORKDIR)).resolve())


@contextmanager
def prefect_ready() -> Iterator[None]:
    """Import the flow modules (the body) and start Prefect's temporary server, saying so at least
    every 10 s: on a loaded machine the imports (torch, Prefect, MLflow) and the first start of
    the server on a new PREFECT_HOME (it creates its database) each take up to a minute, which
    reads as a hang when nothing is printed. The flow then finds the server running (Prefect
    keeps one per process). With PREFECT_API_URL set, a real server is used and nothing starts."""
    from trace_rl.progress import Progress

    with Progress("trace", 0, every_s=10) as progress:
        progress.note("loading torch, Prefect and the flows")
        yield
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

        if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
            return
        from prefect.server.api.server import SubprocessASGIServer

        progress.note("starting Prefect's temporary server (the first start on a new "
                      "PREFECT_HOME creates its database)")
        SubprocessASGIServer().start()


def _load_config(config: Optional[Path], overrides: Optional[List[str]]):
    """The validated config with its inputs checked; a bad value or file exits with status 2
    and one line naming it, before anything slow is imported."""
    from trace_rl.config import load_config

    try:
        return load_config(config, overrides or [])
    except ValueError as exc:  # DatasetError included: it names the file and line
        console.print(f"trace: {exc}", style="red", markup=False)
        raise typer.Exit(2)


@app.command()
def train(
    overrides: List[str] = typer.Argument(None, help="Config overrides as key=value (e.g. steps=5)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
    wait: bool = typer.Option(False, "--wait", help="If another run is training in the work dir, "
                              "wait for it to finish instead of exiting."),
    data: Optional[Path] = typer.Option(None, "--data", help="Your own data file to train on "
                                        "(sets train_split; formats in docs/families.md)."),
) -> None:
    """Run the train flow (the embedded default when no config is given).

    One run trains a work dir at a time: if another is running there, this exits at once
    (status 3) naming it, unless --wait."""
    cfg = _load_config(config, _with_data(overrides, data, "train_split"))  # before Prefect, the flow or the bootstrap start
    wd = _workdir(workdir)
    console.print(f"[bold]trace train[/] run [cyan]{cfg.resolved_run_id}[/]: {cfg.family}, "
                  f"allocator {cfg.allocator}, {cfg.steps} steps, {cfg.leaf_budget} leaves/step; "
                  f"workdir {wd}")
    from trace_rl.storage.locks import WorkdirBusyError, train_lock

    try:  # taken before torch and Prefect load: a busy work dir is refused in a second
        with train_lock(wd, cfg.resolved_run_id, wait=wait):
            with prefect_ready():
                from flows.train import train as train_flow
            result = train_flow(config=cfg, workdir=wd, wait=wait)
    except WorkdirBusyError as exc:
        console.print(f"[red]trace train: {exc}[/]")
        raise typer.Exit(3)
    print_summary(result["summary"])
    console.print("\n[bold]Where to look[/]")
    console.print(f"  policy checkpoint: {result['policy_dir']}")
    for name, command in result["where"].items():
        console.print(f"  {name}: {command}")
    console.print(f"  (or with the duckdb CLI: duckdb -readonly {Path(wd) / 'trace.duckdb'}; it is "
                  "a snapshot, re-published as training writes, so re-open it to see new rows)")


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


@app.command("eval")
def evaluate(
    policy: str = typer.Argument(..., help="Policy directory (a checkpoint) to evaluate."),
    overrides: List[str] = typer.Argument(None, help="Config overrides as key=value (family=...)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file."),
    split: Optional[str] = typer.Option(None, help="Split or data file (default: eval_split)."),
    limit: int = typer.Option(64, help="Items to evaluate (0 = all)."),
    samples: int = typer.Option(4, help="Rollouts per item."),
    temperature: float = typer.Option(1.0, help="Sampling temperature (0 = greedy)."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
    data: Optional[Path] = typer.Option(None, "--data", help="Your own data file to evaluate on "
                                        "(instead of --split; formats in docs/families.md)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Per-item predictions (JSONL, read by "
                                       "trace score); default <workdir>/predictions/"
                                       "<family>-<split>.jsonl."),
) -> None:
    """Evaluate a policy (a checkpoint directory, or a named policy: smollm2): accuracy, the
    verifier's metrics, contrast metrics, and a JSONL of per-item predictions."""
    cfg = _load_config(config, _with_policy(overrides, policy))
    split = _eval_split(cfg, str(data) if data else split)
    with prefect_ready():
        from flows.evaluate import evaluate as evaluate_flow

    result = evaluate_flow(policy_dir=policy, config=cfg, split=split,
                           limit=limit or None, samples=samples, temperature=temperature,
                           workdir=_workdir(workdir), predictions=str(out) if out else None)
    console.print_json(json.dumps(result))


def _with_data(overrides: Optional[List[str]], data: Optional[Path], field: str) -> List[str]:
    """``--data FILE`` as the override ``field=FILE`` (the file must exist)."""
    if data is None:
        return list(overrides or [])
    if not data.is_file():
        console.print(f"trace: --data {data}: no such file", style="red", markup=False)
        raise typer.Exit(2)
    return [*(overrides or []), f"{field}={data.resolve()}"]


def _with_policy(overrides: Optional[List[str]], policy: str) -> List[str]:
    """The evaluated policy as the config's ``policy``, so it is checked like train's."""
    return [*(overrides or []), f"policy={policy}"]


def _eval_split(cfg, split: Optional[str]) -> str:
    """The split (or data file) ``trace eval`` reads, checked before anything slow starts: a
    split the family lacks or a bad file gives one line and exit status 2."""
    from trace_rl.config import check_split

    split = split or cfg.eval_split
    try:
        check_split(cfg, split, "--data" if Path(split).suffix else "eval split")
    except (ValueError, FileNotFoundError) as exc:  # DatasetError included: file and line
        console.print(f"trace: {exc}", style="red", markup=False)
        raise typer.Exit(2)
    return split


@app.command()
def bootstrap(
    family: Optional[str] = typer.Option(None, help="Synthetic family to warm-start on (default: the "
                               "train config's)."),
    difficulty: Optional[int] = typer.Option(None, help="Difficulty of the family (default: the train "
                                   "config's)."),
    seed: Optional[int] = typer.Option(None, help="Seed (default: the train config's)."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
) -> None:
    """Make (or reuse) the tiny CPU policy by SFT on synthetic expert traces."""
    with prefect_ready():
        from flows.bootstrap import bootstrap as bootstrap_flow

    chosen = {k: v for k, v in (("family", family), ("difficulty", difficulty), ("seed", seed))
              if v is not None}  # the rest: the flow's defaults, those of TrainConfig
    console.print(bootstrap_flow(workdir=_workdir(workdir), **chosen))


@app.command(context_settings={"allow_extra_args": True})
def warmstart(
    ctx: typer.Context,
    engine: str = typer.Option("auto", help="Engine of the success measurement: hf | vllm | auto."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
) -> None:
    """Warm-start a real model (default smollm2) for a real family by SFT on ReAct traces of its
    training data, measured on its held-out split; cached. Settings as key=value
    (trace_rl.policy.warmstart.WarmstartConfig), e.g. trace warmstart family=hotpotqa epochs=1."""
    from trace_rl.policy.warmstart import config_from_args

    try:
        cfg = config_from_args(list(ctx.args))
    except (ValueError, TypeError) as exc:
        console.print(f"trace: {exc}", style="red", markup=False)
        raise typer.Exit(2)
    with prefect_ready():
        from flows.warmstart import warmstart as warmstart_flow

    result = warmstart_flow(config=cfg.to_json(), workdir=_workdir(workdir), engine=engine)
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
    extra = json.dumps(dict(cfg.env_args), separators=(",", ":"))
    console.print(f"train it: trace train family={cfg.family} policy={result['policy_dir']} "
                  f"extra='{extra}'")


@app.command()
def sql(
    query: str = typer.Argument(..., help="SQL to run read-only on the work dir's DuckDB file."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
    fmt: str = typer.Option("table", "--format", "-f", help="table | csv | json"),
    max_rows: int = typer.Option(50, help="Rows shown in table format."),
) -> None:
    """Query the rollout trees with SQL: one SELECT, read-only, nothing outside the store.

    It reads the snapshot that training publishes after every write, so it works while a run
    trains and never delays it. Writes, COPY/EXPORT/ATTACH, file readers (read_csv, read_text),
    PRAGMA, SET and CHECKPOINT are refused."""
    from trace_rl.storage.store import TreeStore

    db = Path(_workdir(workdir)) / "trace.duckdb"
    if not db.exists():
        console.print(f"[red]no database at {db}[/]: run `trace train` first or pass --workdir")
        raise typer.Exit(2)
    try:
        result = TreeStore(db, create=False).query(query)
    except Exception as exc:  # show DuckDB's own message (syntax, read-only refusal) plainly
        console.print(f"[red]query failed:[/] {exc}")
        raise typer.Exit(1)
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


def _cell(v: object) -> str:
    s = str(v)
    return s if len(s) <= 60 else s[:57] + "..."


@app.command()
def view(
    run: Optional[str] = typer.Argument(None, help="Run id (default: the newest run)."),
    step: Optional[int] = typer.Option(None, "--step", help="Step (default: the newest with trees)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the page to this HTML file "
                                       "(self-contained, no server) instead of serving it."),
    port: int = typer.Option(8765, "--port", help="Port on 127.0.0.1 (0: any free port)."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
) -> None:
    """Look at the rollout trees: runs, steps, one step's trees and its allocation, read-only.

    Serves on 127.0.0.1 (reload for newer rows; works while a run trains), or with --out writes
    the same page as one HTML file that needs no server and no network."""
    from trace_rl.view.data import ViewError

    try:
        if out is not None:
            from trace_rl.view.page import write_page

            console.print(f"trace view: wrote {write_page(_workdir(workdir), out, run, step)}")
        else:
            from trace_rl.view.server import serve

            serve(_workdir(workdir), port, run, step, say=console.print)
    except ViewError as exc:
        console.print(f"trace view: {exc}", style="red", markup=False)
        raise typer.Exit(2)


@app.command()
def replay(
    run: str = typer.Argument(..., help="Run id whose stored trees to replay."),
    overrides: List[str] = typer.Argument(None, help="Config overrides as key=value (e.g. "
                                          "multiplier=2 exploration=0.05): budget and allocator knobs."),
    allocator: str = typer.Option("trace,grpo,prompt_only", "--allocator", "-a",
                                  help="Comma-separated allocators to compare."),
    replicates: int = typer.Option(100, help="Monte Carlo replicates per step."),
    seed: int = typer.Option(0, help="Seed of the replay's draws."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
) -> None:
    """Offline counterfactual allocation: the contrastive groups each allocator would have found
    on the run's stored trees, at the same budget (estimator and bias: docs/viewer.md)."""
    from trace_rl.storage.replay import ReplayError
    from trace_rl.view.data import ViewError, open_store

    try:
        store = open_store(_workdir(workdir))
        from trace_rl.storage.replay import stored_config

        base = stored_config(store, run)
        cfg = _load_config(None, overrides)  # validates the overrides' names and values
        given = {o.split("=", 1)[0].strip() for o in overrides or []}
        from trace_rl.config import config_from_mapping

        merged = {k: v for k, v in base.items() if k in cfg.to_dict()}
        merged.update({k: getattr(cfg, k) for k in given})
        names = [a.strip() for a in allocator.split(",") if a.strip()]
        from tasks.runtime import allocator_for
        from trace_rl.storage.replay import replay_stored

        allocs = [allocator_for(config_from_mapping({**merged, "allocator": a}, "--allocator"))
                  for a in names]
        budget = config_from_mapping(merged, "the run's config + overrides").budget
        steps, env, replays = replay_stored(store, run, allocs, budget, replicates, seed)
    except (ViewError, ReplayError, ValueError) as exc:
        console.print(f"trace replay: {exc}", style="red", markup=False)
        raise typer.Exit(2)
    print_replay(run, budget, steps, env, replays)


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


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def score(ctx: typer.Context) -> None:
    """Grade a JSONL of predictions with the training verifiers:
    trace score --task FAMILY --data FILE --predictions FILE."""
    from trace_rl.score import main as score_main

    raise typer.Exit(score_main(list(ctx.args)))


@app.command()
def export(
    run_id: str = typer.Argument(..., help="Run to export."),
    out: Path = typer.Option(Path("export"), help="Output folder for the Parquet files."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
) -> None:
    """Export a run's tables (runs, steps, nodes, allocations, ledger, evals) to Parquet."""
    from trace_rl.storage.store import TreeStore

    written = TreeStore(Path(_workdir(workdir)) / "trace.duckdb", create=False).export_parquet(run_id, out)
    for name, path in written.items():
        console.print(f"{name}: {path}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
