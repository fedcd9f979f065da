"""The turn format: how a policy turn is written, parsed, and how a conversation becomes tokens.

One policy turn is ``<think>…</think>`` followed by exactly one action,
``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` or ``<answer>…</answer>``; generation
stops at ``</tool_call>`` or ``</answer>`` (``STOP``). ``parse_action`` turns a turn's text into an
``Action``; anything it cannot read becomes ``Action(kind="invalid", error=...)`` so the loop can
answer with an error observation instead of crashing.

Token layout (see ``trace_rl.rollout.types``): the prompt is the chat template applied to
(system, user) with the generation prompt; every observation is wrapped in the *glue* that closes
the assistant message, opens and closes a tool message, and opens the next assistant message,
tokenised on its own. The glue is derived once per tokenizer by rendering the template on
sentinel messages and diffing the strings. This assumes the template is *prefix-stable*: rendering
a longer conversation only appends to the rendering of a shorter one, and assistant content is
copied verbatim. ``TurnFormat`` checks that on a two-turn sentinel conversation and, when it does
not hold (or the tokenizer has no template, or the template rejects the roles), falls back to a
plain format, ``{system}\\n\\nQuestion: {user}\\n`` with ``\\nObservation: {obs}\\n`` glue.

Departures: the paper does not fix a turn format; this one is Qwen3's tool-call tags. Tool schemas
go into the system message as compact JSON (not the template's own ``tools=`` rendering) so every
tokenizer sees the same instructions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from trace_rl.envs.prompt import (ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, TOOL_CLOSE,
                                  TOOL_OPEN)
from trace_rl.rollout.types import Action

STOP: tuple[str, ...] = (TOOL_CLOSE, ANSWER_CLOSE)
"""Stop strings that end a policy turn; the engine keeps them in the text and tokens."""


def _invalid(why: str) -> Action:
    return Action(kind="invalid", error=f"invalid action: {why}")


def parse_action(text: str) -> Action:
    """Parse one policy turn. An optional leading ``<think>…</think>`` is skipped; the first
    ``<tool_call>`` or ``<answer>`` after it is the action; text after its closing tag is ignored."""
    pos = 0
    think = text.find(THINK_OPEN)
    first_action = min((i for i in (text.find(TOOL_OPEN), text.find(ANSWER_OPEN)) if i >= 0),
                       default=-1)
    if think >= 0 and (first_action < 0 or think < first_action):
        close = text.find(THINK_CLOSE, think)
        if close < 0:
            return _invalid(f"{THINK_OPEN} is never closed with {THINK_CLOSE}")
        pos = close + len(THINK_CLOSE)
    tool_at, answer_at = text.find(TOOL_OPEN, pos), text.find(ANSWER_OPEN, pos)
    if tool_at < 0 and answer_at < 0:
        return _invalid(f"no {TOOL_OPEN} or {ANSWER_OPEN} found")
    if answer_at >= 0 and (tool_at < 0 or answer_at < tool_at):
        end = text.find(ANSWER_CLOSE, answer_at)
        if end < 0:
            return _invalid(f"{ANSWER_OPEN} is never closed with {ANSWER_CLOSE}")
        return Action(kind="answer", answer=text[answer_at + len(ANSWER_OPEN):end].strip())
    end = text.find(TOOL_CLOSE, tool_at)
    if end < 0:
        return _invalid(f"{TOOL_OPEN} is never closed with {TOOL_CLOSE}")
    body = text[tool_at + len(TOOL_OPEN):end].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return _invalid(f"tool call is not valid JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(call, dict):
        return _invalid(f"tool call must be a JSON object, got {type(call).__name__}")
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        return _invalid(f"tool call has unexpected keys {extra}; only 'name' and 'arguments'")
    name, arguments = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name:
        return _invalid("tool call needs a non-empty string 'name'")
    if not isinstance(arguments, dict):
        return _invalid(f"tool call 'arguments' must be an object, got {type(arguments).__name__}")
    return Action(kind="tool", tool=name, arguments=arguments)


def render_action(action: Action, thought: str = "") -> str:
    """The turn text for ``action`` (used for expert traces); ``parse_action`` inverts it."""
    head = f"{THINK_OPEN}{thought}{THINK_CLOSE}\n"
    if action.kind == "tool":
        call = {"name": action.tool, "arguments": dict(action.arguments or {})}
        return f"{head}{TOOL_OPEN}{json.dumps(call, ensure_ascii=False)}{TOOL_CLOSE}"
    if action.kind == "answer":
        return f"{head}{ANSWER_OPEN}{action.answer}{ANSWER_CLOSE}"
    raise ValueError(f"render_action: cannot render an {action.kind!r} action ({action.error})")


@dataclass(frozen=True)
class Glue:
    """Literal text around one tool observation in the rendered conversation."""

    before_obs: str
    """Closes the assistant message and opens the tool message."""
    after_obs: str
    """Closes the tool message and opens the next assistant message (the generation prompt)."""


PLAIN_GLUE = Glue(before_obs="\nObservation: ", after_obs="\n")
_SENT_A = ("SENTINELASSISTANTONE", "SENTINELASSISTANTTWO")
_SENT_O = ("SENTINELOBSERVATIONONE", "SENTINELOBSERVATIONTWO")
_SENT_SYS, _SENT_USER = "SENTINELSYSTEM", "SENTINELUSER"


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def derive_glue(tokenizer: Any, tool_role: str = "tool") -> Glue | None:
    """The observation glue of ``tokenizer``'s chat template, or None when it has no template, the
    template rejects the messages, or it is not prefix-stable on a two-turn sentinel conversation."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    head = [{"role": "system", "content": _SENT_SYS}, {"role": "user", "content": _SENT_USER}]
    turns = []
    for a, o in zip(_SENT_A, _SENT_O):
        turns += [{"role": "assistant", "content": a}, {"role": tool_role, "content": o}]
    try:
        s0 = _render(tokenizer, head)
        s1 = _render(tokenizer, head + turns[:2])
        s2 = _render(tokenizer, head + turns)
    except Exception:  # templates raise on roles they do not know; the plain format still works
        return None
    if not s1.startswith(s0 + _SENT_A[0]):
        return None
    glue = s1[len(s0) + len(_SENT_A[0]):]
    if glue.count(_SENT_O[0]) != 1:
        return None
    before, after = glue.split(_SENT_O[0])
    expected_s2 = s1 + _SENT_A[1] + before + _SENT_O[1] + after
    return Glue(before, after) if s2 == expected_s2 else None


