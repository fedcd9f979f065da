"""``synth_chain``: the generator (hop distribution, hazards fixed per item, Beta-spread hazard
rates, disjoint splits, a harder ``hard`` split), the search tool's aliases and homonyms, the
exact-match reward, the per-item turn cap, and continuation from stored prefixes through the real
ReAct loop (``ScriptedEngine`` writes the turns a reading agent would)."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Callable

import numpy as np
import pytest

from scripted_engine import ScriptedEngine
from trace_rl.config import TrainConfig, check_inputs
from trace_rl.envs.base import TaskItem
from trace_rl.envs.registry import make_env
from trace_rl.envs.synth_chain.env import ALIAS, HOMONYM, expert_thoughts, parse_hops
from trace_rl.rollout.format import TurnFormat, render_action
from trace_rl.rollout.react import (Start, continue_from, episode_from_json, episode_to_json,
                                    expert_episode, run_episodes)
from trace_rl.rollout.types import Action, SamplingSettings

SAMPLING = SamplingSettings(max_tokens=160)


@pytest.fixture(scope="module")
def tok():
    from trace_rl.policy.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def env():
    return make_env("synth_chain")


def observations(context: str, fmt: TurnFormat) -> list[str]:
    return [part.split(fmt.glue.after_obs)[0] for part in context.split(fmt.glue.before_obs)[1:]]


Pick = Callable[[TaskItem, int, int], int]
"""(item, hop, records returned) -> which record of a search to follow."""


def gold_pick(item: TaskItem, hop: int, n: int) -> int:
    return item.meta["copy"][hop]


def wrong_pick(item: TaskItem, hop: int, n: int) -> int:
    return 1 - item.meta["copy"][hop] if n == 2 else 0


def follower(pick: Pick) -> Callable[[TaskItem, list[str]], Action]:
    """Reads the question and each observation as an agent would: retries the name a failed
    search suggests, follows the hop's relation in the record ``pick`` chooses, answers at the
    end of the path."""
    def policy(item: TaskItem, obs: list[str]) -> Action:
        m = re.search(r"Start from (\S+) and follow (.*)\. Who do you reach\?", item.question)
        entity, path, hop = m.group(1), m.group(2).split(" > "), 0
        for o in obs:
            retry = re.search(r"Did you mean (\S+)\?", o)
            if retry:
                entity = retry.group(1)
                continue
            records = o.split(" | ")
            fact = re.search(rf"\b{path[hop]} ([\w-]+)", records[pick(item, hop, len(records))])
            entity = fact.group(1) if fact else entity  # a derailed chain may lack the relation
            hop += 1
        if hop < len(path):
            return Action(kind="tool", tool="search", arguments={"query": entity})
        return Action(kind="answer", answer=entity)
    return policy


def engine_for(tok, items: list[TaskItem], policy) -> ScriptedEngine:
    fmt = TurnFormat(tok)
    by_question = {it.question: it for it in items}
    assert len(by_question) == len(items)

    def respond(context: str, j: int) -> str:
        item = next(it for q, it in by_question.items() if q in context)
        return render_action(policy(item, observations(context, fmt)), thought="go")

    return ScriptedEngine(tok, respond)


def with_hazards(items: list[TaskItem], *kinds: str) -> list[TaskItem]:
    """Items with each of ``kinds`` among their hazards and at most two aliases (a third retry
    would pass the turn cap: ``follower`` retries every alias)."""
    return [it for it in items if all(k in it.meta["hazards"] for k in kinds)
            and it.meta["hazards"].count(ALIAS) <= 2]


# ------------------------------------------------------------------------------------ generator
def test_hop_distribution_follows_chain_hops(env):
    items = env.load("test") + env.load("train")
    share = Counter(it.meta["hops"] for it in items)
    n = len(items)
    for hops, p in {2: 0.35, 3: 0.40, 4: 0.25}.items():
        # 4 standard errors of a binomial share over n = 656 items: ~0.075 at p = 0.4
        assert abs(share[hops] / n - p) < 4 * np.sqrt(p * (1 - p) / n), (hops, share)
    assert set(share) == {2, 3, 4}
    assert {it.meta["hops"] for it in make_env("synth_chain", chain_hops="3:1").load("test")} == {3}
    assert parse_hops("2:1,5:3") == {2: 0.25, 5: 0.75}
    for bad in ("2", "2:x", "0:1", "2:-1", "2:1,2:1", "2:0"):
        with pytest.raises(ValueError, match="chain_hops"):
            make_env("synth_chain", chain_hops=bad)


def test_hazards_are_fixed_per_item_and_their_rate_spreads(env):
    train = env.load("train")
    again = make_env("synth_chain").load("train")
    assert [json.dumps(i.meta, sort_keys=True) for i in train] == \
        [json.dumps(i.meta, sort_keys=True) for i in again]  # the same hazards every epoch
    assert len(train) == 256 and len({i.id for i in train}) == 256
    rates = np.array([i.meta["rate"] for i in train + env.load("test")])
    # Beta(0.5, 1): mean 1/3; P(q < 0.05) = 0.05^0.5 = 0.22; P(q > 0.8) = 1 - 0.8^0.5 = 0.11
    assert abs(rates.mean() - 1 / 3) < 0.05
    assert (rates < 0.05).mean() > 0.12 and (rates > 0.8).mean() > 0.05
    hazards = [h for i in train for h in i.meta["hazards"]]
    counts = Counter(hazards)
    assert counts[ALIAS] > 30 and counts[HOMONYM] > 30
    assert abs(counts[ALIAS] / (counts[ALIAS] + counts[HOMONYM]) - 0.5) < 0.12
    # the hazard count tracks the drawn rate: items in the top rate quartile carry more per hop
    per_hop = np.array([sum(h != "" for h in i.meta["hazards"]) / i.meta["hops"] for i in train])
    q = np.array([i.meta["rate"] for i in train])
    assert per_hop[q > np.quantile(q, 0.75)].mean() > per_hop[q < np.quantile(q, 0.25)].mean() + 0.3
    only_alias = make_env("synth_chain", chain_alias_share=1.0).load("train", limit=100)
    assert HOMONYM not in {h for i in only_alias for h in i.meta["hazards"]}
    safe = make_env("synth_chain", chain_hazard_a=0.01, chain_hazard_b=50.0).load("train", limit=50)
    assert sum(h != "" for i in safe for h in i.meta["hazards"]) <= 2


def test_splits_are_disjoint_sized_and_the_hard_split_is_harder(env):
    splits = {s: env.load(s) for s in ("train", "test", "hard")}
    splits["sft"] = env.load("sft", limit=400)
    assert {s: len(v) for s, v in splits.items()} == {"train": 256, "test": 400, "hard": 400,
                                                      "sft": 400}
    keys = {s: {env.item_key(i) for i in v} for s, v in splits.items()}
    for a in keys:
        for b in keys:
            if a < b:
                assert not keys[a] & keys[b], (a, b)
    hard, test = splits["hard"], splits["test"]
    assert {i.meta["hops"] for i in hard} == {5}
    rate = lambda items: np.mean([sum(h != "" for h in i.meta["hazards"]) / i.meta["hops"]  # noqa: E731
                                  for i in items])
    assert rate(hard) > 1.25 * rate(test)
    homonym_free = lambda items: np.mean([HOMONYM not in i.meta["hazards"] for i in items])  # noqa: E731
    assert homonym_free(hard) < homonym_free(test) - 0.1
    assert make_env("synth_chain", chain_train_items=40).load("train") == splits["train"][:40]
    with pytest.raises(ValueError, match="split must be one of"):
        env.load("valid")


def test_difficulty_cues_are_in_the_question(env):
    for item in env.load("train", limit=60):
        m = item.meta
        assert " > ".join(m["path"]) in item.question  # the hops
        people = item.question.split(". Start")[0].removeprefix("People: ").split(", ")
        for hazard, surface, name in zip(m["hazards"], m["surface"], m["chain"]):
            if hazard == ALIAS:
                assert surface == f"{name[:2]}-{name[2:]}" and surface in people
            if hazard == HOMONYM:
                assert people.count(name) == 2  # listed twice
        assert item.question.count(f"Start from {m['surface'][0]} ") == 1


# ---------------------------------------------------------------------------------- tools, reward
def test_alias_fails_verbatim_and_homonym_returns_both_copies(env):
    items = env.load("train")
    alias = with_hazards(items, ALIAS)[0]
    hop = alias.meta["hazards"].index(ALIAS)
    surface, name = alias.meta["surface"][hop], alias.meta["chain"][hop]
    state = env.reset(alias)
    assert env.call_tool(state, "search", {"query": surface}) == \
        f"No entry for {surface}. Did you mean {name}?"
    assert env.call_tool(state, "search", {"query": f" {name.lower()} "}).startswith(f"{name}: ")
    assert env.call_tool(state, "search", {"query": "Nobody"}) == "No entry for Nobody."
    homonym = with_hazards(items, HOMONYM)[0]
    hop = homonym.meta["hazards"].index(HOMONYM)
    name = homonym.meta["chain"][hop]
    obs = env.call_tool(env.reset(homonym), "search", {"query": name})
    copies = obs.split(" | ")
    rel = homonym.meta["path"][hop]
    targets = [re.search(rf"\b{rel} ([\w-]+)", c).group(1) for c in copies]
    assert len(copies) == 2 and all(c.startswith(f"{name}: ") for c in copies)
    nxt = homonym.meta["surface"][hop + 1] if hop + 1 < homonym.meta["hops"] else homonym.meta["chain"][hop + 1]
    assert targets[homonym.meta["copy"][hop]] == nxt and targets[1 - homonym.meta["copy"][hop]] != nxt


def test_reward_is_exact_match_on_the_final_person(env):
    item = env.load("train", limit=1)[0]
    gold = item.gold
    assert env.verify(item, gold).reward == 1.0
    assert env.verify(item, f"  {gold.upper()}. ").reward == 1.0
    assert env.verify(item, f"{gold[:2]}-{gold[2:]}").reward == 0.0
    assert env.verify(item, item.meta["chain"][-2]).reward == 0.0
    assert env.verify(item, f"{gold} or {item.meta['chain'][0]}").reward == 0.0


def test_expert_solves_every_item_within_its_cap(tok, env):
    for split in ("train", "hard"):
        for item in env.load(split, limit=60):
            actions = env.expert_actions(item)
            ep = expert_episode(env, item, tok, thoughts=expert_thoughts(item, actions))
            assert ep.reward == 1.0, item.id
            assert len(ep.turns) <= env.turn_cap(item) == item.meta["hops"] + 3


def test_expert_thoughts_name_the_fact_each_search_follows(env):
    item = with_hazards(env.load("train"), ALIAS)[0]
    actions = env.expert_actions(item)
    thoughts = expert_thoughts(item, actions)
    # The first search copies the start the thought restates from the question.
    assert thoughts[0] == f"start {actions[0].arguments['query']}"
    assert f"Start from {actions[0].arguments['query']} and" in item.question
    for action, thought, prev in zip(actions[1:], thoughts[1:], actions):
        value = action.arguments["query"] if action.kind == "tool" else action.answer
        if prev.kind == "tool" and prev.arguments["query"] == f"{value[:2]}-{value[2:]}":
            assert thought == ""  # a retry
        else:
            assert thought.endswith(f" {value}") and thought.split()[0] in item.meta["path"]


def test_one_fact_per_record_keeps_the_hazards_and_the_default_items(tok, env):
    """``chain_facts=1``: each chain person's record lists only the relation followed there (a
    homonym's two copies that one relation to different people), so no relation is to be picked
    from the question; hazards, hops, caps and the expert are the family's; the default items
    are not changed by the option's existence."""
    one = make_env("synth_chain", chain_facts=1)
    items = one.load("train", limit=80) + one.load("hard", limit=20)
    for item in items:
        by_name: dict[str, list[dict]] = {}
        for rec in item.meta["records"]:
            by_name.setdefault(rec["name"], []).append(rec)
        for hop, (name, rel) in enumerate(zip(item.meta["chain"], item.meta["path"])):
            recs = by_name[name]
            assert all(list(r["facts"]) == [rel] for r in recs), (item.id, hop)
            assert len(recs) == (2 if item.meta["hazards"][hop] == HOMONYM else 1)
        actions = one.expert_actions(item)
        ep = expert_episode(one, item, tok, thoughts=expert_thoughts(item, actions))
        assert ep.reward == 1.0 and len(ep.turns) <= one.turn_cap(item), item.id
    hazards = Counter(h for i in items for h in i.meta["hazards"])
    assert hazards[ALIAS] > 10 and hazards[HOMONYM] > 10
    # other items than the default's, which stay as they were (two facts on every chain record)
    assert {i.question for i in items[:80]} != {i.question for i in env.load("train", limit=80)}
    assert all(len(r["facts"]) == 2 for i in env.load("train", limit=20)
               for r in i.meta["records"] if r["name"] in i.meta["chain"][:-1])
    assert make_env("synth_chain", chain_facts=2).load("train", limit=5) == env.load("train",
                                                                                   limit=5)


