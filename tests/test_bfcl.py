"""BFCL: the AST matcher by hand, gold calls = 1 and corrupted calls = 0 over every single-turn row,
irrelevance/relevance, multi-turn on bfcl-eval's backends (gold = 1 on all 200, corruptions = 0,
restore by replay equals the live state), schemas in OpenAI format, and the generic adapter.

The data is the full set when TRACE_DATA_DIR holds it, else the fixtures (tests/data_dirs.py);
the full files' sizes are checked where they are present (``full_data``)."""

from __future__ import annotations

import copy
import importlib.util
import json

import jsonschema
import pytest

from data_dirs import FULL_DATA
from trace_rl.envs.base import DatasetError, TaskItem, ToolError
from trace_rl.envs.bfcl import (CATEGORIES, IRRELEVANCE, SINGLE_TURN, Backends, BFCLEnv,
                                CallParseError, answer_contradictions, gold_calls,
                                grade_multi_turn, gt_call, load_bfcl_file, match_calls, openai_tool,
                                parse_calls, to_json_schema)
from trace_rl.envs.toolkit import ToolkitEnv
from trace_rl.rollout.types import Action, Verdict

needs_bfcl_eval = pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None,
                                     reason="bfcl-eval not installed: "
                                            "pip install --no-deps bfcl-eval==2026.3.23")

# Rows whose possible answer contradicts its own schema (no answer can pass, in BFCL either):
# a required parameter that may only be omitted, or an expected parameter the schema lacks.
CONTRADICTORY = {"live_multiple_507-149-4", "live_multiple_862-181-3", "live_multiple_964-207-0"}

DOC = {"name": "geo.area", "parameters": {"type": "dict", "required": ["base", "height"], "properties": {
    "base": {"type": "integer"}, "height": {"type": "float"}, "unit": {"type": "string"},
    "flags": {"type": "array", "items": {"type": "boolean"}},
    "opts": {"type": "dict", "properties": {"mode": {"type": "string"}, "k": {"type": "integer"}}}}}}


def _gt(**params):
    return [{"geo.area": params}]


def test_matcher_by_hand():
    gt = _gt(base=[10], height=[5.0], unit=["units", ""], flags=[[True, False], ""],
             opts=[{"mode": ["fast"], "k": [3, ""]}, ""])
    ok = lambda args, name="geo.area": match_calls([DOC], [{"name": name, "arguments": args}], gt)
    assert ok({"base": 10, "height": 5}) is None  # int accepted for float; optionals omitted
    assert ok({"base": 10, "height": 5.0, "unit": "Units "}) is None  # BFCL string standardising
    assert ok({"base": 10, "height": 5.0}, name="geo_area") is None  # dotted name, OpenAI spelling
    assert "wrong type" in ok({"base": 10.0, "height": 5.0})  # float is not an integer
    assert "wrong type" in ok({"base": True, "height": 5.0})  # nor is a bool
    assert "not among" in ok({"base": 11, "height": 5.0})
    assert "missing required" in ok({"base": 10})
    assert "unexpected parameter" in ok({"base": 10, "height": 5.0, "color": "red"})
    assert ok({"base": 10, "height": 5.0, "flags": [True, False]}) is None
    assert "not among" in ok({"base": 10, "height": 5.0, "flags": [False, True]})
    assert ok({"base": 10, "height": 5.0, "opts": {"mode": "FAST"}}) is None
    assert "not among" in ok({"base": 10, "height": 5.0, "opts": {"mode": "fast", "z": 1}})
    assert "unknown function" in ok({"base": 10, "height": 5.0}, name="area")
    # a parameter without "" among its values must be given
    assert "missing parameter 'unit'" in match_calls(
        [DOC], [{"name": "geo.area", "arguments": {"base": 10, "height": 5.0}}],
        _gt(base=[10], height=[5.0], unit=["units"]))


