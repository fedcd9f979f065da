"""Cut the test fixtures (``tests/data/families``) from the full benchmark data.

    .venv/bin/python scripts/make_test_fixtures.py [--source DIR] [--out DIR]

``--source`` is a full data directory (default: ``$TRACE_DATA_DIR``, else the project's
``../shared/data``); ``--out`` defaults to ``tests/data/families``. The output has the layout the
loaders read under ``TRACE_DATA_DIR`` (docs/families.md, "Data"), the same file names, and
holds a handful of rows of each file, copied byte for byte (whole lines, in source order):

* every question/answer file: its first rows (``FIRST``), plus the rows the tests name by id
  (``EXTRA_IDS``: BFCL's three self-contradictory ``live_multiple`` rows, and a ``multiple``
  row that asks a kept ``simple_python`` question, as 100 of the full file's rows do);
* the HotpotQA pooled corpora: the rows whose titles are among the kept questions' paragraphs,
  so pooled search finds every paragraph the kept questions bring;
* BFCL ``possible_answer/``: the rows of the kept ids; ``multi_turn_func_doc/``: whole files.

Running it again on the same source writes the same bytes (``tests/test_data_fixtures.py``
checks the committed fixtures against a fresh cut when the full data is present). Sources and
licences: tests/data/README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "data" / "families"

BFCL = "function_calling/bfcl"
FIRST: dict[str, int] = {
    "math/gsm8k_test.jsonl": 8,
    "math/gsm8k_train.jsonl": 8,
    "math/math500_test.jsonl": 8,
    "math/aime2024.jsonl": 8,
    "multihop_qa/hotpotqa_dev_distractor_first500.jsonl": 8,
    "multihop_qa/hotpotqa_train_distractor_100.jsonl": 8,
    "multihop_qa/hotpotqa_dev_qa.jsonl": 10,
    "multihop_qa/musique_dev_500_qa.jsonl": 10,
    "multihop_qa/2wiki_dev_500_qa.jsonl": 10,
    "multihop_qa/bamboogle_125.jsonl": 10,
    **{f"{BFCL}/BFCL_v4_{c}.json": 5 for c in (
        "simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
        "live_multiple", "live_parallel", "live_parallel_multiple", "live_relevance")},
    f"{BFCL}/BFCL_v4_irrelevance.json": 10,
    f"{BFCL}/BFCL_v4_live_irrelevance.json": 6,
    f"{BFCL}/BFCL_v4_multi_turn_base.json": 6,
}
"""File (relative to the data directory) -> rows kept from its start."""
EXTRA_IDS: dict[str, tuple[str, ...]] = {
    f"{BFCL}/BFCL_v4_live_multiple.json": ("live_multiple_507-149-4", "live_multiple_862-181-3",
                                           "live_multiple_964-207-0"),
    f"{BFCL}/BFCL_v4_multiple.json": ("multiple_96",),  # simple_python_4's question, reused
}
"""Rows kept wherever they are in the file (by ``id``), because a test names them."""
CORPORA: dict[str, str] = {
    "multihop_qa/hotpotqa_dev_distractor_first500.jsonl": "multihop_qa/hotpotqa_dev_first500_corpus.jsonl",
    "multihop_qa/hotpotqa_train_distractor_100.jsonl": "multihop_qa/hotpotqa_train_100_corpus.jsonl",
}
"""Question file -> its pooled corpus (rows kept: the titles of the kept questions' paragraphs)."""
WHOLE_DIRS = (f"{BFCL}/multi_turn_func_doc",)
"""Folders copied whole."""


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


def _titles(row: dict) -> set[str]:
    """The paragraph titles of a HotpotQA row (``{title, text}`` or ``[title, sentences]``)."""
    return {p["title"] if isinstance(p, dict) else p[0] for p in row.get("context", [])}


def cut(source: Path, out: Path) -> list[Path]:
    """Write the fixtures cut from ``source`` into ``out`` (emptied first); the files written."""
    missing = [p for p in [*FIRST, *CORPORA.values(), *WHOLE_DIRS] if not (source / p).exists()]
    if missing:
        raise FileNotFoundError(f"{source} is not a full data directory: no {', '.join(missing)}")
    if out.exists():
        shutil.rmtree(out)
    written: list[Path] = []

    def write(rel: str, lines: list[str]) -> None:
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(lines), encoding="utf-8")
        written.append(path)

    for rel, n in FIRST.items():
        lines = _lines(source / rel)
        extra = set(EXTRA_IDS.get(rel, ()))
        kept = [ln for k, ln in enumerate(lines) if k < n or json.loads(ln).get("id") in extra]
        write(rel, kept)
        if rel in CORPORA:
            titles = set().union(*(_titles(json.loads(ln)) for ln in kept))
            corpus = CORPORA[rel]
            write(corpus, [ln for ln in _lines(source / corpus) if json.loads(ln)["title"] in titles])
        answers = source / Path(rel).parent / "possible_answer" / Path(rel).name
        if rel.startswith(BFCL) and answers.is_file():
            ids = {json.loads(ln)["id"] for ln in kept}
            write(str(Path(rel).parent / "possible_answer" / Path(rel).name),
                  [ln for ln in _lines(answers) if json.loads(ln)["id"] in ids])
    for rel in WHOLE_DIRS:
        for path in sorted((source / rel).iterdir()):
            write(f"{rel}/{path.name}", _lines(path))
    return written


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO))
    from trace_rl.envs.datadir import default_data_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=None,
                        help="full data directory (default: $TRACE_DATA_DIR or ../shared/data)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default: {OUT})")
    args = parser.parse_args(argv)
    written = cut(args.source or default_data_dir(), args.out)
    total = sum(p.stat().st_size for p in written)
    print(f"wrote {len(written)} files, {total:,} bytes, under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
