"""The warm-start recipe (trace_rl.policy.warmstart): traces from training data only, really run
and graded; SFT end to end on a small model; the cache; the MLflow run; bad settings.

The data is the full set when TRACE_DATA_DIR holds it, else the fixtures (tests/data_dirs.py),
where ``dev_rest`` is empty (all 8 dev questions are in ``dev_heldout``, the first 100); the
split sizes and the share of questions answered after one search are checked on the full data
(``full_data``)."""

from __future__ import annotations

import random
import pytest

from data_dirs import FULL_DATA
from trace_rl.envs.hotpotqa.warmstart import quote
from trace_rl.envs.registry import make_env
from trace_rl.config import warmstart_config
from trace_rl.policy.warmstart import (WarmstartConfig, build_traces, load_split_items,
                                       read_record, warmstart_policy)


@pytest.mark.parametrize("thoughts", [False, True])
def test_traces_come_from_training_items_and_succeed(tiny_model_dir, thoughts):
    from transformers import AutoTokenizer

    from trace_rl.policy.bootstrap import _Scripted
    from trace_rl.rollout.react import expert_episode

    cfg = WarmstartConfig(recovery=1.0, bridge_thoughts=thoughts, question_first=False,
                          env_args=(("top_k", 2), ("max_chars", 200)))  # recipes 2-3
    env = make_env("hotpotqa", **dict(cfg.env_args))
    train, held = load_split_items(cfg, env)
    assert len(train) == len(env.load("train")) + len(env.load("dev_rest"))
    assert len(held) == min(cfg.eval_items, len(env.load("dev_heldout")))
    traces = list(build_traces(cfg, env, train, random.Random(0)))
    assert {k for *_, k in traces} == {"gold", "recovery"}
    # the split: no evaluation item (by id or by question) among the training traces
    assert not {it.id for it, *_ in traces} & {it.id for it in env.load("dev_heldout")}
    assert not {it.question for it, *_ in traces} & {it.question for it in held}
    assert {it.id for it, *_ in traces} >= {it.id for it in env.load("dev_rest")}
    for item, actions, said, kind in traces:
        support = item.meta["supporting_titles"]
        names = {t.split(" (")[0] for t in support} if thoughts else set(support)
        queries = [a.arguments["query"] for a in actions if a.kind == "tool"]
        assert set(queries[-len(set(support)):]) == names
        if kind == "recovery":  # first a search for a paragraph that is not a supporting one
            others = {p["title"] for p in item.meta["paragraphs"]} - set(support)
            assert queries[0] in ({t.split(" (")[0] for t in others} if thoughts else others)
            assert len(queries) == len(set(support)) + 1
        assert actions[-1].answer == item.gold and len(said) == len(actions)
        if not thoughts:
            assert said == [""] * len(actions)
    # the traces really search (real BM25 observations) and are graded 1 by the environment
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    quoted = 0
    for item, actions, said, kind in traces[:60]:
        ep = expert_episode(_Scripted(env, actions), item, tokenizer, thoughts=said)
        assert ep.reward == 1.0
        assert all(t.obs_text.startswith("[1] ") for t in ep.turns if t.action.kind == "tool")
        for i, (turn, thought) in enumerate(zip(ep.turns, said)):
            if not thought:
                continue
            # a bridge thought quotes an earlier real observation, ending with what it copies
            span = thought.removeprefix('The result says "').removesuffix('".')
            target = turn.action.arguments["query"] if turn.action.kind == "tool" \
                else turn.action.answer
            assert span.lower().endswith(target.lower())
            assert any(span in t.obs_text for t in ep.turns[:i])
            assert turn.text.count(thought) == 1
            quoted += turn.action.kind == "tool"
    assert quoted >= len(traces[:60]) // 6 if thoughts else quoted == 0  # 16 of the full 60


def one_search_traces(env, items) -> tuple[list, int]:
    """Recipe 4's traces of ``items`` (checked as they are built) and how many answer after
    the question's own search."""
    cfg = warmstart_config(["recovery=0.0"])  # recipe 4 is the default
    traces = list(build_traces(cfg, env, items, random.Random(0)))
    assert len(traces) == len(items)
    one_search = 0
    for item, actions, said, _ in traces:
        queries = [a.arguments["query"] for a in actions if a.kind == "tool"]
        assert queries[0] == item.question and actions[-1].answer == item.gold
        first = env.call_tool(env.reset(item), "search", {"query": item.question})
        held = quote(first, item.gold) is not None and item.gold.lower() not in ("yes", "no")
        if held:
            assert len(queries) == 1 and said[-1] == f'The result says "{quote(first, item.gold)}".'
        else:  # the entities the first results did not show, by name
            shown = {line.split(": ")[0].split("] ", 1)[1] for line in first.splitlines()}
            assert set(queries[1:]) == {t.split(" (")[0] for t in
                                        set(item.meta["supporting_titles"]) - shown}
        one_search += len(queries) == 1
    return traces, one_search