def test_one_syllable_names_are_one_token_each_and_keep_the_hazards(tok, env):
    """``chain_syllables=1``: the 16 capitalised syllables are the names, each a single token of
    the chain's ``split_names`` tokenizer wherever it stands; an alias is written "Ka-" and its
    verbatim search suggests "Ka"; the expert solves every item within its cap; the default
    items are not changed by the option's existence."""
    from trace_rl.envs.synth_chain.env import SYLLABLES, name_list
    from trace_rl.policy.bootstrap.data import tokenizer_texts
    from trace_rl.policy.tiny import build_tokenizer

    one = make_env("synth_chain", chain_syllables=1, chain_facts=1)
    items = one.load("train", limit=80) + one.load("hard", limit=20)
    assert sorted(name_list(1)) == sorted(s.capitalize() for s in SYLLABLES)
    assert {n for i in items for n in i.meta["chain"]} <= set(name_list(1))
    names_tok = build_tokenizer(tokenizer_texts(one, one.load("sft", limit=200)),
                                split_names=True)
    for name in name_list(1):
        for text in (f" {name} ", f'"{name}"', f"{name}:", f"{name}-"):
            pieces = [names_tok.decode([t]) for t in names_tok(text)["input_ids"]]
            assert pieces.count(name) == 1, (text, pieces)
    for item in items:
        actions = one.expert_actions(item)
        ep = expert_episode(one, item, tok, thoughts=expert_thoughts(item, actions))
        assert ep.reward == 1.0 and len(ep.turns) <= one.turn_cap(item), item.id
    aliased = next(i for i in items if ALIAS in i.meta["hazards"])
    hop = aliased.meta["hazards"].index(ALIAS)
    name = aliased.meta["chain"][hop]
    assert f"{name}-" in aliased.question
    state = one.reset(aliased)
    assert one.call_tool(state, "search", {"query": f"{name}-"}) == \
        f"No entry for {name}-. Did you mean {name}?"
    hazards = Counter(h for i in items for h in i.meta["hazards"])
    assert hazards[ALIAS] > 10 and hazards[HOMONYM] > 10
    assert make_env("synth_chain", chain_syllables=2).load("train", limit=5) == \
        env.load("train", limit=5)


