"""Synthetic families: seeded splits, tools, verifiers, gold vs corrupted solutions, exact
continuation from stored prefixes (tokens and environment state), and dataset-file errors.

Episodes are driven through the real ReAct loop by ``ScriptedEngine`` (a test double that writes
chosen turns and tokenises them with the project's tiny tokenizer). The "follower" scripts read
each observation and build the next call from it, the way a correct agent would, so a corrupted
call (wrong value, wrong tool, missing argument) propagates to the final answer and its reward.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Callable

import pytest

from scripted_engine import ScriptedEngine
from trace_rl.envs.base import DatasetError, TaskItem, ToolError
from trace_rl.envs.registry import make_env
from trace_rl.envs.synth_arith.env import calculate
from trace_rl.envs.synthetic import check_arguments
from trace_rl.envs.synth_fncall.env import DOORS, FUNCTIONS, ROOMS
from trace_rl.rollout.format import TurnFormat, render_action
from trace_rl.rollout.react import (Start, continue_from, episode_from_json, episode_to_json,
                                    expert_episode, run_episodes)
from trace_rl.rollout.types import Action, SamplingSettings

FAMILIES = ("synth_lookup", "synth_arith", "synth_fncall")
SAMPLING = SamplingSettings(max_tokens=128)


@pytest.fixture(scope="module")
def tok():
    from trace_rl.policy.tiny import build_tokenizer

    return build_tokenizer()


def observations(context: str, fmt: TurnFormat) -> list[str]:
    """The tool observations in a decoded context, in order."""
    return [part.split(fmt.glue.after_obs)[0] for part in context.split(fmt.glue.before_obs)[1:]]


Policy = Callable[[TaskItem, list[str]], Action]
"""(item, observations so far) -> the next action."""


def engine_for(tok, items: list[TaskItem], policy: Policy) -> ScriptedEngine:
    fmt = TurnFormat(tok)
    by_question = {it.question: it for it in items}
    assert len(by_question) == len(items), "test items need distinct questions"

    def respond(context: str, j: int) -> str:
        item = next(it for q, it in by_question.items() if q in context)
        return render_action(policy(item, observations(context, fmt)), thought="go")

    return ScriptedEngine(tok, respond)


def replay_policy(env) -> Policy:
    """Plays the expert action sequence, ignoring observations."""
    return lambda item, obs: env.expert_actions(item)[len(obs)]


def lookup_follower(item: TaskItem, obs: list[str]) -> Action:
    """Searches the current entity, reads the next one from the facts, answers the last one."""
    path = re.match(r"Who is the (.*) of (\w+)\?", item.question)
    relations, entity = list(reversed(path.group(1).split(" of the "))), path.group(2)
    for rel, o in zip(relations, obs):
        found = re.search(rf"\b{rel} (\w+)", o) if not o.startswith(("Error", "No entry")) else None
        entity = found.group(1) if found else entity
    if len(obs) < len(relations):
        return Action(kind="tool", tool="search", arguments={"query": entity})
    return Action(kind="answer", answer=entity)


def arith_follower(item: TaskItem, obs: list[str]) -> Action:
    """Applies each step's operation to the last calculator result; answers the final one."""
    value = re.match(r"A box has (\d+)", item.question).group(1)
    for o in obs:
        value = o if re.fullmatch(r"-?[\d.]+", o) else value
    steps = item.meta["steps"]
    if len(obs) < len(steps):
        op_and_operand = steps[len(obs)].split(" ", 1)[1]
        return Action(kind="tool", tool="calculator", arguments={"expression": f"{value} {op_and_operand}"})
    return Action(kind="answer", answer=value)


FOLLOWERS: dict[str, Callable[[object], Policy]] = {
    "synth_lookup": lambda env: lookup_follower,
    "synth_arith": lambda env: arith_follower,
    "synth_fncall": replay_policy,  # graded on the state its calls leave, so no reading needed
}


def break_action(action: Action, how: str) -> Action:
    """``action`` with a wrong (but well-typed) value, the wrong tool, or a missing argument."""
    args = dict(action.arguments)
    key, value = next(iter(args.items()))  # query / expression / room / door / text
    if how == "wrong_value":
        args[key] = {"query": "Nobody", "expression": f"{value}9",
                     "room": next(r for r in ROOMS if r != value),
                     "door": next(d for d in DOORS if d != value)}.get(key, f"{value} later")
        return Action(kind="tool", tool=action.tool, arguments=args)
    if how == "wrong_tool":
        other = "set_volume" if action.tool != "set_volume" else "set_light"
        return Action(kind="tool", tool=other, arguments=args)
    assert how == "missing_arg"
    del args[key]
    return Action(kind="tool", tool=action.tool, arguments=args)


