"""Math with a sandboxed Python tool: GSM8K, MATH-500 and AIME 2024 ($TRACE_DATA_DIR/math).

The agent may call ``python(code)`` (run by ``trace_rl.sandbox.run_python``: a fresh
interpreter in its own namespaces per call, so nothing persists between calls; ``reset`` refuses to
start an episode where the machine cannot build that box, unless the limits opt out) and ends with
``<answer>…</answer>``. The reward is 1 when ``math_verify.verify(gold, prediction)`` holds (paper:
answers checked with math-verify), else 0.

Gold answers: GSM8K, the number after ``#### `` (thousands separators removed); MATH-500, the
``answer`` field; AIME, the integer ``answer``. Both sides are parsed by ``math_verify.parse``; a
gold answer is wrapped in ``\\boxed{}`` so its LaTeX is extracted whole; so is a prediction that
has no ``\\boxed`` or unescaped ``$`` of its own, falling back to math-verify's free-text extraction.

Ids: GSM8K rows have none, so an item's id is ``<file stem>:<n>`` with n the 1-based row number;
``trace score`` also accepts the bare row number. MATH-500 uses ``unique_id``, AIME ``id``.

The environment is stateless (each tool call is independent), so a restore needs only a fresh
state; the stored observations of a prefix are exactly what a replay would produce for
deterministic code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from math_verify import parse, verify

from trace_rl.envs.base import Action, Environment, TaskItem, ToolError, Verdict
from trace_rl.envs.datadir import default_data_dir
from trace_rl.envs.io import load_jsonl, row_field, split_path
from trace_rl.envs.prompt import system_prompt
from trace_rl.sandbox import SandboxLimits, require_sandbox, run_python

FAMILY = "math"
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_MATH_DELIM = re.compile(r"(?<!\\)\$")  # an unescaped $ (a "\\$" is a dollar sign)
_CALC = re.compile(r"<<([^=<>]+)=([^<>]*)>>")

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": ("Run Python 3 code in a sandbox and return what it prints (stdout; stderr "
                        "too when it fails). Each call is a fresh interpreter: nothing persists "
                        "between calls. numpy and sympy are installed; no network, no files "
                        "outside a temporary folder."),
        "parameters": {"type": "object",
                       "properties": {"code": {"type": "string",
                                               "description": "Python source; print the result."}},
                       "required": ["code"]},
    },
}

INSTRUCTIONS = ("Solve the math problem. You may run Python with the python tool. Put only the "
                "final answer (a number or a LaTeX expression) in <answer></answer>.")


def gsm8k_gold(solution: str) -> str:
    """The final number of a GSM8K solution (after ``#### ``), without thousands separators."""
    if "#### " not in solution:
        raise ValueError("field 'answer' has no '#### ' final-answer marker")
    return _THOUSANDS.sub("", solution.rsplit("#### ", 1)[1].strip())


def _gsm8k_row(stem: str) -> Callable[[dict[str, Any]], TaskItem]:
    counter = iter(range(1, 1 << 62))

    def parse_row(row: dict[str, Any]) -> TaskItem:
        n = next(counter)
        solution = row_field(row, "answer", str)
        return TaskItem(id=f"{stem}:{n}", family=FAMILY, question=row_field(row, "question", str),
                        gold=gsm8k_gold(solution),
                        meta={"source": "gsm8k", "row": n, "solution": solution})
    return parse_row


def _math500_row(row: dict[str, Any]) -> TaskItem:
    return TaskItem(id=row_field(row, "unique_id", str), family=FAMILY,
                    question=row_field(row, "problem", str), gold=row_field(row, "answer", str),
                    meta={"source": "math500", "subject": row_field(row, "subject", str),
                          "level": row_field(row, "level", int)})


def _aime_row(row: dict[str, Any]) -> TaskItem:
    answer = row_field(row, "answer", str)
    if not answer.strip().isdigit():
        raise ValueError(f"field 'answer' must be an integer string, got {answer!r}")
    return TaskItem(id=row_field(row, "id", str), family=FAMILY,
                    question=row_field(row, "problem", str), gold=answer.strip(),
                    meta={"source": "aime"})


SPLITS: dict[str, str] = {"train": "gsm8k_train.jsonl", "test": "gsm8k_test.jsonl",
                          "gsm8k_train": "gsm8k_train.jsonl", "gsm8k_test": "gsm8k_test.jsonl",
                          "math500": "math500_test.jsonl", "aime2024": "aime2024.jsonl"}
"""Split names -> files under ``<data_dir>/math``."""


def load_math_file(path: str | Path, limit: int | None = None) -> list[TaskItem]:
    """Items of one math data file; its kind is read from the first row's fields."""
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        first = fh.readline()
    if '"unique_id"' in first:
        return load_jsonl(path, _math500_row, limit)
    if '"problem"' in first:
        return load_jsonl(path, _aime_row, limit)
    return load_jsonl(path, _gsm8k_row(path.stem), limit)


def _parse_prediction(text: str, source: str) -> list[Any]:
    if source in ("gsm8k", "aime"):
        text = _THOUSANDS.sub("", text)
    # An <answer> holds the final answer alone: read it whole (boxed) unless it delimits its
    # own math, and fall back to free-text extraction ("The answer is 18.")
    if "\\boxed" not in text and not _MATH_DELIM.search(text):
        parsed = parse("\\boxed{" + text + "}")
        if parsed:
            return parsed
    return parse(text)


def grade(gold: str, answer: Any, source: str) -> Verdict:
    """math-verify's judgement of ``answer`` against ``gold``: reward 1 or 0."""
    if answer is None or not str(answer).strip():
        return Verdict(reward=0.0, metrics={"correct": 0.0, "parsed": 0.0})
    pred = _parse_prediction(str(answer).strip(), source)
    ok = bool(pred) and verify(parse("\\boxed{" + gold + "}"), pred)
    return Verdict(reward=float(ok), metrics={"correct": float(ok), "parsed": float(bool(pred))})


@dataclass(frozen=True)
class MathConfig:
    """How the math family runs."""

    data_dir: Path | None = None
    """Data root holding ``math/``; None: ``$TRACE_DATA_DIR`` or ``<repo>/../shared/data``."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    """Limits of each sandboxed ``python`` call."""
    max_turns: int = 6
    """Turn cap of one episode."""


class MathEnv(Environment):
    """GSM8K / MATH-500 / AIME with a sandboxed Python tool, graded by math-verify."""

    family = FAMILY
    stateful = False

    def __init__(self, config: MathConfig | None = None, **kwargs: Any):
        self.config = config or MathConfig(**kwargs)
        self.max_turns = self.config.max_turns
        self.data_dir = Path(self.config.data_dir or default_data_dir())

    def load(self, split: str, limit: int | None = None) -> list[TaskItem]:
        """A split name (``train``/``test`` are GSM8K; ``math500``, ``aime2024``) or a file path."""
        path = (self.data_dir / "math" / SPLITS[split] if split in SPLITS
                else split_path(FAMILY, split, SPLITS))
        return load_math_file(path, limit)

    def tools(self) -> list[dict[str, Any]]:
        return [PYTHON_TOOL]

    def system_prompt(self) -> str:
        return system_prompt(INSTRUCTIONS, self.tools())

    def reset(self, item: TaskItem) -> dict[str, Any]:
        # An episode may run model-written code: refuse it here, where the error ends the run,
        # not in call_tool, where it would become an observation. Loading and grading need no box.
        require_sandbox(self.config.limits)
        return {"item_id": item.id}

    def call_tool(self, state: Any, name: str, arguments: Mapping[str, Any]) -> str:
        if name != "python":
            raise ToolError(f"unknown tool {name!r}; available: python")
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("python needs a non-empty string argument 'code'")
        result = run_python(code, self.config.limits)
        parts = [result.stdout.rstrip()] if result.stdout.strip() else []
        if result.timed_out:
            parts.append(f"[timed out after {self.config.limits.wall_seconds:g} s]")
        elif result.returncode != 0:
            parts.append(result.stderr.rstrip() or f"[exit status {result.returncode}]")
        return "\n".join(parts) if parts else "[no output]"

    def verify(self, item: TaskItem, answer: Any) -> Verdict:
        return grade(str(item.gold), answer, item.meta.get("source", "math500"))

    def expert_actions(self, item: TaskItem) -> list[Action]:
        """GSM8K: re-run the solution's last calculator annotation in Python, then answer; the
        other sources carry no executable trace, so the expert answers directly."""
        actions = []
        calcs = _CALC.findall(str(item.meta.get("solution", "")))
        if calcs:
            actions.append(Action(kind="tool", tool="python",
                                  arguments={"code": f"print({calcs[-1][0]})"}))
        return actions + [Action(kind="answer", answer=str(item.gold))]
