"""The ``trace`` command: train, evaluate, bootstrap, query, grade and show the config.

Every command but ``score``, ``config`` and ``data check`` takes ``--workdir DIR`` (default
``./trace_runs``, or $TRACE_WORKDIR): the DuckDB file, the MLflow store, checkpoints and cached task
results live there. Flows run in-process on Prefect's temporary server, which ``trace`` starts
itself (no server to set up); set PREFECT_API_URL to use a server instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from trace_rl import environ

environ.apply()  # Prefect's start-up limit and quiet defaults, before any flow imports prefect

from cli.data import data_app  # noqa: E402
from cli.output import (console, print_fields, print_query, print_replay, print_runs,  # noqa: E402
                        print_summary, print_warmstart)
from cli.prepare import (WORKDIR_HELP, checked_eval_split, load_config_or_exit,  # noqa: E402
                         prefect_ready, resolve_workdir, with_data, with_policy)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="TRACE: tree rollout allocation for sample-efficient agentic RL.")
app.add_typer(data_app, name="data")


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
    cfg = load_config_or_exit(config, with_data(overrides, data, "train_split"))  # before Prefect, the flow or the bootstrap start
    wd = resolve_workdir(workdir)
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


@app.command("eval")
def evaluate(
    policy: str = typer.Argument(..., help="Policy to evaluate: a directory (a checkpoint) or a named policy (smollm2)."),
    overrides: List[str] = typer.Argument(None, help="Config overrides as key=value (family=...)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file."),
    split: Optional[str] = typer.Option(None, help="Split or data file (default: eval_split)."),
    limit: Optional[int] = typer.Option(None, help="Items to evaluate (0 = all; default: the "
                                        "evaluate flow's limit)."),
    samples: Optional[int] = typer.Option(None, help="Rollouts per item (default: eval_samples)."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature, 0 = greedy "
                                                "(default: the config's temperature)."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
    data: Optional[Path] = typer.Option(None, "--data", help="Your own data file to evaluate on "
                                        "(instead of --split; formats in docs/families.md)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Per-item predictions (JSONL, read by "
                                       "trace score); default <workdir>/predictions/"
                                       "<family>-<split>.jsonl."),
) -> None:
    """Evaluate a policy (a checkpoint directory, or a named policy: smollm2).

    Prints accuracy, the verifier's metrics and contrast metrics, and writes a JSONL of per-item
    predictions."""
    # The training split is not read here: a user with only their own --data file needs none.
    cfg = load_config_or_exit(config, with_policy(overrides, policy), train_split=False)
    split = checked_eval_split(cfg, str(data) if data else split)
    with prefect_ready():
        from flows.evaluate import evaluate as evaluate_flow

    given = {k: v for k, v in (("samples", samples), ("temperature", temperature)) if v is not None}
    if limit is not None:
        given["limit"] = limit or None  # 0: every item
    result = evaluate_flow(policy_dir=policy, config=cfg, split=split, **given,
                           workdir=resolve_workdir(workdir), predictions=str(out) if out else None)
    console.print_json(json.dumps(result))


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
    console.print(bootstrap_flow(workdir=resolve_workdir(workdir), **chosen))


@app.command(context_settings={"allow_extra_args": True})
def warmstart(
    ctx: typer.Context,
    engine: Optional[str] = typer.Option(None, help="Engine of the success measurement: hf | "
                                         "vllm | auto (default: the config's engine)."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
) -> None:
    """Warm-start a real model (default smollm2) for a real family by SFT on ReAct traces.

    The traces come from the family's training data; the result is measured on its held-out split
    and cached. Settings as key=value (trace_rl.policy.warmstart.WarmstartConfig), e.g.
    trace warmstart family=hotpotqa epochs=1."""
    from trace_rl.config import warmstart_config

    try:
        cfg = warmstart_config(list(ctx.args))
    except (ValueError, TypeError) as exc:
        console.print(f"trace: {exc}", style="red", markup=False)
        raise typer.Exit(2)
    with prefect_ready():
        from flows.warmstart import warmstart as warmstart_flow

    result = warmstart_flow(config=cfg.to_json(), workdir=resolve_workdir(workdir),
                            **({"engine": engine} if engine is not None else {}))
    print_warmstart(result, cfg)


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

    db = Path(resolve_workdir(workdir)) / "trace.duckdb"
    if not db.exists():
        console.print(f"[red]no database at {db}[/]: run `trace train` first or pass --workdir")
        raise typer.Exit(2)
    try:
        result = TreeStore(db, create=False).query(query)
    except Exception as exc:  # show DuckDB's own message (syntax, read-only refusal) plainly
        console.print(f"[red]query failed:[/] {exc}")
        raise typer.Exit(1)
    print_query(result, fmt, max_rows)


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

            console.print(f"trace view: wrote {write_page(resolve_workdir(workdir), out, run, step)}")
        else:
            from trace_rl.view.server import serve

            serve(resolve_workdir(workdir), port, run, step, say=console.print)
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
    """Offline counterfactual allocation on a run's stored trees, at the same budget.

    Reports the contrastive groups each allocator would have found (estimator and bias:
    docs/viewer.md)."""
    from trace_rl.storage.replay import ReplayError
    from trace_rl.view.data import ViewError, open_store

    try:
        store = open_store(resolve_workdir(workdir))
        from trace_rl.storage.replay import stored_config

        base = stored_config(store, run)
        cfg = load_config_or_exit(None, overrides)  # validates the overrides' names and values
        given = {o.split("=", 1)[0].strip() for o in overrides or []}
        from trace_rl.config import config_from_mapping

        merged = {k: v for k, v in base.items() if k in cfg.to_dict()}
        merged.update({k: getattr(cfg, k) for k in given})
        names = [a.strip() for a in allocator.split(",") if a.strip()]
        from tasks.runtime import allocator_for
        from trace_rl.storage.replay import replay_stored

        allocs = [allocator_for(config_from_mapping({**merged, "allocator": a},
                                                    "--allocator").allocation) for a in names]
        budget = config_from_mapping(merged, "the run's config + overrides").budget
        steps, env, replays = replay_stored(store, run, allocs, budget, replicates, seed)
    except (ViewError, ReplayError, ValueError) as exc:
        console.print(f"trace replay: {exc}", style="red", markup=False)
        raise typer.Exit(2)
    print_replay(run, budget, steps, env, replays)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def score(ctx: typer.Context) -> None:
    """Grade a JSONL of predictions with the training verifiers.

    trace score --task FAMILY --data FILE --predictions FILE."""
    from trace_rl.score import main as score_main

    raise typer.Exit(score_main(list(ctx.args)))


@app.command()
def runs(
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
    fmt: str = typer.Option("table", "--format", "-f", help="table | json (one object per run)"),
) -> None:
    """List the work dir's runs: status, steps done, reward, tokens, held-out accuracy.

    Read from the published DuckDB file, so it works while a run trains; the trees themselves:
    trace view, or trace sql."""
    from trace_rl.view.data import ViewError, open_store, run_table

    if fmt not in ("table", "json"):
        raise typer.BadParameter(f"--format {fmt!r}: choose table or json")
    try:
        rows = run_table(open_store(resolve_workdir(workdir)))
    except ViewError as exc:
        console.print(f"trace runs: {exc}", style="red", markup=False)
        raise typer.Exit(2)
    if fmt == "json":
        print(json.dumps(rows))
    else:
        print_runs(rows)


@app.command("config")
def show_config(
    overrides: List[str] = typer.Argument(None, help="Config overrides as key=value (e.g. steps=5)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file."),
    list_fields: bool = typer.Option(False, "--fields", help="List every field instead: its "
                                     "default, what it may be and what it does."),
    match: str = typer.Option("", "--match", help="With --fields: only names containing this."),
) -> None:
    """Print the config a train run would use, as YAML, checked as trace train checks it.

    Defaults, then --config, then the overrides; a bad value exits 2 naming it. The output is a
    config file: trace config steps=50 > run.yaml, edit it, trace train -c run.yaml. With
    --fields, list every field (and every family's options) with its default, what it may be and
    the first sentence of its documentation."""
    from trace_rl.config.describe import as_yaml, field_rows

    if list_fields:
        if overrides or config:
            console.print("trace config: --fields lists the fields; it takes no config or "
                          "overrides", style="red", markup=False)
            raise typer.Exit(2)
        print_fields(field_rows(match))
        return
    print(as_yaml(load_config_or_exit(config, overrides)), end="")


@app.command()
def export(
    run_id: str = typer.Argument(..., help="Run to export."),
    out: Path = typer.Option(Path("export"), help="Output folder for the Parquet files."),
    workdir: Optional[str] = typer.Option(None, "--workdir", "-w", help=WORKDIR_HELP),
) -> None:
    """Export a run's tables (runs, steps, nodes, allocations, ledger, evals) to Parquet."""
    from trace_rl.storage.store import TreeStore

    written = TreeStore(Path(resolve_workdir(workdir)) / "trace.duckdb", create=False).export_parquet(run_id, out)
    for name, path in written.items():
        console.print(f"{name}: {path}")


def main() -> None:
    """The ``trace`` command: its rollout engines stop when it does, on success, on an error and
    on SIGTERM/SIGINT (``trace_rl.engines.lifecycle``)."""
    from trace_rl.engines.lifecycle import entry_point

    entry_point(app)


if __name__ == "__main__":
    main()
