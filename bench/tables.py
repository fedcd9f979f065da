"""The tables of docs/results.md, regenerated from the records in results/ (results/README.md),
each between ``<!-- bench.tables NAME -->`` and ``<!-- /bench.tables -->``; nothing is run.

    python -m bench.tables            # print every generated table
    python -m bench.tables --write    # rewrite them in docs/results.md
    python -m bench.tables --check    # exit 1 where the page differs from the records
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from pathlib import Path
from typing import Callable, Sequence

from bench import RECORDS, markdown
from bench.learning_sim import DEFAULT_ROWS, report as sim_report
from bench.learning_report import ci_text as _ci, reach_text
from trace_rl.sim.run import REFERENCE

PAGE = RECORDS.parent / "docs" / "results.md"
BLOCK = re.compile(r"(<!-- bench\.tables (\w+) -->\n)(.*?)(<!-- /bench\.tables -->)", re.S)
LABELS = {REFERENCE: f"**{REFERENCE}** (reference)", "grpo": "grpo (tokens matched)",
          "dapo": "dapo (tokens matched; stops early)", "prompt_only": "prompt_only (tokens matched)",
          "trace": "trace (the paper's Stage 1; equal leaves)", "oracle_pred": "trace, true V, no exploration",
          "cover_oracle": "trace_cover, true V, no exploration"}


def _sim_regime(regime: str, root: Path) -> tuple[dict, str, int]:
    """One regime's chain rows by method, its closing line and seed count (``learning_sim.report``)."""
    with contextlib.redirect_stdout(io.StringIO()):
        out = sim_report(root / "learning_sim" / f"{regime}-tokens", DEFAULT_ROWS)
    return {r["method"]: r for r in out["tables"]["chain"]}, out["line"], out["gain"].n


def learning_sim(root: Path = RECORDS) -> str:
    """The simulator's table, both regimes, and their closing lines."""
    paper, paper_line, n = _sim_regime("paper", root)
    default, default_line, n_default = _sim_regime("default", root)
    head = [f"method ({n} seeds; default {n_default})", "paper: mixed prompts/step", "eff. ratio",
            "prompts/step", "gen / train tok per step", "acc", "vs GRPO (95% CI)",
            "tokens to GRPO's final (median ratio, 95% CI)", "default: mixed/step", "eff. ratio", "acc",
            "vs GRPO (95% CI)"]
    rows = [[LABELS.get(m, m), *_cells(paper[m], "active", "tokens"),
             reach_text(paper[m].get("reach"), f" of {n}"), *_cells(default[m])] for m in DEFAULT_ROWS]
    return "\n".join([markdown(head, rows), "", f"    paper:   {paper_line}",
                      f"    default: {default_line}"])


def _cells(r: dict, *columns: str) -> list[str]:
    """A protocol row's cells: mixed prompts, effective ratio, ``columns``, accuracy, vs GRPO."""
    oracle = f" (+ {r['oracle_tokens']:.0f} oracle)" if "oracle_tokens" in r else ""
    shown = {"active": f"{r['active']:.1f}", "leaves": f"{r['leaves']:.1f}",
             "tokens": f"{r['tokens']:.0f} / {r['train_tokens']:.0f}{oracle}"}
    return [f"{r['mixed']:.2f}", f"{r['ratio']:.2f}", *(shown[c] for c in columns), f"{r['acc']:.1f}",
            _ci(r.get("vs_grpo")) if r["method"] != "grpo" else ""]


def learning_lm(root: Path = RECORDS) -> str:
    """The tiny LM under the learning protocol's paper regime: per structure, the seeds' means."""
    from bench.learning import REGIMES, protocol_report as report

    with contextlib.redirect_stdout(io.StringIO()):
        out = report(root / "learning_lm" / "paper", REGIMES["paper"]["final_of"],
                     {**REGIMES["paper"], "root_budget": 16, "multiplier": 2})
    head = ["structure", "method", "seeds", "mixed prompts/step", "eff. ratio", "prompts/step",
            "gen / train tok per step", "leaves/step", "final acc", "vs GRPO (95% CI)"]
    # an optional row (a Monte-Carlo oracle) has its own seeds and cost
    return markdown(head, [[name, r["method"], str(r.get("seeds", len(out["finals"][name][REFERENCE]))),
                            *_cells(r, "active", "tokens", "leaves")]
                           for name, table in out["tables"].items() for r in table])


def peers(root: Path = RECORDS, folder: str = "peers") -> str:
    """This project against TRL's GRPOTrainer: ``bench.peers``' table and closing line, from the
    records in ``folder`` (``peers``: the tiny policy; ``peers_bfcl``: the BFCL warm start)."""
    from bench.learning_runs import read_records
    from bench.peers import METHODS, against_trl, closing, summary_table, summarise

    runs = sorted((r for _, r in read_records(root / folder) if r.method in METHODS),
                  key=lambda r: METHODS.index(r.method))
    s = summarise(runs, len(runs[0].leaves))
    lines = "".join(f"- {line}\n" for line in against_trl(runs, s["methods"])[0])
    return f"{summary_table(s)}\n\n{lines}\n`{closing(runs, s['methods'])[0]}`"


TABLES: dict[str, Callable[[Path], str]] = {"learning_sim": learning_sim, "learning_lm": learning_lm,
                                           "peers": peers,
                                           "peers_bfcl": lambda root: peers(root, "peers_bfcl")}
"""Every generated table, by the name its block carries in the page."""


def regenerate(page: str, root: Path = RECORDS) -> str:
    """``page`` with every generated block rewritten from the records under ``root``."""
    def block(m: re.Match) -> str:
        if m.group(2) not in TABLES:
            raise KeyError(f"docs/results.md: no generator for block {m.group(2)!r}; "
                           f"known: {sorted(TABLES)}")
        return m.group(1) + TABLES[m.group(2)](root) + "\n" + m.group(4)
    return BLOCK.sub(block, page)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the tables in docs/results.md")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 where docs/results.md differs from the records")
    ap.add_argument("--page", default=str(PAGE))
    args = ap.parse_args(argv)
    page = Path(args.page)
    text = page.read_text(encoding="utf-8")
    if not args.write and not args.check:
        for name, make in TABLES.items():
            print(f"<!-- bench.tables {name} -->\n{make(RECORDS)}\n")
        return 0
    new = regenerate(text, RECORDS)
    if args.write:
        page.write_text(new, encoding="utf-8")
        return 0
    stale = [m.group(2) for m, n in zip(BLOCK.finditer(text), BLOCK.finditer(new))
             if m.group(3) != n.group(3)]
    if stale:
        print(f"{page}: tables differ from the records: {stale} (python -m bench.tables --write)",
              file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