def test_question_first_traces_search_the_question_then_quote_the_answer(tiny_model_dir):
    """Recipe 4: the first search is the question; when its results hold the answer the trace
    answers at once, quoting it; otherwise it searches the supporting entities not yet shown."""
    from transformers import AutoTokenizer

    from trace_rl.policy.bootstrap import _Scripted
    from trace_rl.rollout.react import expert_episode

    cfg = warmstart_config(["recovery=0.0"])
    env = make_env("hotpotqa", **dict(cfg.env_args))
    train, _ = load_split_items(cfg, env)
    traces, one_search = one_search_traces(env, train[:120])
    assert 0 < one_search < len(traces)  # both kinds of trace
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for item, actions, said, _ in traces[:20]:
        ep = expert_episode(_Scripted(env, actions), item, tokenizer, thoughts=said)
        assert ep.reward == 1.0 and ep.turns[0].obs_text.startswith("[1] ")


def test_quote_takes_a_whole_word_span():
    obs = "[1] Kiss and Tell (1945 film): Kiss and Tell is a 1945 comedy film starring then " \
          "17-year-old Shirley Temple as Corliss Archer.\n[2] Nothing: not known"
    assert quote(obs, "shirley temple") == \
        "and Tell is a 1945 comedy film starring then 17-year-old Shirley Temple"  # <= 60 + span
    assert quote(obs, "Kiss and Tell") == "Kiss and Tell"  # never the "[1] Title:" head
    assert quote(obs, "no") is None and quote(obs, "Temp") is None and quote(obs, " ") is None
    assert quote(obs, "known") == "not known"


@pytest.mark.full_data("hotpotqa")
def test_full_splits_and_the_share_answered_after_one_search():
    """The recipe's split sizes on the full data (train 100 + dev_rest 400; 100 measured), and
    the first 120 training items' traces: 64% answer after the question's own search."""
    cfg = warmstart_config(["recovery=0.0"])
    env = make_env("hotpotqa", data_dir=FULL_DATA, **dict(cfg.env_args))
    train, held = load_split_items(cfg, env)
    assert len(train) == 500 and len(held) == cfg.eval_items == 100
    traces, one_search = one_search_traces(env, train[:120])
    assert 50 <= one_search <= 110


def test_training_splits_holding_an_eval_item_are_refused():
    env = make_env("hotpotqa")
    held = len(env.load("dev_heldout"))
    with pytest.raises(ValueError, match=f"{held} item.*dev_heldout.*are in train_split='train\\+dev'"):
        load_split_items(WarmstartConfig(train_split="train+dev"), env)
    with pytest.raises(ValueError, match="must differ"):
        WarmstartConfig(train_split="train+dev_heldout")
    with pytest.raises(ValueError, match="empty part"):
        WarmstartConfig(train_split="train+")


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown field 'famliy' in trace warmstart; known: family"):
        warmstart_config(["famliy=hotpotqa"])
    with pytest.raises(ValueError, match="epochs='two' .* valid integer"):
        warmstart_config(["epochs=two"])
    with pytest.raises(ValueError, match="no trace builder for family 'math'"):
        warmstart_config(["family=math"])
    with pytest.raises(ValueError, match="must differ"):
        warmstart_config(["eval_split=train"])
    with pytest.raises(ValueError, match=r"eval_temperature=0.0 .* greater than 0"):
        warmstart_config(["eval_temperature=0"])
    assert warmstart_config(['env_args={"top_k": 3}', "recovery=0.5"]).env_args == (("top_k", 3),)
    with pytest.raises(ValueError, match="threads=-1 .* greater than or equal to 0"):
        warmstart_config(["threads=-1"])


def test_pinned_threads_enter_the_hash_and_auto_leaves_it_as_it_was():
    assert "threads" not in WarmstartConfig().to_json()  # default builds keep their cache key
    assert warmstart_config(["threads=1"]).to_json()["threads"] == 1