def corrupt_first_call(policy: Policy, how: str) -> Policy:
    """The same policy with its first tool call broken."""
    def broken(item: TaskItem, obs: list[str]) -> Action:
        action = policy(item, obs)
        return break_action(action, how) if not obs and action.kind == "tool" else action
    return broken


def distinct_items(env, n: int) -> list[TaskItem]:
    seen, out = set(), []
    for it in env.load("train"):
        if it.question not in seen:
            seen.add(it.question)
            out.append(it)
        if len(out) == n:
            return out
    raise AssertionError("not enough distinct items")


# ------------------------------------------------------------------------------------- splits
@pytest.mark.parametrize("family", FAMILIES)
def test_splits_are_seeded_disjoint_and_sized(family):
    env = make_env(family, difficulty=2, n_train=300, n_test=40)
    train, test = env.load("train"), env.load("test")
    assert len(train) == 300 and len(test) == 40
    assert train == make_env(family, difficulty=2, n_train=300, n_test=40).load("train")
    assert train != make_env(family, difficulty=2, seed=1, n_train=300).load("train")
    assert not {env.item_key(i) for i in train} & {env.item_key(i) for i in test}
    assert env.load("train", limit=5) == train[:5]
    assert len({i.id for i in train + test}) == 340
    assert all(json.loads(json.dumps(i.meta)) == i.meta for i in train[:20])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("difficulty", [1, 3, 5])
def test_difficulty_scales_solution_length(family, difficulty):
    env = make_env(family, difficulty=difficulty, n_train=30)
    for item in env.load("train"):
        actions = env.expert_actions(item)
        assert len(actions) == difficulty + 1 and actions[-1].kind == "answer"
        assert env.max_turns >= len(actions)


# ------------------------------------------------------------------------------ gold / corrupt
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("difficulty", [1, 2, 4])
def test_gold_solutions_score_one(tok, family, difficulty):
    env = make_env(family, difficulty=difficulty)
    items = distinct_items(env, 8)
    for item in items:
        ep = expert_episode(env, item, tok)
        assert ep.reward == 1.0 and not any(t.error for t in ep.turns), item.id
    eps = run_episodes(engine_for(tok, items, FOLLOWERS[family](env)), env,
                       [Start(it) for it in items], sampling=SAMPLING)
    assert [e.reward for e in eps] == [1.0] * len(items)
    assert all(len(e.turns) == difficulty + 1 for e in eps)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["wrong_value", "wrong_tool", "missing_arg"])
def test_corrupted_solutions_score_zero(tok, family, how):
    env = make_env(family, difficulty=2)
    items = distinct_items(env, 8)
    policy = corrupt_first_call(FOLLOWERS[family](env), how)
    eps = run_episodes(engine_for(tok, items, policy), env, [Start(it) for it in items],
                       sampling=SAMPLING)
    assert [e.reward for e in eps] == [0.0] * len(items)
    if how != "wrong_value":
        assert all(e.turns[0].error and e.turns[0].obs_text.startswith("Error: ToolError") for e in eps)


def test_wrong_final_answers_score_zero_and_normalisation():
    lookup = make_env("synth_lookup", difficulty=2)
    item = lookup.load("train", limit=1)[0]
    assert lookup.verify(item, f" {item.gold.lower()}. ").reward == 1.0
    assert lookup.verify(item, item.meta["chain"][0]).reward == 0.0
    arith = make_env("synth_arith", difficulty=2)
    item = arith.load("train", limit=1)[0]
    assert arith.verify(item, f" {item.gold} ").reward == 1.0
    assert arith.verify(item, str(item.gold + 1)).reward == 0.0
    assert arith.verify(item, "many").reward == 0.0
    fncall = make_env("synth_fncall", difficulty=2)
    item = fncall.load("train", limit=1)[0]
    assert fncall.verify_final(item, fncall.reset(item), "done").reward == 0.0
    with pytest.raises(TypeError, match="verify_final"):
        fncall.verify(item, "done")