def test_parallel_calls_match_in_any_order_with_an_exact_matching():
    doc = {"name": "f", "parameters": {"type": "dict", "required": ["x"],
                                        "properties": {"x": {"type": "integer"}}}}
    gt = [{"f": {"x": [1, 2]}}, {"f": {"x": [1]}}]
    # BFCL's greedy pass gives call x=1 to the first expected call and then fails; a matching
    # exists (x=1 -> second, x=2 -> first)
    assert match_calls([doc], [{"name": "f", "arguments": {"x": 1}},
                               {"name": "f", "arguments": {"x": 2}}], gt) is None
    assert match_calls([doc], [{"name": "f", "arguments": {"x": 2}},
                               {"name": "f", "arguments": {"x": 2}}], gt) is not None
    assert "wrong number" in match_calls([doc], [{"name": "f", "arguments": {"x": 1}}], gt)


def test_parse_calls_forms():
    want = [{"name": "a.b", "arguments": {"x": 1, "y": "s"}}]
    assert parse_calls('[{"name": "a.b", "arguments": {"x": 1, "y": "s"}}]') == want
    assert parse_calls('{"name": "a.b", "arguments": "{\\"x\\": 1, \\"y\\": \\"s\\"}"}') == want
    assert parse_calls("[a.b(x=1, y='s')]") == want
    assert parse_calls("```json\n[]\n```") == [] and parse_calls("") == [] and parse_calls(None) == []
    for bad in ("I cannot help with that.", "[f(1)]", "[f(x=g())]", '[{"arguments": {}}]'):
        with pytest.raises(CallParseError):
            parse_calls(bad)


def test_schema_conversion():
    tool = openai_tool(DOC)
    params = tool["function"]["parameters"]
    assert tool["type"] == "function" and params["type"] == "object"
    assert params["properties"]["height"]["type"] == "number"
    assert params["properties"]["opts"]["type"] == "object"
    assert to_json_schema({"type": "any"}) == {}
    jsonschema.Draft202012Validator.check_schema(params)


def _corruptions(item: TaskItem) -> dict[str, list[dict]]:
    """Wrong value, wrong function, missing argument, wrong number: built from the possible
    answer alone (never from the matcher under test)."""
    calls = gold_calls(item.meta["functions"], item.gold)
    out: dict[str, list[dict]] = {}
    first, expected = calls[0], next(iter(item.gold[0].values()))
    for p, v in first["arguments"].items():
        opts = expected[p]
        if isinstance(v, bool):
            bad = None if (not v) in opts else (not v)
        elif isinstance(v, (int, float)):
            bad = v + 7919
        elif isinstance(v, str):
            bad = v + " qqq wrongval"
        elif isinstance(v, list):
            bad = v + ["zz extra item"]
        elif isinstance(v, dict):
            bad = {**v, "zz_unexpected_key": 1}
        else:  # None
            bad = "zz wrong"
        if bad is not None:
            c = copy.deepcopy(calls)
            c[0]["arguments"][p] = bad
            out["wrong value"] = c
            break
    c = copy.deepcopy(calls)
    c[0]["name"] += "_zzwrong"
    out["wrong function"] = c
    for p in first["arguments"]:
        if "" not in expected[p]:
            c = copy.deepcopy(calls)
            del c[0]["arguments"][p]
            out["missing argument"] = c
            break
    out["wrong number"] = calls[:-1] if len(calls) > 1 else calls + calls
    return out


@pytest.mark.parametrize("category", SINGLE_TURN)
def test_single_turn_gold_one_corrupted_zero_every_row(category):
    env = BFCLEnv()
    items = env.load(category)
    assert items and all(it.gold for it in items)
    contradictory = {it.id for it in items if answer_contradictions(it)}
    assert contradictory == {it.id for it in items if it.id in CONTRADICTORY}
    failures, counts = [], {}
    for it in items:
        gold_answer = env.expert_actions(it)[-1].answer
        reward = env.verify(it, gold_answer).reward
        if it.id in contradictory:
            assert reward == 0.0
            continue
        if reward != 1.0:
            failures.append((it.id, "gold"))
        # the same calls in BFCL's Python syntax grade the same
        py = "[" + ", ".join(f"{c['name']}(" + ", ".join(f"{k}={v!r}" for k, v in c["arguments"].items())
                             + ")" for c in json.loads(gold_answer)) + "]"
        if env.verify(it, py).reward != 1.0:
            failures.append((it.id, "gold as python"))
        for kind, calls in _corruptions(it).items():
            counts[kind] = counts.get(kind, 0) + 1
            if env.verify(it, calls).reward != 0.0:
                failures.append((it.id, kind))
    assert failures == []
    assert counts["wrong function"] == len(items) - len(contradictory)
    assert counts["wrong value"] >= 0.9 * counts["wrong function"]


