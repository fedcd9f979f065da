"""The warm-start recipe (trace_rl.policy.warmstart): traces from training data only, really run
and graded; SFT end to end on a small model; the cache; the MLflow run; bad settings."""

from __future__ import annotations

import random
import pytest

from trace_rl.envs.datadir import default_data_dir
from trace_rl.envs.registry import make_env
from trace_rl.policy.warmstart import (WarmstartConfig, build_traces, config_from_args,
                                       read_record, warmstart_policy)

DATA = default_data_dir()
needs_data = pytest.mark.skipif(not (DATA / "multihop_qa").is_dir(),
                                reason=f"multihop_qa data not found under {DATA}")


@needs_data
def test_traces_come_from_training_items_and_succeed(tiny_model_dir):
    from transformers import AutoTokenizer

    from trace_rl.policy.bootstrap import _Scripted
    from trace_rl.rollout.react import expert_episode

    cfg = WarmstartConfig(recovery=1.0)
    env = make_env("hotpotqa", **dict(cfg.env_args))
    train = env.load("train")
    dev_ids = {it.id for it in env.load("dev")}
    traces = list(build_traces(cfg, env, train, random.Random(0)))
    assert {k for *_, k in traces} == {"gold", "recovery"}
    assert not {it.id for it, *_ in traces} & dev_ids  # never an evaluation item
    for item, actions, thoughts, kind in traces:
        support = set(item.meta["supporting_titles"])
        queries = [a.arguments["query"] for a in actions if a.kind == "tool"]
        assert set(queries[-len(support):]) == support
        if kind == "recovery":
            assert queries[0] not in support and len(queries) == len(support) + 1
        assert actions[-1].answer == item.gold and thoughts == [""] * len(actions)
    # the traces really search (real BM25 observations) and are graded 1 by the environment
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for item, actions, thoughts, kind in traces[:10]:
        ep = expert_episode(_Scripted(env, actions), item, tokenizer, thoughts=thoughts)
        assert ep.reward == 1.0
        assert all(t.obs_text.startswith("[1] ") for t in ep.turns if t.action.kind == "tool")


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="give key=value with a key among family"):
        config_from_args(["famliy=hotpotqa"])
    with pytest.raises(ValueError, match="epochs='two' must be a int"):
        config_from_args(["epochs=two"])
    with pytest.raises(ValueError, match="no trace builder for family 'math'"):
        config_from_args(["family=math"])
    with pytest.raises(ValueError, match="must differ"):
        config_from_args(["eval_split=train"])
    assert config_from_args(['env_args={"top_k": 3}', "recovery=0.5"]).env_args == (("top_k", 3),)


@needs_data
def test_warmstart_end_to_end_is_cached_and_tracked(tmp_path, tiny_model_dir):
    from trace_rl.storage.tracking import Tracker

    cfg = WarmstartConfig(base=str(tiny_model_dir), train_items=6, recovery=0.5,
                          trainable_layers=1, max_tokens=100_000, eval_items=3, max_turns=2,
                          max_new_tokens=8, batch_size=2, eval_temperature=0.7)
    out = warmstart_policy(cfg, tmp_path / "policy", cache_dir=tmp_path / "cache",
                           workdir=tmp_path / "wd", engine="hf")
    record = read_record(out)
    assert record["traces"]["gold"] == 6 and record["traces_too_long"] == 0
    assert record["trace_success"] == {k: 1.0 for k in record["traces"]}
    assert record["after"]["items"] == 3 and 0.0 <= record["after"]["success"] <= 1.0
    assert record["before"]["items"] == 3 and len(record["history"]) == cfg.epochs
    assert record["after_greedy"]["temperature"] == 0.0
    assert record["after"]["temperature"] == 0.7 and record["after_t1"]["temperature"] == 1.0
    assert (out / "config.json").is_file()
    stamp = (out / "warmstart.json").stat().st_mtime_ns
    again = warmstart_policy(cfg, tmp_path / "other", cache_dir=tmp_path / "cache",
                             workdir=tmp_path / "wd", engine="hf")
    assert read_record(again)["input_hash"] == record["input_hash"]  # copied, not rebuilt
    assert (out / "warmstart.json").stat().st_mtime_ns == stamp
    runs = Tracker(tmp_path / "wd", experiment="warmstart").client.search_runs(
        [Tracker(tmp_path / "wd", experiment="warmstart").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert "loss/sft" in runs[0].data.metrics and "eval/after_success" in runs[0].data.metrics
