"""What a task family shows the policy: its instructions, the turn format's tags, and its tools'
schemas, as one system message (``system_prompt``). The turn format itself (parsing a turn,
rendering an action, the chat template's glue) is ``trace_rl.rollout.format``'s, which reads the
tags from here: environments sit below the ReAct loop that drives them and import nothing of it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

FORMAT_HELP = ('Each turn: <think>reasoning</think> then either '
               '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call> '
               'or <answer>final answer</answer>.')


def system_prompt(instructions: str, tools: Sequence[Mapping[str, Any]]) -> str:
    """A family's system message: its instructions, the turn format, and each tool's schema as one
    line of compact JSON (``tools`` in the OpenAI ``{"type": "function", "function": …}`` form)."""
    lines = [instructions.strip(), FORMAT_HELP, "Tools:"]
    lines += [json.dumps(t.get("function", t), separators=(",", ":"), ensure_ascii=False)
              for t in tools]
    return "\n".join(lines)