# ---------------------------------------------------------------------------------- the loop
def test_the_wrong_homonym_copy_derails_silently(tok, env):
    items = with_hazards(env.load("train"), HOMONYM)[:4]
    gold = run_episodes(engine_for(tok, items, follower(gold_pick)), env,
                        [Start(it) for it in items], sampling=SAMPLING, max_turns=8)
    wrong = run_episodes(engine_for(tok, items, follower(wrong_pick)), env,
                         [Start(it) for it in items], sampling=SAMPLING, max_turns=8)
    assert [e.reward for e in gold] == [1.0] * 4
    assert [e.reward for e in wrong] == [0.0] * 4
    for ep in wrong:  # no error anywhere: the chain went on through plausible records
        assert not any(t.error for t in ep.turns) and ep.turns[-1].action.kind == "answer"


def test_each_item_keeps_its_own_turn_cap(tok, env):
    items = env.load("train", limit=6)
    stubborn = lambda item, obs: Action(kind="tool", tool="search",  # noqa: E731
                                        arguments={"query": item.meta["chain"][0]})
    eps = run_episodes(engine_for(tok, items, stubborn), env, [Start(it) for it in items],
                       sampling=SAMPLING, max_turns=20)
    assert [len(e.turns) for e in eps] == [it.meta["hops"] + 3 for it in items]
    assert all(e.reward == 0.0 and e.metrics == {"turn_cap": 1.0} for e in eps)
    short = run_episodes(engine_for(tok, items, stubborn), env, [Start(it) for it in items],
                         sampling=SAMPLING, max_turns=3)
    assert [len(e.turns) for e in short] == [3] * len(items)


