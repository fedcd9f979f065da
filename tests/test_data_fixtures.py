"""The real families' data on any clone: the fixtures of tests/data/families are a whole
data directory cut from the full data; ``trace data check`` names each missing file and the family
that needs it; the ``full_data`` marker skips without the full data, and with
``TRACE_REQUIRE_FULL_DATA=1`` such a skip fails the session."""

from __future__ import annotations

import importlib.util
import shutil
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from data_dirs import FIXTURES, FULL_DATA
from trace_rl.envs.datadir import check_data_dir, data_families, expected_files
from trace_rl.envs.registry import make_env

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def test_the_fixtures_are_a_whole_data_dir_whose_every_split_loads():
    assert all(not missing for _, missing in check_data_dir(FIXTURES).values())
    for family in data_families():
        env = make_env(family, data_dir=FIXTURES)
        splits = {s for f in expected_files(family) for s in f.splits}
        for split in sorted(splits):
            items = env.load(split)
            assert items and len({it.id for it in items}) == len(items), (family, split)
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert total < 600_000, f"the fixtures grew to {total:,} bytes"


@pytest.mark.full_data
def test_the_fixtures_are_cut_from_the_full_data(tmp_path):
    """scripts/make_test_fixtures.py on the full data writes exactly the committed fixtures."""
    spec = importlib.util.spec_from_file_location("make_test_fixtures",
                                                  REPO / "scripts" / "make_test_fixtures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    written = script.cut(FULL_DATA, tmp_path / "cut")
    fresh = {p.relative_to(tmp_path / "cut"): p.read_bytes() for p in written}
    committed = {p.relative_to(FIXTURES): p.read_bytes() for p in FIXTURES.rglob("*") if p.is_file()}
    assert sorted(fresh) == sorted(committed)
    assert [p for p in fresh if fresh[p] != committed[p]] == []


# ---- trace data check ----

def check(*args: str, **env: str):
    from cli.app import app

    return CliRunner().invoke(app, ["data", "check", *args], env=env)


def test_data_check_passes_on_the_fixtures():
    res = check("--data-dir", str(FIXTURES))
    assert res.exit_code == 0, res.output
    assert [ln.split(":")[0] for ln in res.output.splitlines()[1:]] == data_families()
    assert all(": ok, all " in ln for ln in res.output.splitlines()[1:])
    res = check("math", TRACE_DATA_DIR=str(FIXTURES))  # $TRACE_DATA_DIR when no --data-dir
    assert res.exit_code == 0 and f"{FIXTURES} ($TRACE_DATA_DIR)" in res.output, res.output


def test_data_check_names_each_missing_file_and_its_family(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    res = check("--data-dir", str(empty))
    assert res.exit_code == 1
    for family in data_families():
        for f in expected_files(family):
            assert f"missing {f.path} (family {family}, split" in res.output, (f.path, res.output)
    assert "math/gsm8k_test.jsonl (family math, splits test, gsm8k_test)" in res.output
    assert "docs/families.md" in res.output
    res = check("math", "--data-dir", str(empty))  # only the family asked for
    assert res.exit_code == 1 and "hotpotqa" not in res.output and "bfcl" not in res.output
    # one file gone from a whole directory: that file, its family; the others are ok
    partial = tmp_path / "partial"
    shutil.copytree(FIXTURES, partial)
    (partial / "multihop_qa" / "hotpotqa_train_100_corpus.jsonl").unlink()
    res = check("--data-dir", str(partial))
    assert res.exit_code == 1
    assert "hotpotqa: 1 of 8 files missing" in res.output
    assert "missing multihop_qa/hotpotqa_train_100_corpus.jsonl (family hotpotqa, split train)" \
        in res.output
    assert "math: ok" in res.output and "bfcl: ok" in res.output
    assert check("math", "--data-dir", str(partial)).exit_code == 0


@pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None,
                    reason="bfcl-eval not installed: pip install --no-deps bfcl-eval==2026.3.23")
def test_data_check_names_the_multi_turn_docs_the_rows_need(tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(FIXTURES, partial)
    (partial / "function_calling" / "bfcl" / "multi_turn_func_doc" / "ticket_api.json").unlink()
    res = check("bfcl", "--data-dir", str(partial))
    assert res.exit_code == 1
    assert "missing function_calling/bfcl/multi_turn_func_doc/ticket_api.json (family bfcl, " \
           "split multi_turn_base)" in res.output, res.output


def test_data_check_refuses_a_family_without_data():
    res = check("synth_arith", "chess")
    assert res.exit_code == 2
    assert "no data directory is read by synth_arith, chess" in res.output


# ---- the full_data marker and TRACE_REQUIRE_FULL_DATA ----

INNER_TESTS = """
import pytest

@pytest.mark.full_data("math")
def test_needs_math():
    pass

@pytest.mark.full_data
def test_needs_everything():
    pass

def test_plain():
    pass
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch):
    """A pytest session of its own, with the project's full_data plugin over ``<its dir>/full``."""
    pytester.makeconftest(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(TESTS)!r})
        from data_dirs import FullDataPlugin

        def pytest_configure(config):
            config.addinivalue_line("markers", "full_data: needs the full data")
            config.pluginmanager.register(FullDataPlugin(Path(__file__).parent / "full"))
        """))
    pytester.makepyfile(test_inner=INNER_TESTS)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # it needs no other plugin
    return pytester


def test_full_data_skips_name_the_missing_file_and_fail_only_when_required(inner, monkeypatch):
    monkeypatch.delenv("TRACE_REQUIRE_FULL_DATA", raising=False)
    res = inner.runpytest("-rs")
    res.assert_outcomes(passed=1, skipped=2)  # no full data directory: skips are allowed
    res.stdout.fnmatch_lines(["*full data: no */full/math/gsm8k_train.jsonl (and 3 more)*"])
    monkeypatch.setenv("TRACE_REQUIRE_FULL_DATA", "1")
    assert inner.runpytest().ret == 0  # required, but there is no directory at all
    (inner.path / "full").mkdir()
    res = inner.runpytest()
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["*TRACE_REQUIRE_FULL_DATA=1: full_data tests skipped*",
                              "*full exists, but these tests that need the full data skipped*",
                              "  test_inner.py::test_needs_math",
                              "  test_inner.py::test_needs_everything"])
    monkeypatch.setenv("TRACE_REQUIRE_FULL_DATA", "0")
    assert inner.runpytest().ret == 0
    # the math files present: that test runs; the session fails for the other one alone
    monkeypatch.setenv("TRACE_REQUIRE_FULL_DATA", "1")
    shutil.copytree(FIXTURES / "math", inner.path / "full" / "math")
    res = inner.runpytest()
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.assert_outcomes(passed=2, skipped=1)
    assert "test_inner.py::test_needs_math" not in res.stdout.str()
    res.stdout.fnmatch_lines(["  test_inner.py::test_needs_everything"])