@pytest.mark.parametrize("category", IRRELEVANCE)
def test_irrelevance_categories(category):
    env = BFCLEnv()
    items = env.load(category)
    assert items
    for it in items:
        gold = env.expert_actions(it)[-1].answer
        name = it.meta["functions"][0]["name"] if it.meta["functions"] else "some_function"
        some_call = [{"name": name, "arguments": {}}]
        assert env.verify(it, gold).reward == 1.0
        if category == "live_relevance":
            assert env.verify(it, "[]").reward == 0.0
            assert env.verify(it, "Sorry, I cannot do that.").reward == 0.0
        else:
            assert env.verify(it, some_call).reward == 0.0
            assert env.verify(it, "Sorry, none of these functions fit.").reward == 1.0


def test_every_item_schema_is_valid_json_schema_and_prompt_lists_it():
    env = BFCLEnv()
    schemas = {json.dumps(tool["function"]["parameters"], sort_keys=True)
               for category in SINGLE_TURN + IRRELEVANCE for it in env.load(category)
               for tool in env.item_tools(it)}
    assert len(schemas) > 1
    for text in schemas:  # each distinct converted schema once (~20 s for every copy)
        jsonschema.Draft202012Validator.check_schema(json.loads(text))
    it = env.load("simple_python", 1)[0]
    assert '"name":"calculate_triangle_area"' in env.user_prompt(it)
    with pytest.raises(ToolError, match="single-turn"):
        env.call_tool(env.reset(it), "calculate_triangle_area", {"base": 1, "height": 2})


@pytest.mark.full_data("bfcl")
def test_full_files():
    """The full categories' sizes, the contradictory rows among them, and the distinct schemas
    of every single-turn and irrelevance item (over 1000)."""
    env = BFCLEnv(data_dir=FULL_DATA)
    loaded = {c: env.load(c) for c in CATEGORIES}
    assert {c: len(items) for c, items in loaded.items()} == {
        "simple_python": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200,
        "live_simple": 258, "live_multiple": 1053, "live_parallel": 16,
        "live_parallel_multiple": 24, "irrelevance": 240, "live_irrelevance": 884,
        "live_relevance": 16, "multi_turn_base": 200}
    assert CONTRADICTORY <= {it.id for it in loaded["live_multiple"]}
    schemas = {json.dumps(tool["function"]["parameters"], sort_keys=True)
               for category in SINGLE_TURN + IRRELEVANCE for it in loaded[category]
               for tool in env.item_tools(it)}
    assert len(schemas) > 1000


def test_malformed_files_name_file_and_line(tmp_path):
    (tmp_path / "possible_answer").mkdir()
    q = tmp_path / "BFCL_v4_simple_python.json"
    q.write_text('{"id": "a", "question": [[{"role": "user", "content": "x"}]], "function": []}\n'
                 '{"id": "b", "question": [[{"role": "user", "content": "y"}]], "function": []}\n')
    (tmp_path / "possible_answer" / q.name).write_text('{"id": "a", "ground_truth": []}\n')
    with pytest.raises(DatasetError, match=r"BFCL_v4_simple_python.json:2: .*'b' has no possible answer"):
        load_bfcl_file(q)
    with pytest.raises(ValueError, match="unknown BFCL category"):
        load_bfcl_file(tmp_path / "BFCL_v4_nonsense.json")