def test_continuation_from_any_stored_prefix_equals_the_replay(tok, env):
    """Store whole episodes (through JSON), continue K=2 from every inner node: the engine is fed
    exactly the stored prefix, the restored state equals the state stepped afresh, and the
    continuation finishes as the original did."""
    pool = env.load("train")
    items = [with_hazards(pool, ALIAS)[0], with_hazards(pool, HOMONYM)[0],
             with_hazards(pool, ALIAS, HOMONYM)[0]]
    for pick, derails in ((gold_pick, False), (wrong_pick, True)):
        policy = follower(pick)
        stored = [episode_from_json(json.loads(json.dumps(episode_to_json(e))))
                  for e in run_episodes(engine_for(tok, items, policy), env,
                                        [Start(it) for it in items], sampling=SAMPLING, max_turns=8)]
        for item, ep in zip(items, stored):
            reward = 0.0 if derails and HOMONYM in item.meta["hazards"] else 1.0
            assert ep.reward == reward
            for depth in range(1, len(ep.turns)):
                prefix = ep.turns[:depth]
                stepped = env.reset(item)
                for t in prefix:
                    env.step(stepped, t.action)
                assert env.restore(item, [t.action for t in prefix], [t.obs_text for t in prefix]) == stepped
                engine = engine_for(tok, items, policy)
                cont = continue_from(engine, env, item, prefix, 2, sampling=SAMPLING, max_turns=8)
                assert engine.requests[0].n == 2 and list(engine.requests[0].prompt_ids) == ep.token_ids(depth)
                for c in cont:
                    assert c.turns[:depth] == prefix and c.token_ids() == ep.token_ids()
                    assert c.reward == reward
                    assert [t.obs_text for t in c.turns] == [t.obs_text for t in ep.turns]


