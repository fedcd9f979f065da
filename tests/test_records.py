"""The records folder holds records and nothing else, and the code packages hold code: the layout
results/README.md documents is the layout git holds, and the benchmarks write there by default."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUT = [re.compile(p) for p in (
    r"learning_sim/(paper|default)-tokens/(chain|control)/\w+/seed\d+\.json",
    r"learning_sim/pilot/(paper|default)/(chain|control)/\w+/seed\d+\.json",
    r"learning_sim/diag/\w+/(chain|control)/\w+/seed\d+\.json",
    r"learning_lm/\w+/(main|control)/runs/\w+-s\d+\.json",
    r"learning_\w+/(runs/\w+-s\d+|start|hard_start)\.json",
    r"peers(_(bfcl|hotpotqa))?/runs/\w+-s\d+\.json",
    r"rl_(bfcl|hotpotqa)/runs/\w+-s\d+\.json",
    r"warmstart_hotpotqa/[\w-]+\.json",
)]
"""The folders of results/README.md's table, as patterns."""
CODE_PACKAGES = ("bench", "studies", "trace_core", "trace_rl", "tasks", "flows", "cli", "deployments")
CODE_FILES = (".py", ".sh", ".html")


def tracked(*paths: str) -> list[str]:
    return subprocess.run(["git", "ls-files", "--", *paths], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.split()


def test_the_records_folder_holds_only_records_in_the_documented_layout():
    files = [p.removeprefix("results/") for p in tracked("results")]
    assert "README.md" in files and len(files) > 100
    stray = [f for f in files if f != "README.md" and not any(p.fullmatch(f) for p in LAYOUT)]
    assert not stray, f"files in results/ outside its documented layout: {stray[:10]}"


def test_the_layout_patterns_are_not_vacuous():
    assert any(p.fullmatch("learning_lm/paper/main/runs/trace_cover-s0.json") for p in LAYOUT)
    assert any(p.fullmatch("peers_bfcl/runs/trl_grpo-s0.json") for p in LAYOUT)
    assert not any(p.fullmatch(f) for p in LAYOUT for f in (
        "learning_sim/paper-tokens.txt", "learning_sim/diag/diag.py", "peers/summary-ab12.json",
        "rl_bfcl/learning.png", "peers_bfcl/runs/trl_grpo-s0.log", "peers_x/runs/grpo-s0.json", "learning_lm/paper/main/runs/trace-s0.log"))


def test_the_code_packages_hold_no_run_output():
    data = [p for p in tracked(*CODE_PACKAGES) if not p.endswith(CODE_FILES)]
    assert not data, f"non-code files inside code packages: {data[:10]}"


def test_benchmarks_write_their_records_to_the_records_folder_by_default():
    from bench import RECORDS
    from bench.learning import LM_RESULTS as LM
    from bench.learning_sim import RESULTS as SIM

    assert RECORDS == REPO / "results"
    assert LM.parent == SIM.parent == RECORDS
    assert (RECORDS / "learning_lm" / "paper" / "main" / "runs").is_dir()


def test_the_records_folder_is_not_a_package_and_not_shipped():
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[([^\]]*)\]", pyproject)
    assert include, "pyproject.toml names the packages it ships"
    shipped = re.findall(r'"([^"*]+)\*?"', include.group(1))
    assert "results" not in shipped and "studies" not in shipped
    assert not (REPO / "results" / "__init__.py").exists()


def test_the_equal_leaf_benchmark_keeps_its_records_here_and_refuses_other_settings(tmp_path):
    import json

    import pytest

    from bench import RECORDS
    from bench.learning import _parser, records_of
    from bench.learning_runs import check_signatures

    args = _parser().parse_args(["--family", "synth_chain", "--workdir", str(tmp_path)])
    assert records_of(args) == RECORDS / "learning_synth_chain"
    assert records_of(_parser().parse_args(["--quick", "--workdir", str(tmp_path)])) == tmp_path
    given = _parser().parse_args(["--records", str(tmp_path / "r"), "--workdir", str(tmp_path)])
    assert records_of(given) == tmp_path / "r"
    runs = tmp_path / "r" / "runs"
    runs.mkdir(parents=True)
    (runs / "grpo-s0.json").write_text(json.dumps({"signature": "aaa", "result": {}}))
    check_signatures(tmp_path / "r", "aaa")  # the same settings: seeds accumulate
    with pytest.raises(SystemExit, match="records of other settings"):
        check_signatures(tmp_path / "r", "bbb")