# ---- multi-turn ----

def _gold_turns(it: TaskItem) -> list[list[dict]]:
    docs = {d["name"]: d for d in it.meta["functions"]}
    return [[gt_call(docs, s) for s in turn] for turn in it.gold]


def _outcome(it: TaskItem, turns) -> tuple:
    """Results and final public state of a call list, executed directly on fresh backends."""
    b = Backends.fresh(it)
    results = [b.execute(c["name"], c["arguments"]) for t in turns for c in t]
    return results, b.public_state()


@needs_bfcl_eval
def test_multi_turn_gold_one_corrupted_zero_all_rows():
    env = BFCLEnv()
    items = env.load("multi_turn_base")
    assert items
    changed_value = 0
    for it in items:
        turns = _gold_turns(it)
        assert grade_multi_turn(it, turns).reward == 1.0, it.id
        assert env.verify(it, json.dumps(turns)).reward == 1.0
        assert grade_multi_turn(it, turns[:-1]).reward == 0.0  # a user turn missing
        wrong_fn = copy.deepcopy(turns)
        wrong_fn[0][0]["name"] = "no_such_function"
        assert grade_multi_turn(it, wrong_fn).reward == 0.0
        emptied = copy.deepcopy(turns)
        emptied[-1] = []
        assert grade_multi_turn(it, emptied).reward == (0.0 if turns[-1] else 1.0)
        # a wrong value scores 0 wherever it changes what the calls do (BFCL grades by execution:
        # a wrong value that yields the same results and state is not an error there)
        wrong = copy.deepcopy(turns)
        call = next(c for t in wrong for c in t if any(isinstance(v, str) and v for v in c["arguments"].values())
                    ) if any(isinstance(v, str) and v for t in wrong for c in t
                             for v in c["arguments"].values()) else None
        if call is not None:
            key = next(k for k, v in call["arguments"].items() if isinstance(v, str) and v)
            call["arguments"][key] += "_zzwrong"
            if _outcome(it, wrong) != _outcome(it, turns):
                changed_value += 1
                assert grade_multi_turn(it, wrong).reward == 0.0, it.id
    assert changed_value >= 0.75 * len(items)  # 187 of the full file's 200


@needs_bfcl_eval
def test_multi_turn_live_episode_and_restore_by_replay():
    env = BFCLEnv()
    for it in env.load("multi_turn_base", limit=6)[::2]:
        actions = env.expert_actions(it)
        state = env.reset(it)
        snapshots, observations = [], []
        for a in actions:
            snapshots.append((state.backends.public_state(), state.turn, copy.deepcopy(state.calls)))
            step = env.step(state, a)
            observations.append(step.observation)
        assert step.done and observations[-1] is None
        assert env.verify_final(it, state, actions[-1].answer).reward == 1.0
        # user turns arrive as the observations of next_request
        asks = [o for a, o in zip(actions, observations) if a.tool == "next_request"]
        assert asks == [t[0]["content"] for t in it.meta["turns"][1:]]
        assert sum(a.kind == "answer" for a in actions) == 1
        for k in range(len(actions)):
            restored = env.restore(it, actions[:k], observations[:k])
            assert (restored.backends.public_state(), restored.turn, restored.calls) == snapshots[k]
            assert [env.step(restored, a).observation for a in actions[k:]] == observations[k:]
            assert env.verify_final(it, restored, None).reward == 1.0
        # an episode that answers before the last request fails
        last_ask = max(i for i, a in enumerate(actions) if a.tool == "next_request")
        short = env.restore(it, actions[:last_ask], observations[:last_ask])
        assert env.verify_final(it, short, "done").reward == 0.0
        assert env.call_tool(restored, "next_request", {}).startswith("All requests are done")