# ---------------------------------------------------------------------------------- config
def test_chain_options_reach_the_family_and_are_checked():
    cfg = TrainConfig(family="synth_chain", max_turns=7, chain_hops="2:1", chain_train_items=40)
    assert cfg.family_options() == {"chain_hops": "2:1", "chain_hazard_a": 0.5,
                                    "chain_hazard_b": 1.0, "chain_alias_share": 0.5,
                                    "chain_train_items": 40, "chain_facts": 2,
                                    "chain_syllables": 2}
    check_inputs(cfg)
    env = make_env(cfg.family, **cfg.env_kwargs())
    assert len(env.load("train")) == 40 and {i.meta["hops"] for i in env.load("train")} == {2}
    with pytest.raises(ValueError, match=r"max_turns=4 .* set max_turns=7"):
        check_inputs(TrainConfig(family="synth_chain"))
    with pytest.raises(ValueError, match="chain_alias_share"):
        TrainConfig(family="synth_chain", chain_alias_share=1.5)
    with pytest.raises(ValueError, match="chain_facts"):
        TrainConfig(family="synth_chain", chain_facts=3)
    with pytest.raises(ValueError, match="chain_facts"):
        make_env("synth_chain", chain_facts=0)
    with pytest.raises(ValueError, match="chain_syllables"):
        TrainConfig(family="synth_chain", chain_syllables=3)
    with pytest.raises(ValueError, match="chain_syllables"):
        make_env("synth_chain", chain_syllables=0)
    with pytest.raises(ValueError, match="chain_hops"):
        check_inputs(TrainConfig(family="synth_chain", chain_hops="x", max_turns=7))
    # the options enter the run id only when set; another family drops them at their defaults
    # (the flat form lists them for every family) and refuses them set
    base, chain = TrainConfig(), TrainConfig(family="synth_chain")
    assert TrainConfig(family="synth_chain", chain_hops="2:1").config_hash != chain.config_hash
    assert TrainConfig(root_posterior=4.0).config_hash != base.config_hash
    assert TrainConfig(chain_hops=chain.chain_hops) == base
    with pytest.raises(ValueError, match="chain_hops='2:1' is an option of family synth_chain"):
        TrainConfig(chain_hops="2:1")
    assert base.family_options() == {} and "chain_hops" not in base.env_kwargs()
    assert "chain_hops" not in base.model_dump() and not hasattr(base, "chain_hops")
    assert TrainConfig.model_validate(cfg.model_dump()) == cfg
    assert cfg == TrainConfig(family="synth_chain", max_turns=7,
                              synth_chain={"chain_hops": "2:1", "chain_train_items": 40})


