"""The README's main command as a new user meets it, timed: ``python -m bench.first_run``.

Each repetition makes new, empty folders for ``PREFECT_HOME`` (Prefect never ran), the TRACE cache
(nothing bootstrapped) and the work dir, then runs ``bash scripts/setup.sh && .venv/bin/trace
train`` exactly as README.md writes it (with ``--steps`` overrides appended when asked), while
``--burners`` busy-looping processes compete for the CPU. Then, with the cache now warm, a second
work dir with another new ``PREFECT_HOME``: what a user's second project costs. Per run it prints
the exit code, the wall time and the longest silence between two output lines (the README promises
a line at least every 30 s), and saves every run's output under ``--out``.

    python -m bench.first_run --repeat 5 --burners 1 --out bench_runs/first_run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_main_command(home: Path, cache: Path, workdir: Path, overrides: list[str],
                     log: Path) -> dict[str, float | int]:
    """One README main command; returns exit code, wall seconds and the longest output gap."""
    env = dict(os.environ, PREFECT_HOME=str(home), TRACE_CACHE_DIR=str(cache),
               TRACE_WORKDIR=str(workdir))
    for key in ("PREFECT_API_URL", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"):
        env.pop(key, None)  # nothing of ours may mask what the CLI does by itself
    command = "bash scripts/setup.sh && .venv/bin/trace train " + " ".join(overrides)
    t0 = time.monotonic()
    last, longest = t0, 0.0
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:  # a bar redrawn with \r counts as one line per redraw
            now = time.monotonic()
            longest = max(longest, now - last)
            last = now
            out.write(f"{now - t0:8.1f} {line}")
            out.flush()  # readable while it runs
        rc = proc.wait()
    end = time.monotonic()
    return {"rc": rc, "seconds": end - t0, "longest_silence_s": max(longest, end - last)}


def burn(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on a core each, until the caller kills them."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=1, help="fresh-machine runs")
    p.add_argument("--burners", type=int, default=1, help="CPU-bound processes beside each run")
    p.add_argument("--second", type=int, default=1,
                   help="repetitions (the first ones) that also time a second work dir")
    p.add_argument("--out", type=Path, default=Path("bench_runs/first_run"))
    p.add_argument("overrides", nargs="*", help="config overrides appended to `trace train`")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.burners < 0:
        p.error("--repeat must be >= 1 and --burners >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="trace-first-run-") as tmp:
            base = Path(tmp)
            burners = burn(args.burners)
            try:
                first = run_main_command(base / "prefect-a", base / "cache", base / "work-a",
                                         args.overrides, args.out / f"run{i}-first.log")
                second = (run_main_command(base / "prefect-b", base / "cache", base / "work-b",
                                           args.overrides, args.out / f"run{i}-second.log")
                          if i < args.second else None)
            finally:
                for b in burners:
                    b.kill()
                    b.wait()
        for kind, r in (("first", first), ("second work dir", second)):
            if r is None:
                continue
            rows.append({"run": i, "kind": kind, "burners": args.burners, **r})
            print(f"run {i} {kind:>15}: exit {r['rc']}, {r['seconds']:6.1f} s, longest silence "
                  f"{r['longest_silence_s']:5.1f} s", flush=True)
        (args.out / "first_run.json").write_text(json.dumps(rows, indent=1) + "\n")
    firsts = [r for r in rows if r["kind"] == "first"]
    ok = sum(r["rc"] == 0 for r in firsts)
    seconds = [r["seconds"] for r in rows if r["kind"] != "first"]
    print(f"first runs passed {ok}/{len(firsts)}; wall {min(r['seconds'] for r in firsts):.0f}-"
          f"{max(r['seconds'] for r in firsts):.0f} s; longest silence "
          f"{max(r['longest_silence_s'] for r in rows):.1f} s"
          + (f"; second work dir {min(seconds):.0f}-{max(seconds):.0f} s" if seconds else ""))


if __name__ == "__main__":
    main()