@needs_bfcl_eval
def test_multi_turn_tools_and_errors():
    env = BFCLEnv()
    it = next(i for i in env.load("multi_turn_base", limit=20) if i.meta.get("functions"))
    state = env.reset(it)
    names = {t["function"]["name"] for t in env.item_tools(it)}
    assert names == set(state.backends.methods) | {"next_request"}
    with pytest.raises(ToolError, match="unknown tool"):
        env.call_tool(state, "_load_scenario", {})
    name = sorted(state.backends.methods)[0]  # a backend method; a set's order varies by run
    out = env.call_tool(state, name, {"no_such_argument": 1})
    assert out.startswith("Error during execution")


# ---- generic adapter ----

def test_toolkit_env_adapter():
    tools = [{"type": "function", "function": {
        "name": "add_item", "description": "Add an item to the cart.",
        "parameters": {"type": "object", "required": ["item"], "additionalProperties": False,
                       "properties": {"item": {"type": "object", "required": ["sku", "qty"],
                                               "properties": {"sku": {"type": "string"},
                                                              "qty": {"type": "integer",
                                                                      "minimum": 1}}}}}}}]

    def add_item(item, state):
        state.setdefault("cart", []).append(item)
        return {"cart_size": len(state["cart"])}

    items = [TaskItem(id="t1", family="shop", question="Buy two apples.",
                      gold=[{"sku": "apple", "qty": 2}])]
    env = ToolkitEnv("shop", tools, {"add_item": add_item}, items,
                     grader=lambda it, ans: Verdict(float(ans == "ok")), instructions="Shop.")
    assert env.stateful and env.load("all") == items
    state = env.reset(items[0])
    assert env.call_tool(state, "add_item", {"item": {"sku": "apple", "qty": 2}}) == '{"cart_size": 1}'
    with pytest.raises(ToolError, match="item/qty"):
        env.call_tool(state, "add_item", {"item": {"sku": "apple", "qty": 0}})
    with pytest.raises(ToolError, match="unknown tool"):
        env.call_tool(state, "pay", {})
    actions = [Action(kind="tool", tool="add_item", arguments={"item": {"sku": "pear", "qty": 1}})]
    live = env.reset(items[0])
    obs = [env.step(live, a).observation for a in actions]
    assert env.restore(items[0], actions, obs)["cart"] == live["cart"]
    with pytest.raises(ValueError, match="no callable"):
        ToolkitEnv("shop", tools, {}, items, grader=lambda it, a: Verdict(0.0))


def test_category_list_is_complete():
    assert set(CATEGORIES) == set(SINGLE_TURN) | set(IRRELEVANCE) | {"multi_turn_base"}


# ---- every real family through the real ReAct loop, and continuation from a stored prefix ----

@needs_bfcl_eval
@pytest.mark.parametrize("family, split, index", [("bfcl", "multi_turn_base", 0),
                                                  ("hotpotqa", "dev", 1), ("math", "test", 0)])
def test_react_loop_and_continuation_from_stored_prefix(family, split, index):
    from scripted_engine import ScriptedEngine

    from trace_rl.envs.registry import make_env
    from trace_rl.policy.tiny import build_tokenizer
    from trace_rl.rollout.format import TurnFormat, render_action
    from trace_rl.rollout.react import Start, continue_from, run_episodes
    from trace_rl.rollout.types import SamplingSettings

    tok = build_tokenizer()
    env = make_env(family)
    item = env.load(split, limit=index + 1)[index]
    script = [render_action(a, thought="step") for a in env.expert_actions(item)]
    glue = TurnFormat(tok).glue.before_obs
    engine = ScriptedEngine(tok, lambda context, j: script[context.count(glue)])
    sampling = SamplingSettings(max_tokens=4096)
    live = run_episodes(engine, env, [Start(item)], sampling=sampling)[0]
    assert live.done and live.reward == 1.0 and len(live.turns) == len(script)
    for k in sorted({1, len(script) // 2, len(script) - 1}):  # first, middle and last prefix
        cont = continue_from(engine, env, item, live.turns[:k], 1, sampling=sampling)[0]
        assert cont.reward == 1.0
        assert [t.obs_text for t in cont.turns] == [t.obs_text for t in live.turns]
        assert cont.token_ids() == live.token_ids()