def test_oracle_success_is_what_an_agent_that_cannot_tell_homonyms_apart_achieves(tok, env):
    """An agent that reads every record right but picks a homonym's copy at random (seeded by
    its context) succeeds on each item with probability ``oracle_success``: over 150 items the
    mean success matches the mean oracle within sampling error."""
    import random

    items = env.load("test", limit=150)
    oracle = np.array([env.oracle_success(it) for it in items])
    assert set(np.round(oracle, 4)) <= {0.0, 1.0, 0.5, 0.25, 0.125, 0.0625}
    for it, o in zip(items, oracle):
        hz = it.meta["hazards"]
        assert o == (0.5 ** hz.count(HOMONYM) if hz.count(ALIAS) <= 2 else 0.0)
    fmt = TurnFormat(tok)
    by_question = {it.question: it for it in items}

    def respond(context: str, j: int) -> str:
        item = next(it for q, it in by_question.items() if q in context)
        coin = random.Random(context).randrange
        return render_action(follower(lambda it, hop, n: coin(n))(item, observations(context, fmt)))

    eps = run_episodes(ScriptedEngine(tok, respond), env, [Start(it) for it in items],
                       sampling=SAMPLING, max_turns=8)
    won = np.array([e.reward for e in eps])
    assert np.all(won[oracle == 1.0] == 1.0) and np.all(won[oracle == 0.0] == 0.0)
    se = np.sqrt(np.sum(oracle * (1 - oracle))) / len(items)
    assert abs(won.mean() - oracle.mean()) < 4 * se + 1e-9, (won.mean(), oracle.mean())