# ------------------------------------------------------------------------------- continuation
@pytest.mark.parametrize("family", FAMILIES)
def test_continuation_reproduces_stored_prefix(tok, family):
    """Store gold episodes (through JSON), continue K=2 from every inner node: the engine is fed
    exactly the stored prefix tokens, the environment state equals the state reached by stepping
    the prefix afresh, and the continuation (same deterministic policy) finishes identically."""
    env = make_env(family, difficulty=3)
    items = distinct_items(env, 3)
    policy = FOLLOWERS[family](env)
    stored = [episode_from_json(json.loads(json.dumps(episode_to_json(e))))
              for e in run_episodes(engine_for(tok, items, policy), env, [Start(it) for it in items],
                                    sampling=SAMPLING)]
    for item, ep in zip(items, stored):
        for depth in range(1, len(ep.turns)):
            prefix = ep.turns[:depth]
            stepped = env.reset(item)
            for t in prefix:
                env.step(stepped, t.action)
            restored = env.restore(item, [t.action for t in prefix], [t.obs_text for t in prefix])
            assert restored == stepped
            engine = engine_for(tok, items, policy)
            cont = continue_from(engine, env, item, prefix, 2, sampling=SAMPLING)
            first = engine.requests[0]
            assert first.n == 2 and list(first.prompt_ids) == ep.token_ids(depth)
            for c in cont:
                assert c.prefix_turns == depth and c.turns[:depth] == prefix
                assert c.token_ids() == ep.token_ids() and c.reward == 1.0
                replays = depth if env.stateful else 0
                assert c.ledger.tool_calls == replays + len(ep.turns) - 1 - depth
            assert cont[0].turns[0] is not cont[1].turns[0]  # copies, not shared nodes


def test_fncall_continuation_diverges_after_prefix(tok):
    """Two continuations of one stateful prefix: a correct one and one that sets a wrong value.
    Both re-feed the same prefix; only the state their own calls leave decides the reward."""
    env = make_env("synth_fncall", difficulty=3)
    item = env.load("train", limit=1)[0]
    gold = expert_episode(env, item, tok)
    calls = env.expert_actions(item)
    fmt = TurnFormat(tok)

    def respond(context: str, j: int) -> str:
        n_obs = len(observations(context, fmt))
        action = calls[n_obs]
        if n_obs == 1 and j == 1:  # copy 1 breaks the first call after the prefix
            action = break_action(action, "wrong_value")
        return render_action(action, thought="go")

    engine = ScriptedEngine(tok, respond)
    good, bad = continue_from(engine, env, item, gold.turns[:1], 2, sampling=SAMPLING)
    assert good.token_ids(1) == bad.token_ids(1) == gold.token_ids(1)
    assert good.turns[1].gen_ids != bad.turns[1].gen_ids
    assert good.reward == 1.0 and bad.reward == 0.0


def test_failed_calls_leave_fncall_state_unchanged():
    env = make_env("synth_fncall", difficulty=5)
    item = env.load("train", limit=1)[0]
    state = env.reset(item)
    before = copy.deepcopy(state)
    for name, args in [("set_light", {"room": "kitchen"}), ("set_light", {"room": "attic", "on": True}),
                       ("set_temperature", {"room": "hall", "celsius": 40}),
                       ("set_volume", {"room": "hall", "level": True}),
                       ("lock_door", {"door": "front", "locked": True, "why": "x"}), ("fly", {})]:
        result = env.step(state, Action(kind="tool", tool=name, arguments=args))
        assert result.error and result.observation.startswith("Error: ToolError"), (name, args)
    assert state == before


# ------------------------------------------------------------------------------------ tools
@pytest.mark.parametrize("expr, out", [("2+3*4", "14"), ("7/2", "3.5"), ("2**10", "1024"),
                                       ("-(3)", "-3"), ("10 / 4 * 2", "5"), ("1/3", "0.333333"),
                                       ("17 // 5 + 17 % 5", "5")])
def test_calculator(expr, out):
    assert calculate(expr) == out


@pytest.mark.parametrize("expr, why", [("1/0", "division by zero"), ("2**1000", "exponent"),
                                       ("__import__('os')", "Call"), ("a+1", "Name"),
                                       ("1e300*1e300", "out of range"), ("(1", "cannot parse"),
                                       ("1+" * 150 + "1", "longer than"), ("True+1", "Constant"),
                                       ("[1][0]", "Subscript"), ("1e300**2", "out of range")])
def test_calculator_rejects(expr, why):
    with pytest.raises(ToolError, match=re.escape(why)):
        calculate(expr)


def test_check_arguments():
    light, temp = FUNCTIONS[0], FUNCTIONS[1]
    check_arguments(light, {"room": "kitchen", "on": False})
    with pytest.raises(ToolError, match="must be integer"):
        check_arguments(temp, {"room": "hall", "celsius": True})
    with pytest.raises(ToolError, match="must be integer"):
        check_arguments(temp, {"room": "hall", "celsius": 20.5})
    with pytest.raises(ToolError, match="must be boolean"):
        check_arguments(light, {"room": "hall", "on": 1})
    with pytest.raises(ToolError, match=r"outside \[16, 28\]"):
        check_arguments(temp, {"room": "hall", "celsius": 12})


def test_lookup_search_tool():
    env = make_env("synth_lookup", difficulty=2)
    item = env.load("train", limit=1)[0]
    state = env.reset(item)
    first = item.meta["chain"][0]
    obs = env.call_tool(state, "search", {"query": f"  {first.lower()} "})
    assert obs.startswith(f"{first}: ") and all(f"{r} {o}" in obs for r, o in item.meta["kb"][first].items())
    assert env.call_tool(state, "search", {"query": "Nobody"}) == "No entry for 'Nobody'."


