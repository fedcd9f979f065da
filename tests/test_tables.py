"""``python -m bench.tables``: the tables of docs/results.md are the benchmarks' reports over the
records in results/, and the page holds them as they are now."""

from __future__ import annotations

import json
import shutil

import pytest

from bench import RECORDS
from bench.tables import BLOCK, PAGE, TABLES, main, regenerate


def test_the_page_holds_every_generated_table_as_the_records_give_it(capsys):
    page = PAGE.read_text(encoding="utf-8")
    assert {m.group(2) for m in BLOCK.finditer(page)} == set(TABLES)
    assert main(["--check"]) == 0, capsys.readouterr().err


def test_a_changed_record_changes_its_table_and_check_says_so(tmp_path, capsys):
    for sub in ("learning_sim/paper-tokens", "learning_sim/default-tokens", "learning_lm",
                "learning_synth_chain", "peers", "peers_bfcl"):
        shutil.copytree(RECORDS / sub, tmp_path / sub)
    record = tmp_path / "learning_sim/paper-tokens/chain/grpo/seed0.json"
    body = json.loads(record.read_text())
    body["accuracy"] = [a + 0.05 for a in body["accuracy"]]  # GRPO's seed 0 5 points better
    record.write_text(json.dumps(body))
    page = PAGE.read_text(encoding="utf-8")
    assert regenerate(page, RECORDS) == page
    changed = regenerate(page, tmp_path)
    old, new = (next(m.group(3) for m in BLOCK.finditer(p) if m.group(2) == "learning_sim")
                for p in (page, changed))
    assert old != new and "| grpo (tokens matched) | 4.23 | 0.41 | 10.3 | 18972 / 18972 | 40.5 |" in new
    stale = tmp_path / "results.md"
    stale.write_text(changed, encoding="utf-8")
    assert main(["--check", "--page", str(stale)]) == 1
    assert "tables differ from the records: ['learning_sim']" in capsys.readouterr().err


def test_a_block_without_a_generator_is_an_error():
    with pytest.raises(KeyError, match="no generator for block 'nope'"):
        regenerate("<!-- bench.tables nope -->\n<!-- /bench.tables -->\n")