def test_chain_tokens_sorts_every_name_slot_of_an_expert_trace(env):
    """studies.chain_tokens: on the bootstrap's tokenizer every name the expert writes is found in
    its slot (two syllable tokens each; an alias's hyphen is not a name token)."""
    from studies.chain_tokens import expert_tokens, token_kinds
    from trace_rl.policy.bootstrap import _tokenizer_texts, episode_example
    from trace_rl.policy.tiny import build_tokenizer

    items = with_hazards(env.load("train"), ALIAS)[:6] + env.load("train", limit=6)
    tok = build_tokenizer(_tokenizer_texts(env, items), vocab_size=600, split_names=True)
    for item in items:
        actions = env.expert_actions(item)
        ex = episode_example(expert_episode(env, item, tok,
                                            thoughts=expert_thoughts(item, actions)))
        pieces = [tok.decode([t]) for t in ex.token_ids]
        kinds = Counter(token_kinds(pieces, ex.loss_mask, {r["name"] for r in
                                                           item.meta["records"]}))
        searches = sum(a.kind == "tool" for a in actions)
        assert kinds["name@think-start"] == 2 and kinds["name@answer"] == 2
        assert kinds["name@query"] == 2 * searches
        assert kinds["relation@think"] == item.meta["hops"] == kinds["name@think-hop"] // 2
        assert sum(n for k, n in kinds.items() if k) == sum(ex.loss_mask)
    # The shared rendering the benches score: the expert's own thoughts list no relation after
    # the one a thought opens with, so none is relation@rest.
    for item, (ids, kinds) in zip(items, expert_tokens(env, items, tok)):
        counts = Counter(kinds)
        assert counts["relation@rest"] == 0 and counts["relation@think"] == item.meta["hops"]


def test_rest_of_path_thoughts_list_the_relations_still_to_follow(env):
    """studies.chain_sft's ``rest`` variant: each hop's thought is the expert's, then the relations
    after it ("follow b > c"); the last names no more; a retry still thinks nothing; the trace
    still solves its item."""
    from studies.chain_sft import rest_of_path_thoughts
    from trace_rl.policy.tiny import build_tokenizer

    tok = build_tokenizer()
    items = with_hazards(env.load("train"), ALIAS)[:4] + env.load("train", limit=4)
    for item in items:
        actions = env.expert_actions(item)
        plain, rest = expert_thoughts(item, actions), rest_of_path_thoughts(item, actions)
        path = item.meta["path"]
        hops = [t for t in rest if t]
        assert [t for t in plain if not t] == [t for t in rest if not t]
        assert hops[0] == f"{plain[0]} follow {' > '.join(path)}"
        assert hops[-1] == plain[-1] == f"{path[-1]} {item.gold}"
        for k, thought in enumerate(hops[1:-1], start=1):
            assert thought.endswith(f" follow {' > '.join(path[k:])}"), (k, thought)
        assert expert_episode(env, item, tok, thoughts=rest).reward == 1.0


@pytest.mark.parametrize("joined", [False, True])
def test_numbered_variant_numbers_the_path_and_each_hops_thought(env, joined):
    """studies.chain_sft's ``numbered`` variant: the question lists "1 r1, 2 r2, ..." in place of
    "r1 > r2 > ...", each hop's thought is its number then the expert's thought, the start and
    retries are unchanged, and the trace still solves its item; ``numbered-joined`` writes no
    space after the number ("1r1", "1r1 Name")."""
    from studies.chain_sft import THOUGHT_VARIANTS, numbered_question
    from trace_rl.policy.tiny import build_tokenizer

    tok = build_tokenizer()
    sep = "" if joined else " "
    numbered_thoughts = THOUGHT_VARIANTS["numbered-joined" if joined else "numbered"]
    items = with_hazards(env.load("train"), ALIAS)[:4] + env.load("train", limit=4)
    for item in items:
        numbered = numbered_question(item, joined)
        path = item.meta["path"]
        listed = ", ".join(f"{k}{sep}{r}" for k, r in enumerate(path, 1))
        assert f"follow {listed}." in numbered.question and " > " not in numbered.question
        assert numbered.question.split("follow")[0] == item.question.split("follow")[0]
        actions = env.expert_actions(numbered)
        plain, thoughts = expert_thoughts(item, actions), numbered_thoughts(numbered, actions)
        hops = [t for t in plain if t and not t.startswith("start ")]
        assert [t for t in thoughts if t and not t.startswith("start ")] == \
            [f"{k}{sep}{t}" for k, t in enumerate(hops, 1)]
        assert [t for t in thoughts if not t or t.startswith("start ")] == \
            [t for t in plain if not t or t.startswith("start ")]
        assert len(hops) == item.meta["hops"]
        assert expert_episode(env, numbered, tok, thoughts=thoughts).reward == 1.0
    with pytest.raises(ValueError, match="does not list its path"):
        numbered_question(numbered, joined)  # already numbered


