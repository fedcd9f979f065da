"""Run a command; report its wall time and the peak of the summed resident memory of its process
tree (the command and every descendant: Ray's raylets and actors, vLLM's engine cores), sampled
every ``--every`` seconds. ``/usr/bin/time`` reports the largest single process instead, which
says little about a run spread over a dozen processes.

    python -m studies.peak_rss [--every 1] [--out FILE] -- COMMAND ...
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil


def tree_rss(root: psutil.Process) -> int:
    """Bytes resident in ``root`` and its descendants now (processes gone meanwhile skipped)."""
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--out", default="", help="also write the figures to this JSON file")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given (put it after --)")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, tree_rss(root))
        except psutil.NoSuchProcess:
            break
        time.sleep(args.every)
    figures = {"command": cmd, "returncode": proc.wait(), "wall_s": round(time.perf_counter() - t0, 1),
               "peak_tree_rss_gib": round(peak / 2**30, 2)}
    print(json.dumps(figures), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    return figures["returncode"]


if __name__ == "__main__":
    sys.exit(main())