@pytest.mark.slow  # SFT, rollouts and MLflow
def test_warmstart_end_to_end_is_cached_and_tracked(tmp_path, tiny_model_dir):
    from trace_rl.storage.tracking import Tracker

    cfg = WarmstartConfig(base=str(tiny_model_dir), train_items=6, recovery=0.5,
                          trainable_layers=1, max_tokens=100_000, eval_items=3, max_turns=2,
                          max_new_tokens=8, batch_size=2, eval_temperature=0.7, threads=1)
    out = warmstart_policy(cfg, tmp_path / "policy", cache_dir=tmp_path / "cache",
                           workdir=tmp_path / "wd", engine="hf")
    record = read_record(out)
    assert record["traces"]["gold"] == 6 and record["traces_too_long"] == 0
    assert record["threads"] == 1 and record["config"]["threads"] == 1  # pinned, not the idle cores
    assert len(record["train_ids"]) == 6 and len(record["eval_ids"]) == 3
    assert not set(record["train_ids"]) & set(record["eval_ids"])
    assert record["trace_success"] == {k: 1.0 for k in record["traces"]}
    assert record["after"]["items"] == 3 and 0.0 <= record["after"]["success"] <= 1.0
    for t in ("bridge", "comparison"):  # per question type, with its interval where n >= 2
        n = record["after"].get(f"items_{t}", 0)
        assert (f"ci_low_{t}" in record["after"]) == (n >= 2)
    assert record["before"]["items"] == 3 and len(record["history"]) == cfg.epochs
    assert record["after_greedy"]["temperature"] == 0.0
    assert record["after"]["temperature"] == 0.7 and record["after_t1"]["temperature"] == 1.0
    assert (out / "config.json").is_file()
    # RL on it (`trace train policy=<out>`) reads what it was trained and measured with
    from trace_rl.config import config_from_mapping

    rl = config_from_mapping({"policy": str(out)})
    assert (rl.family, rl.eval_split, rl.extra, rl.trainable_layers) == \
        ("hotpotqa", "dev_heldout", {"top_k": 3, "max_chars": 400}, 1)
    stamp = (out / "warmstart.json").stat().st_mtime_ns
    again = warmstart_policy(cfg, tmp_path / "other", cache_dir=tmp_path / "cache",
                             workdir=tmp_path / "wd", engine="hf")
    assert read_record(again)["input_hash"] == record["input_hash"]  # copied, not rebuilt
    assert (out / "warmstart.json").stat().st_mtime_ns == stamp
    runs = Tracker(tmp_path / "wd", experiment="warmstart").client.search_runs(
        [Tracker(tmp_path / "wd", experiment="warmstart").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert "loss/sft" in runs[0].data.metrics and "eval/after_success" in runs[0].data.metrics


def test_bfcl_warm_start_has_its_own_defaults_and_gold_traces(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from trace_rl.policy.sft import ScriptedEnv
    from trace_rl.envs.bfcl.warmstart import bfcl_trace
    from trace_rl.rollout.react import expert_episode

    assert warmstart_config([]) == WarmstartConfig()  # HotpotQA's recipe (and its hash)
    cfg = warmstart_config(["family=bfcl"])
    assert (cfg.train_split, cfg.eval_split, cfg.env_args, cfg.recovery) == \
        ("live_simple", "simple_python", (), 0.0)
    assert warmstart_config(["family=bfcl", "max_new_tokens=64"]).max_new_tokens == 64
    env = make_env("bfcl")
    train, held = load_split_items(cfg, env)
    assert len(train) == len(env.load("live_simple"))
    assert len(held) == min(cfg.eval_items, len(env.load("simple_python")))
    # BFCL's `multiple` reuses simple_python's questions: refused as a training split
    with pytest.raises(ValueError, match="of eval_split='simple_python' are in train_split='multiple'"):
        load_split_items(warmstart_config(["family=bfcl", "train_split=multiple"]), env)
    traces = list(build_traces(warmstart_config(["family=bfcl", "recovery=1.0"]), env, train[:20],
                               random.Random(0)))
    # one turn: no recovery traces
    assert len(traces) == len(train[:20]) and {k for *_, k in traces} == {"gold"}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for item, actions, said, _ in traces:
        assert [a.kind for a in actions] == ["answer"] and said == [""]
        assert expert_episode(ScriptedEnv(env, actions), item, tokenizer, thoughts=said).reward == 1.0
    multi = env.load("multi_turn_base", limit=1)[0]
    assert bfcl_trace(env, multi, random.Random(0), False, False) is None
    # end to end on the tiny model: SFT on BFCL traces, measured on simple_python
    small = WarmstartConfig(**{**cfg.__dict__, "base": str(tiny_model_dir), "train_items": 4,
                               "trainable_layers": 1, "max_tokens": 100_000, "eval_items": 2,
                               "max_new_tokens": 8, "batch_size": 2, "measure_greedy": False})
    record = read_record(warmstart_policy(small, tmp_path / "policy", engine="hf"))
    assert record["traces"] == {"gold": 4} and record["eval_split"] == "simple_python"
    assert record["after"]["items"] == 2 and record["before"]["items"] == 2
    # the family's own verifier metrics (none here: 8 tokens never close an answer), never
    # HotpotQA's written as zeros
    assert not {"em", "f1", "strict"} & set(record["after"])
