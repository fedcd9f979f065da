"""``trace config``: the config a train run would use, as YAML that ``trace train --config`` reads
back unchanged, checked as ``trace train`` checks it, without loading torch or Prefect; and
``--fields``, every field with its default, what it may be and what it does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from cli.app import app
from trace_rl.config import FIELDS, family_fields, load_config

REPO = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "240", "NO_COLOR": "1"}


def trace(*args: str):
    return CliRunner().invoke(app, list(args), env=WIDE)


def test_the_printed_config_is_a_file_train_reads_back_unchanged(tmp_path):
    for overrides in (["steps=5", "allocator=grpo", "learning_rate=3e-5"],
                      ["family=synth_chain", "max_turns=8", "chain_hops=2:0.5,3:0.5"]):
        out = trace("config", *overrides)
        assert out.exit_code == 0, out.output
        path = tmp_path / "run.yaml"
        path.write_text(out.output)
        want = load_config(None, overrides)
        got = load_config(path)
        assert got == want and got.config_hash == want.config_hash
        assert set(yaml.safe_load(out.output)) >= set(FIELDS)  # every field, by its flat name
        again = trace("config", "--config", str(path))  # a file in, the same file out
        assert again.exit_code == 0 and again.output == out.output
    assert "# the options of family synth_chain" in out.output and "chain_hops: 2:0.5,3:0.5" in out.output


def test_a_bad_value_exits_2_naming_it_as_train_does():
    out = trace("config", "allocator=trace2", "steps=0")
    assert out.exit_code == 2
    assert "allocator='trace2'" in out.output and "trace_cover" in out.output and "steps" in out.output


def test_fields_lists_every_field_with_its_default_and_choices():
    out = trace("config", "--fields")
    assert out.exit_code == 0, out.output
    for name in [*FIELDS, *family_fields()]:
        assert f" {name} " in out.output, name
    allocator = next(line for line in out.output.splitlines() if " allocator " in line)
    assert "'trace'" in allocator and "trace_cover" in allocator and "grpo" in allocator
    only = trace("config", "--fields", "--match", "clip")
    assert " clip_low " in only.output and " steps " not in only.output
    assert trace("config", "--fields", "steps=3").exit_code == 2  # nothing to resolve with --fields


def test_config_loads_neither_torch_nor_prefect():
    code = ("import sys; from typer.testing import CliRunner; from cli.app import app; "
            "r = CliRunner().invoke(app, ['config', 'steps=3']); assert r.exit_code == 0, r.output; "
            "print('torch' in sys.modules, 'prefect' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]