class TurnFormat:
    """Token ids of prompts and observations for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        glue = derive_glue(tokenizer)
        self.templated = glue is not None
        """True when the model's chat template is used; False for the plain fallback."""
        self.glue = glue or PLAIN_GLUE

    def _encode(self, text: str) -> list[int]:
        # Special tokens are already spelled out in the rendered text; adding BOS again would
        # break the exact-prefix layout.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_text(self, system: str, user: str) -> str:
        if self.templated:
            return _render(self.tokenizer, [{"role": "system", "content": system},
                                            {"role": "user", "content": user}])
        bos = getattr(self.tokenizer, "bos_token", None) or ""
        return f"{bos}{system}\n\nQuestion: {user}\n"

    def prompt_ids(self, system: str, user: str) -> list[int]:
        """Tokens of the rendered (system, user) conversation ending in the generation prompt."""
        return self._encode(self.prompt_text(system, user))

    def obs_text(self, observation: str, gen_ids: Sequence[int] = ()) -> str:
        before = self.glue.before_obs
        eos = getattr(self.tokenizer, "eos_token", None)
        # A turn that ended on EOS (no stop string) has already closed its message: a template
        # whose glue starts with that EOS would otherwise repeat it.
        if gen_ids and eos and gen_ids[-1] == self.tokenizer.eos_token_id and before.startswith(eos):
            before = before[len(eos):]
        return f"{before}{observation}{self.glue.after_obs}"

    def obs_ids(self, observation: str, gen_ids: Sequence[int] = ()) -> list[int]:
        """Tokens of the glue + ``observation``, to append right after a turn whose generated
        tokens are ``gen_ids`` (only their last token matters: see ``obs_text``)."""
        return self._encode(self.obs_text(observation, gen_ids))

    def turn_ids(self, text: str) -> list[int]:
        """Tokens of a turn written by hand (expert traces only; sampled turns keep the engine's
        own token ids and are never re-tokenised)."""
        return self._encode(text)
