"""The learning benchmark's small configuration runs every method through the real train flow."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

# The quick learning benchmark runs train flows: 122 s here at load 4-5, with the harness.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness"), pytest.mark.timeout(1200)]


def test_quick_learning_benchmark(tmp_path, capsys):
    from bench.learning import METHODS, main

    out = main(["--quick", "--workdir", str(tmp_path / "wd"), "--train-items", "12"])
    printed = capsys.readouterr().out.strip().splitlines()
    line = re.fullmatch(r"TRACE vs best baseline: ([+-]\d+\.\d) points held-out accuracy; "
                        r"effective ratio (\d+\.\d+|nan)x GRPO", printed[-1])
    assert line, printed[-1]
    # The headline is the table's: TRACE's final accuracy against the best other method's, and
    # the effective ratios' quotient (nan only when GRPO had no mixed prompt at all).
    table = out["table"]
    best = max(table[m]["final"][0] for m in table if m != "trace")
    assert float(line.group(1)) == pytest.approx(100 * (table["trace"]["final"][0] - best), abs=0.051)
    grpo = table["grpo"]["effective_ratio"]
    assert (line.group(2) == "nan") == (grpo == 0)
    if grpo:
        assert float(line.group(2)) == pytest.approx(table["trace"]["effective_ratio"] / grpo,
                                                     abs=0.0051)
    assert set(out["table"]) == set(METHODS)
    budget = out["table"]["grpo"]["leaves"]
    for method, t in out["table"].items():
        # Equal sampling cost: every method spends the same trajectories; DAPO stops early once
        # its batch holds enough mixed groups, so it may spend less, never more.
        if method == "dapo":
            assert 0 < t["leaves"] <= budget
        else:
            assert t["leaves"] == budget > 0
        # The final accuracy is the mean over the method's seeds of its last evaluation.
        last = [r["accuracy"][-1] for r in out["results"] if r["method"] == method]
        assert last and t["final"][0] == pytest.approx(sum(last) / len(last))
    # Tokens per evaluation and the predictor's per-step statistics: recorded, and rising.
    from bench.learning_runs import PREDICTOR_KEYS

    for r in out["results"]:
        assert r["eval_tokens"][0] == 0.0 and len(r["eval_tokens"]) == len(r["accuracy"])
        assert all(b >= a for a, b in zip(r["eval_tokens"], r["eval_tokens"][1:]))
        assert r["eval_tokens"][-1] == r["generated_tokens"]
        for key in PREDICTOR_KEYS:  # nan where undefined
            assert len(r["extra"][key]) == len(r["leaves"])
    again = main(["--workdir", str(tmp_path / "wd"), "--summarise-only", "--quick"])
    reprinted = capsys.readouterr().out.strip().splitlines()
    # compared as JSON: a mean over undefined AUCs is nan, and a nan read back is not == to it
    assert reprinted[-1] == printed[-1]
    assert json.dumps(again["table"]["trace"], sort_keys=True) == json.dumps(out["table"]["trace"],
                                                                                sort_keys=True)
    # The calibration report reads the same work dir (one DuckDB store, --jobs 1 with --quick).
    from studies.calibration import main as calibration, rows_for

    rows = rows_for(tmp_path / "wd")
    assert {r["allocator"] for r in rows} == set(METHODS)
    for r in rows:
        assert r["nodes"] > 0 and 0.0 <= r["realised"] <= 1.0 and 0.0 <= r["predicted"] <= 1.0
    assert any(r["depth"] >= 1 and r["allocator"] == "trace" for r in rows)  # Stage 2 continued
    calibration(["--workdir", str(tmp_path / "wd")])
    assert "predicted" in capsys.readouterr().out
    # --train-items: every method's prompts came from the first 12 items of the train split.
    from tasks.runtime import environment
    from trace_rl.storage.store import TreeStore

    env = environment("synth_arith", (("difficulty", 1), ("n_train", 12)))
    train = {item.id for item in env.load("train")}
    used = TreeStore(tmp_path / "wd" / "trace.duckdb", create=False).query(
        "SELECT DISTINCT item_id FROM nodes").column("item_id").to_pylist()
    assert used and set(used) <= train
    # Seeds accumulate: a second invocation adds seed 1 of two methods and reuses every seed-0
    # run (its record is not rewritten); the report covers both seeds.
    runs = tmp_path / "wd" / "runs"
    before = {p.name: p.stat().st_mtime_ns for p in runs.glob("*.json")}
    assert set(before) == {f"{m}-s0.json" for m in METHODS}
    more = main(["--quick", "--workdir", str(tmp_path / "wd"), "--train-items", "12",
                 "--seeds", "1-1", "--methods", "trace,grpo"])
    assert {p.name: p.stat().st_mtime_ns for p in runs.glob("*.json") if p.name in before} == before
    assert sorted((r["method"], r["seed"]) for r in more["results"]) == \
        [("grpo", 0), ("grpo", 1), ("trace", 0), ("trace", 1)]
    assert more["tests"]["at_tokens"]["grpo"]["gain"].n == 2
    # each record names the invocation that made it and the policy it resolved to
    made = json.loads((runs / "grpo-s1.json").read_text())["result"]["extra"]["settings"]
    assert (made["seeds"], made["methods"], made["train_items"], made["set"]) == ("1-1", "trace,grpo", 12, [])
    assert made["policy_path"] == str(Path(made["policy_path"]).resolve()) and Path(made["policy_path"]).is_dir()
    assert "trace - grpo           at equal generated tokens" in capsys.readouterr().out
    # A record that started from another accuracy (another CPU's bootstrap, or another policy)
    # does not pair with this machine's runs: the next invocation refuses the folder, naming it
    # and both accuracies, before it runs anything.
    rec = json.loads((runs / "grpo-s1.json").read_text())
    rec["result"]["accuracy"][0] += 0.125
    (runs / "grpo-s1.json").write_text(json.dumps(rec))
    with pytest.raises(SystemExit, match=rf"{re.escape(str(runs.parent))}: its runs start from "
                       r"held-out accuracy .*would not pair") as refused:
        main(["--quick", "--workdir", str(tmp_path / "wd"), "--train-items", "12", "--seeds", "2-2",
              "--methods", "grpo"])
    assert f"{rec['result']['accuracy'][0]:.6g}" in str(refused.value)
    assert not (runs / "grpo-s2.json").exists()


def test_a_real_family_takes_its_policy_and_settings_without_synthetic_splits(tmp_path, tiny_model_dir):
    """bench.learning on HotpotQA from a given policy: the --set fields reach every run's config
    (parsed with that policy, which `trace train` would refuse as tiny), no synthetic split sizes
    go into ``extra``, and the synthetic-only options are refused by name."""
    from bench.learning import _parser, _policy_and_base

    args = _parser().parse_args(["--family", "hotpotqa", "--policy", str(tiny_model_dir),
                                 "--set", "train_split=dev", "trainable_layers=1",
                                 'extra={"top_k":2}', "pool_size=2"])  # (the fixtures: 8 items)
    policy, base, skip = _policy_and_base(args, tmp_path)
    assert policy == str(tiny_model_dir.resolve()) and skip == 0
    assert base["extra"] == {"top_k": 2} and base["train_split"] == "dev"
    assert base["trainable_layers"] == 1
    args = _parser().parse_args(["--family", "hotpotqa", "--policy", str(tiny_model_dir)])
    assert _policy_and_base(args, tmp_path)[1]["extra"] == {}
    # A warm start's search settings reach every run (and its evaluations) unless --set gives
    # others: the observations RL shows must be the ones its SFT taught it to read.
    from trace_rl.policy.warmstart import WarmstartConfig

    ws = tmp_path / "ws"
    shutil.copytree(tiny_model_dir, ws)
    built = WarmstartConfig(env_args=(("max_chars", 400), ("top_k", 3)), trainable_layers=1)
    (ws / "warmstart.json").write_text(json.dumps({"config": built.to_json()}))
    args = _parser().parse_args(["--family", "hotpotqa", "--policy", str(ws)])
    assert _policy_and_base(args, tmp_path)[1]["extra"] == {"max_chars": 400, "top_k": 3}
    args = _parser().parse_args(["--family", "hotpotqa", "--policy", str(ws),
                                 "--set", 'extra={"top_k":2}', "pool_size=2"])
    assert _policy_and_base(args, tmp_path)[1]["extra"] == {"top_k": 2}
    args = _parser().parse_args(["--family", "hotpotqa", "--policy", str(tiny_model_dir),
                                 "--train-items", "12"])
    with pytest.raises(SystemExit, match="--train-items and --mix are options of the synthetic"):
        _policy_and_base(args, tmp_path)


def test_the_tokens_protocol_sizes_each_baseline_from_its_seeds_reference(tmp_path, capsys):
    """--regime paper --quick: the reference first, grpo sized to its tokens per step, the control
    on d = 1 items in the same invocation, compact records that a second invocation reuses; the
    Monte-Carlo oracle's row (main only) records its oracle's tokens apart from its own."""
    from bench.learning import main, matched_budget
    from bench.learning_runs import RunResult

    rec = tmp_path / "rec"
    common = ["--quick", "--regime", "paper", "--workdir", str(tmp_path / "wd"), "--records",
              str(rec), "--methods", "trace_cover,grpo,trace_cover_oracle"]
    out = main(common)
    printed = capsys.readouterr().out
    assert "no closing line: fewer than 2 complete seeds" in printed
    for structure in ("main", "control"):
        runs = {p.name: json.loads(p.read_text()) for p in (rec / structure / "runs").glob("*.json")}
        oracle = {"trace_cover_oracle-s0.json"} if structure == "main" else set()
        assert set(runs) == {"trace_cover-s0.json", "grpo-s0.json"} | oracle
        ref, grpo = (RunResult(**runs[f]["result"]) for f in ("trace_cover-s0.json", "grpo-s0.json"))
        assert grpo.extra["budget"] == matched_budget(ref, "grpo", 4) and ref.extra["budget"] == {}
        assert grpo.leaves == [grpo.extra["budget"]["root_budget"]] * 2  # every step at its size
        assert len(ref.extra["steps"]["train_tokens"]) == 2
        # a continuation's prefix is trained once per path through it, so training tokens are at
        # least the generated ones; a flat method's are equal
        assert all(t >= g for t, g in zip(ref.extra["steps"]["train_tokens"], ref.extra["steps"]["tokens"]))
        assert grpo.extra["steps"]["train_tokens"] == grpo.extra["steps"]["tokens"]
        assert "oracle_tokens" not in ref.extra["steps"] and "oracle_tokens" not in grpo.extra["steps"]
        if oracle:  # 8 rollouts of each of the 8 candidates a step, none of them in "tokens"
            steps = runs["trace_cover_oracle-s0.json"]["result"]["extra"]["steps"]
            assert len(steps["oracle_tokens"]) == 2 and min(steps["oracle_tokens"]) > 64
        assert len((rec / structure / "runs" / "grpo-s0.json").read_text().splitlines()) == 1
    assert set(out["tables"]) == {"main", "control"}
    row = next(r for r in out["tables"]["main"] if r["method"] == "trace_cover_oracle")
    assert row["seeds"] == 1 and row["oracle_tokens"] > row["tokens"]
    before = {p: p.stat().st_mtime_ns for p in rec.rglob("*.json")}
    again = main([*common, "--summarise-only"])
    assert {p: p.stat().st_mtime_ns for p in rec.rglob("*.json")} == before
    assert json.dumps(again["tables"], sort_keys=True) == json.dumps(out["tables"], sort_keys=True)
