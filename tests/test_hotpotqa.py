"""Multi-hop QA: the HotpotQA answer metrics by hand, gold = 1 / corrupted = 0 over every QA file,
BM25 search over per-question and pooled corpora, and restore by replay.

The data is the full set when TRACE_DATA_DIR holds it, else the fixtures (tests/data_dirs.py);
the full files' sizes are checked where they are present (``full_data``)."""

from __future__ import annotations

import pytest

from data_dirs import FULL_DATA
from trace_rl.envs.base import DatasetError, ToolError
from trace_rl.envs.hotpotqa.env import (BLOCKS, DEV_HELDOUT, SPLITS, HotpotQAEnv, exact_match,
                                    f1_score, grade, load_qa_file, normalize_answer)


def test_normalisation_and_metrics_by_hand():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert exact_match("the Eiffel tower.", "Eiffel Tower") == 1.0
    # pred tokens [chief, of, protocol, of, united, states], gold [chief, of, protocol]:
    # 3 shared, precision 3/6, recall 3/3 -> F1 = 2 * .5 * 1 / 1.5
    assert f1_score("Chief of Protocol of the United States", "Chief of Protocol") == pytest.approx(2 / 3)
    assert f1_score("yes it is", "yes") == 0.0  # yes/no must match exactly
    assert f1_score("no", "yes") == 0.0 and f1_score("Yes.", "yes") == 1.0
    assert f1_score("", "Paris") == 0.0
    # golds that normalise to nothing (dev idx 3667 "The The", 5470 "!!!") need their own text
    assert f1_score("the the", "The The") == 1.0 and exact_match("!!!", "!!!") == 1.0
    assert f1_score("The", "The The") == 0.0 and exact_match("?", "!!!") == 0.0
    # F1 0.4 passes the paper's 0.3 bar; 0.25 does not
    assert grade("alpha beta gamma delta", "alpha x y z w v").reward == 0.0  # F1 = 0.2
    v = grade("alpha beta", "alpha x y z")  # P = 1/4, R = 1/2 -> F1 = 1/3
    assert v.reward == 1.0 and v.metrics["f1"] == pytest.approx(1 / 3) and v.metrics["em"] == 0.0


def _corrupt(gold: str) -> str:
    n = normalize_answer(gold)
    return {"yes": "no", "no": "yes"}.get(n, "zzqx wrongtoken")


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_gold_one_corrupted_zero_every_row(split):
    env = HotpotQAEnv()
    items = env.load(split)
    assert len({it.id for it in items}) == len(items), "ids must be unique within a file"
    assert [it.id for it in items if env.verify(it, it.gold).reward != 1.0] == []
    assert [it.id for it in items if env.verify(it, it.gold).metrics["em"] != 1.0] == []
    assert [it.id for it in items if env.verify(it, _corrupt(it.gold)).reward != 0.0] == []