# ---------------------------------------------------------------------------------- files
@pytest.mark.parametrize("family", FAMILIES)
def test_jsonl_roundtrip(tmp_path, family):
    env = make_env(family, difficulty=2)
    items = env.load("train", limit=5)
    path = env.save(tmp_path / "items.jsonl", items)
    assert env.load(str(path)) == items
    assert env.load(str(path), limit=2) == items[:2]


@pytest.mark.parametrize("line, why", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"id": "x", "family": "synth_arith", "gold": 3}', "missing field 'question'"),
    ('{"id": "x", "family": "synth_lookup", "question": "q", "gold": 3}', "family 'synth_lookup'"),
    ('{"id": "x", "family": "synth_arith", "question": "q", "gold": "3", "meta": {"steps": []}}',
     "gold must be a number"),
    ('{"id": "x", "family": "synth_arith", "question": "q", "gold": 3, "meta": {"steps": [1]}}',
     "meta.steps"),
])
def test_malformed_row_names_file_and_line(tmp_path, line, why):
    env = make_env("synth_arith", difficulty=1)
    path = env.save(tmp_path / "items.jsonl", env.load("train", limit=2))
    with path.open("a") as fh:
        fh.write("\n" + line + "\n")
    with pytest.raises(DatasetError, match=re.escape(why)) as err:
        env.load(str(path))
    assert err.value.path == str(path) and err.value.line == 4
    assert str(err.value).startswith(f"{path}:4: ")


def test_load_rejects_unknown_split():
    with pytest.raises(ValueError, match="split must be one of"):
        make_env("synth_arith").load("validation")


def test_row_field_and_load_jsonl_helpers(tmp_path):
    from trace_rl.envs.io import load_jsonl, row_field

    assert row_field({"n": 3}, "n", int) == 3 and row_field({}, "m", int, default=7) == 7
    with pytest.raises(ValueError, match="field 'n' must be an integer, got bool"):
        row_field({"n": True}, "n", int)
    with pytest.raises(ValueError, match="missing field 'n'"):
        row_field({"n": None}, "n", int)
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"b": 3}\n')
    assert load_jsonl(path, lambda r: r["a"], limit=2) == [1, 2]
    with pytest.raises(DatasetError, match=r"rows.jsonl:4: missing field 'a'"):
        load_jsonl(path, lambda r: r["a"])
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        load_jsonl(tmp_path / "absent.jsonl", dict)


def test_difficulty_mix_interleaves_items_of_each_difficulty():
    from trace_rl.envs.registry import make_env

    mixed = make_env("synth_arith", difficulty=3, mix=[1, 2, 3], n_train=9, n_test=6)
    items = mixed.load("train")
    assert [it.id.split("-")[1] for it in items] == ["d1", "d2", "d3"] * 3
    for d in (1, 2, 3):  # the same items, in the same order, as a plain run at that difficulty
        plain = make_env("synth_arith", difficulty=d, n_train=3).load("train")
        assert [it.id for it in items if it.id.split("-")[1] == f"d{d}"] == [it.id for it in plain]
    ops = [it.question.count(".") for it in items[:3]]
    assert ops[0] < ops[1] < ops[2]  # more operations told, more sentences
    assert mixed.load("test")[:3] == make_env("synth_arith", difficulty=3, mix=(1, 2, 3),
                                              n_test=3).load("test")
    with pytest.raises(ValueError, match=r"mix=\[1, 3\].*1\.\.difficulty=2"):
        make_env("synth_arith", difficulty=2, mix=[1, 3])


_PARSE_RACE = r"""
import gc, sys, threading, time
from trace_rl.envs.synth_arith.env import calculate


class Yield:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it

    def __del__(self):
        time.sleep(0)  # drops the GIL in the middle of whatever triggered the collection


gc.set_threshold(1)
errors = []


def work():
    for _ in range(3000):
        Yield()
        try:
            assert calculate("((2 + 5) * (3 - 1)) / (4 + 4) - 7 % 3") == "0.75"
        except SystemError as exc:
            errors.append(str(exc))


threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(errors), errors[:1])
"""


def test_calculator_calls_on_parallel_threads_never_fail_inside_the_parser():
    """The ReAct loop runs tool calls on threads. Unguarded, CPython 3.11's ast.parse raised
    'AST constructor recursion depth mismatch' here in every try (a collection that switches
    threads mid-parse); ``parse_expression`` serialises it. A fresh interpreter, because the race
    showed on the first parses of a process."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", _PARSE_RACE], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1], check=True)
    assert out.stdout.split()[0] == "0", out.stdout
