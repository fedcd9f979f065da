"""``trace score``: gold predictions score 1 and corrupted ones 0 with the training verifiers, for
every family; ids per file; clear errors naming the predictions file and line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.envs.base import DatasetError
from trace_rl.envs.datadir import default_data_dir
from trace_rl.envs.registry import make_env
from trace_rl.score import main, score

DATA = default_data_dir()  # the full data, or the fixtures where it is absent (tests/data_dirs.py)


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rewards(task, data, rows, tmp_path, **env_kwargs):
    preds = _write(tmp_path / "p.jsonl", rows)
    return [v.reward for _, v in score(task, Path(data), preds, **env_kwargs)]


def test_math_by_row_number_and_by_id(tmp_path):
    data = DATA / "math" / "gsm8k_test.jsonl"
    items = make_env("math").load(str(data), limit=30)
    half = len(items) // 2
    gold = [{"id": n + 1, "answer": it.gold} for n, it in enumerate(items[:half])]
    gold += [{"id": it.id, "answer": it.gold} for it in items[half:]]
    assert _rewards("math", data, gold, tmp_path) == [1.0] * len(items)
    wrong = [{"id": r["id"], "answer": str(int(r["answer"]) + 1)} for r in gold]
    assert _rewards("math", data, wrong, tmp_path) == [0.0] * len(items)
    aime = DATA / "math" / "aime2024.jsonl"
    rows = [{"id": it.id, "answer": it.gold} for it in make_env("math").load(str(aime))]
    assert _rewards("math", aime, rows, tmp_path) == [1.0] * len(rows)


def test_hotpotqa_ids_from_each_file(tmp_path):
    for name in ("hotpotqa_dev_distractor_first500.jsonl", "hotpotqa_train_distractor_100.jsonl",
                 "bamboogle_125.jsonl"):
        data = DATA / "multihop_qa" / name
        items = make_env("hotpotqa").load(str(data), limit=40)
        rows = [{"id": it.id, "answer": it.gold} for it in items]
        assert _rewards("hotpotqa", data, rows, tmp_path) == [1.0] * len(items)
        rows = [{"id": it.id, "answer": "zzqx"} for it in items]
        assert _rewards("hotpotqa", data, rows, tmp_path) == [0.0] * len(items)


def test_bfcl_single_turn_and_irrelevance(tmp_path):
    env = make_env("bfcl")
    data = DATA / "function_calling" / "bfcl" / "BFCL_v4_parallel_multiple.json"
    items = env.load(str(data), limit=25)
    rows = [{"id": it.id, "calls": json.loads(env.expert_actions(it)[-1].answer)} for it in items]
    assert _rewards("bfcl", data, rows, tmp_path) == [1.0] * len(items)
    for r in rows:
        r["calls"] = r["calls"][:-1]
    assert _rewards("bfcl", data, rows, tmp_path) == [0.0] * len(items)
    data = DATA / "function_calling" / "bfcl" / "BFCL_v4_irrelevance.json"
    items = env.load(str(data), limit=10)
    assert len(items) == 10
    rows = [{"id": it.id, "answer": "[]"} for it in items[:5]]
    rows += [{"id": it.id, "calls": [{"name": it.meta["functions"][0]["name"], "arguments": {}}]}
             for it in items[5:]]
    assert _rewards("bfcl", data, rows, tmp_path) == [1.0] * 5 + [0.0] * 5


@pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None, reason="bfcl-eval not installed")
def test_bfcl_multi_turn_calls_per_turn(tmp_path):
    from trace_rl.envs.bfcl import gt_call

    env = make_env("bfcl")
    data = DATA / "function_calling" / "bfcl" / "BFCL_v4_multi_turn_base.json"
    items = env.load(str(data), limit=10)
    rows = []
    for it in items:
        docs = {d["name"]: d for d in it.meta["functions"]}
        rows.append({"id": it.id, "calls": [[gt_call(docs, s) for s in t] for t in it.gold]})
    assert _rewards("bfcl", data, rows, tmp_path) == [1.0] * len(items)
    for r in rows:
        r["calls"] = r["calls"][:-1]
    assert _rewards("bfcl", data, rows, tmp_path) == [0.0] * len(items)


def test_synthetic_family_graded_by_replay(tmp_path):
    env = make_env("synth_fncall", difficulty=2, n_test=8)
    items = env.load("test")
    data = env.save(tmp_path / "fncall.jsonl", items)
    rows = [{"id": it.id, "calls": [{"name": a.tool, "arguments": dict(a.arguments)}
                                    for a in env.expert_actions(it) if a.kind == "tool"],
             "answer": "done"} for it in items]
    assert _rewards("synth_fncall", data, rows, tmp_path, difficulty=2) == [1.0] * 8
    preds = _write(tmp_path / "cli.jsonl", rows)
    assert main(["--task", "synth_fncall", "--data", str(data), "--predictions", str(preds),
                 "--env-arg", "difficulty=2"]) == 0
    rows = [{**r, "calls": r["calls"][:-1]} for r in rows]
    assert _rewards("synth_fncall", data, rows, tmp_path, difficulty=2) == [0.0] * 8


def test_cli_output_and_errors(tmp_path, capsys):
    data = DATA / "math" / "aime2024.jsonl"
    items = make_env("math").load(str(data), limit=4)
    preds = _write(tmp_path / "p.jsonl", [{"id": it.id, "answer": it.gold if k % 2 else "1000"}
                                          for k, it in enumerate(items)])
    assert main(["--task", "math", "--data", str(data), "--predictions", str(preds)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[:4] == [f"{it.id}\t{k % 2}" for k, it in enumerate(items)]
    assert lines[-1] == "mean reward: 0.5000"
    bad_cases = {
        '{"id": "2024-I-1", "answer": "204"}\n{"id": "2024-I-1" "answer": 1}\n': ":2: invalid JSON",
        '{"id": "nope", "answer": "1"}\n': ":1: unknown id 'nope'",
        '{"id": "2024-I-1", "answer": "1"}\n{"id": "2024-I-1", "answer": "2"}\n': ":2: id '2024-I-1' repeats line 1",
        '{"id": "2024-I-1"}\n': ":1: needs a field 'answer' or 'calls'",
        '["2024-I-1", "204"]\n': ":1: expected a JSON object",
    }
    for text, message in bad_cases.items():
        preds.write_text(text)
        assert main(["--task", "math", "--data", str(data), "--predictions", str(preds)]) == 2
        err = capsys.readouterr().err
        assert f"{preds}{message}" in err, err
    assert main(["--task", "chess", "--data", str(data), "--predictions", str(preds)]) == 2
    assert "unknown --task 'chess'" in capsys.readouterr().err
    with pytest.raises(DatasetError):
        score("math", data, _write(tmp_path / "q.jsonl", [{"id": "x", "answer": "1"}]))


def test_module_entry_point(tmp_path):
    data = DATA / "multihop_qa" / "bamboogle_125.jsonl"
    preds = _write(tmp_path / "p.jsonl", [{"id": 0, "answer": "James Madison"},
                                          {"id": 1, "answer": "nobody"}])
    out = subprocess.run([sys.executable, "-m", "trace_rl.score", "--task", "hotpotqa", "--data",
                          str(data), "--predictions", str(preds)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["0\t1", "1\t0", "mean reward: 0.5000"]


def test_empty_binary_and_malformed_files_are_named_with_their_line(tmp_path, capsys):
    """An empty data file once gave "unknown id '1'" and a binary file a UTF-8 error
    naming neither file nor line."""
    env = make_env("synth_arith", difficulty=1, n_test=4)
    items = env.load("test")
    data = env.save(tmp_path / "arith.jsonl", items)
    first = json.dumps({"id": items[0].id, "answer": "2"})
    good = _write(tmp_path / "p.jsonl", [{"id": items[0].id, "answer": "0"}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(first.encode() + b"\n\x00\x9c\xffPK\x03\x04\n")
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text(first + '\n\n{"id": 2, "answer": }\n')
    cases = [
        (empty, good, f"{empty}:1: the file is empty"),
        (binary, good, f"{binary}:2: not UTF-8 text (byte 0x9c at column 2)"),
        (data, empty, f"{empty}:1: no predictions: the file is empty"),
        (data, binary, f"{binary}:2: not UTF-8 text"),
        (data, malformed, f"{malformed}:3: invalid JSON"),
    ]
    for data_file, preds, message in cases:
        argv = ["--task", "synth_arith", "--data", str(data_file), "--predictions", str(preds),
                "--env-arg", "difficulty=1"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err, err