def test_dev_blocks_are_fixed_and_disjoint(monkeypatch):
    assert DEV_HELDOUT == 100
    assert BLOCKS == {"dev_heldout": ("dev", 0, DEV_HELDOUT), "dev_rest": ("dev", DEV_HELDOUT, None)}
    env = HotpotQAEnv()
    dev = env.load("dev")
    # the full dev file's blocks as they are (100 + 400); on the fixtures, scaled to the file
    k = min(DEV_HELDOUT, len(dev) // 2)
    monkeypatch.setitem(BLOCKS, "dev_heldout", ("dev", 0, k))
    monkeypatch.setitem(BLOCKS, "dev_rest", ("dev", k, None))
    held, rest = env.load("dev_heldout"), env.load("dev_rest")
    assert len(held) == k >= 2 and len(rest) == len(dev) - k >= 3
    assert [it.id for it in held + rest] == [it.id for it in dev]  # file order, nothing lost
    assert not {it.id for it in held} & {it.id for it in rest}
    assert not {it.question for it in held} & {it.question for it in rest}
    assert [it.id for it in env.load("dev_rest", limit=3)] == [it.id for it in rest[:3]]
    assert held[0].meta["paragraphs"] and held[0].meta["corpus"] == dev[0].meta["corpus"]
    assert set(BLOCKS) == {"dev_heldout", "dev_rest"}
    with pytest.raises(ValueError, match="dev_heldout, dev_rest"):
        env.load("dev_held")


def test_search_finds_supporting_paragraphs():
    env = HotpotQAEnv()
    items = env.load("dev", limit=100)
    assert all(len(it.meta["paragraphs"]) in (2, 5, 10) for it in items)
    hits = total = 0
    for it in items:
        state = env.reset(it)
        for action in env.expert_actions(it)[:-1]:
            obs = env.call_tool(state, "search", action.arguments)
            total += 1
            hits += f"] {action.arguments['query']}:" in obs
            assert obs.count("\n") < env.config.top_k
    assert total >= 2 * len(items) and hits / total >= 0.95, (hits, total)


def test_index_cached_per_question_and_pooled_option():
    env = HotpotQAEnv(top_k=2, max_chars=80)
    item = env.load("dev", limit=1)[0]
    assert env._index(item) is env._index(item)
    obs = env.call_tool(env.reset(item), "search", {"query": "Scott Derrickson"})
    assert obs.startswith("[1] Scott Derrickson:") and obs.count("\n") == 1
    assert all(len(line) < 80 + 60 for line in obs.splitlines())
    assert env.call_tool(env.reset(item), "search", {"query": "qqqzzz"}) == "No results."
    pooled = HotpotQAEnv(corpus="pooled")
    own_titles = {p["title"] for p in item.meta["paragraphs"]}
    obs = pooled.call_tool(pooled.reset(item), "search", {"query": "Kiss and Tell 1945 film"})
    first_title = obs.split(":", 1)[0][4:]
    assert first_title == "Kiss and Tell (1945 film)" and first_title not in own_titles
    train = pooled.load("train", limit=1)[0]
    assert "5a77" in train.id and train.meta["corpus"].endswith("hotpotqa_train_100_corpus.jsonl")


def test_tool_errors():
    env = HotpotQAEnv()
    item = env.load("dev", limit=1)[0]
    state = env.reset(item)
    with pytest.raises(ToolError, match="unknown tool"):
        env.call_tool(state, "lookup", {"query": "x"})
    with pytest.raises(ToolError, match="query"):
        env.call_tool(state, "search", {"query": "  "})
    qa_only = env.load("bamboogle", limit=1)[0]
    with pytest.raises(ToolError, match="no paragraphs"):
        env.call_tool(env.reset(qa_only), "search", {"query": "x"})


def test_restore_by_replay_equals_live():
    env = HotpotQAEnv()
    item = env.load("dev", limit=3)[2]
    actions = env.expert_actions(item)
    state = env.reset(item)
    observations = [env.step(state, a).observation for a in actions]
    for k in range(len(actions)):
        restored = env.restore(item, actions[:k], observations[:k])
        assert restored == state
        # the continuation from prefix k sees exactly the live observations, on a fresh env too
        fresh = HotpotQAEnv()
        assert [fresh.step(restored, a).observation for a in actions[k:]] == observations[k:]
    assert env.verify(item, actions[-1].answer).reward == 1.0


@pytest.mark.full_data("hotpotqa")
def test_full_files_and_blocks():
    """The full files' sizes (tests/data/README.md and the data's own README): the blocks are
    100 + 400 of the 500 dev questions; 495 of them bring 10 paragraphs, the others 2 or 5."""
    env = HotpotQAEnv(data_dir=FULL_DATA)
    sizes = {split: len(env.load(split)) for split in SPLITS}
    assert sizes == {"dev": 500, "train": 100, "dev_qa": 7405, "musique_dev": 500,
                     "2wiki_dev": 500, "bamboogle": 125}
    assert (len(env.load("dev_heldout")), len(env.load("dev_rest"))) == (100, 400)
    counts = [len(it.meta["paragraphs"]) for it in env.load("dev")]
    assert counts.count(10) == 495 and set(counts) == {2, 5, 10}


def test_malformed_rows_name_file_and_line(tmp_path):
    bad = tmp_path / "qa.jsonl"
    bad.write_text('{"id": "a", "question": "q", "answer": "x"}\n{"id": "b", "question": "q"}\n')
    with pytest.raises(DatasetError, match=r"qa.jsonl:2: missing field 'answer'"):
        load_qa_file(bad)
    bad.write_text('{"question": "q", "answer": "x"}\n')
    with pytest.raises(DatasetError, match=r"qa.jsonl:1: .*'id'"):
        load_qa_file(bad)