@pytest.mark.slow  # SFT of a small model, then a copy warm-up (2.4 s here, 9 s at load 7)
def test_chain_sft_measures_each_kind_and_the_copy_warmup_learns_to_copy(tmp_path):
    """studies.chain_sft end to end on the test preset (a few steps), and its copy warm-up: a
    small model learns to write a random sequence again (loss on the copy falls far below the
    chance level of the token pool)."""
    import math

    from studies.chain_sft import copy_warmup, run
    from studies.chain_tokens import FIRST_KINDS, KINDS, expert_tokens, measure, score
    from trace_rl.policy.tiny import build_model, build_tokenizer

    out = tmp_path / "rows.jsonl"
    rows = run(steps=2, every=1, copy_steps=1, thoughts="rest", items=2, sft_examples=24,
               preset="test", save=str(tmp_path / "policy"), out=str(out))
    assert [r["sft_step"] for r in rows] == [0, 1, 2]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert {"name@query", "relation@think", "relation@rest", "other"} <= set(rows[-1]["accuracy"])
    assert rows[-1]["loss"] > 0
    # studies.chain_tokens reads the saved policy along the family's own expert traces.
    read = measure(str(tmp_path / "policy"), items=2)
    assert {"name@query", "name@query/first", "relation@think", "other"} <= set(read) <= \
        set(KINDS + FIRST_KINDS)
    assert 0 < read["name@query/first"]["tokens"] < read["name@query"]["tokens"]
    # one first token per name (a hyphenated name's second syllable continues it): as many as
    # the queries of those traces
    env = make_env("synth_chain")
    items = with_hazards(env.load("test"), ALIAS)[:2]
    split = build_tokenizer(split_names=True)
    queries = sum(a.kind == "tool" for it in items for a in env.expert_actions(it))
    first = score(build_model(split, "test", seed=0), expert_tokens(env, items, split))
    assert first["name@query/first"]["tokens"] == queries
    assert all(r["tokens"] > 0 and r["nll"] > 0 and 0 <= r["accuracy"] <= 1 for r in read.values())

    model = build_model(build_tokenizer(), "test", seed=0)
    losses = copy_warmup(model, pool=list(range(40, 48)), steps=150, length=8, batch=16,
                         lr=1e-2)
    assert losses[0] > 0.8 * math.log(8) and min(losses[-10:]) < 0.2 * math.log(8), losses[::15]


def test_copy_warmup_gap_moves_the_second_copy():
    """``--copy-gap``: the distance between the copies varies from row to row (so no head at a
    fixed offset can copy), every row has the same length, and only the second copy after its
    first token is labelled."""
    import random

    from studies.chain_sft import copy_row
    from trace_rl.policy.sft import IGNORE_INDEX

    rng = random.Random(0)
    offsets = set()
    for _ in range(200):
        row, labels = copy_row(rng, pool=list(range(40, 48)), length=6, gap=5)
        assert len(row) == len(labels) == 17
        labelled = [i for i, y in enumerate(labels) if y != IGNORE_INDEX]
        start = labelled[0] - 1  # where the second copy begins
        assert labelled == list(range(start + 1, start + 6))
        assert row[start:start + 6] == row[:6]
        assert [labels[i] for i in labelled] == row[start + 1:start + 6]
        offsets.add(start)
    assert offsets == set(range(6, 12))
    row, labels = copy_row(random.Random(1), list(range(40, 48)), length=6, gap=0)
    assert row[:6] == row[6:] and labels[:7] == [IGNORE_INDEX] * 7 and labels[7:] == row[7:]
