"""``synth_arith``: arithmetic word problems solved step by step with a ``calculator`` tool.

A quantity starts at a value and goes through d operations told in words ("5 more are added",
"the count is doubled", "it is shared equally by 3 and one share is kept"). The expert calls the
calculator once per operation on the running value and answers the last result, so an episode has
d + 1 turns. The calculator evaluates +, -, *, /, //, %, ** and parentheses by walking the ``ast``
of the expression (no ``eval``), with limits on length, exponent and magnitude.

Difficulty d (1..5): d operations; operands up to ``10 * d``. Reward: the answer parses as a
number equal to the gold value.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any, Callable, Mapping, Sequence

from trace_rl.envs.base import Action, TaskItem, ToolError, Verdict, parse_expression
from trace_rl.envs.synthetic import SynthConfig, SyntheticEnv, check_arguments, function_tool, need

CALCULATOR = function_tool("calculator", "Evaluate an arithmetic expression.",
                           {"expression": {"type": "string"}})
NOUNS = ("apples", "coins", "books", "marbles", "stamps", "shells")
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15
MAX_EXPONENT = 64

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            value = _BINOPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError(f"result out of range (|x| > {MAX_MAGNITUDE:g})") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ToolError(f"result out of range (|x| > {MAX_MAGNITUDE:g} or complex)")
        return value
    raise ToolError(f"unsupported expression element {type(node).__name__}; "
                    "use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """Evaluate ``expression`` safely and format the result (integers without a decimal point,
    other values to at most 6 decimals). Raises ``ToolError`` on anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = parse_expression(expression.strip())
    except SyntaxError as exc:
        raise ToolError(f"cannot parse expression {expression!r}: {exc.msg}") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6f}".rstrip("0").rstrip(".")


def _as_number(text: Any) -> float | None:
    try:
        return float(str(text).strip().replace(",", ""))
    except ValueError:
        return None


class SynthArith(SyntheticEnv):
    family = "synth_arith"
    instructions = "Solve the word problem. Use the calculator for every step."

    def __init__(self, config: SynthConfig | None = None):
        super().__init__(config)
        self.operations = self.config.difficulty
        self.max_operand = 10 * self.config.difficulty
        self.max_turns = self.operations + 3

    def make_item(self, rng: random.Random, item_id: str) -> TaskItem:
        noun = rng.choice(NOUNS)
        value = rng.randint(1, self.max_operand)
        sentences = [f"A box has {value} {noun}."]
        steps: list[str] = []
        for _ in range(self.operations):
            kind = rng.choice(("add", "sub", "mul", "div"))
            divisors = [k for k in (2, 3, 4, 5) if value % k == 0]
            if kind == "sub" and value < 2 or kind == "div" and not divisors:
                kind = "add"
            if kind == "add":
                n = rng.randint(1, self.max_operand)
                sentences.append(rng.choice((f"{n} more are added.", f"{n} more are put in.")))
                steps.append(f"{value} + {n}")
                value += n
            elif kind == "sub":
                n = rng.randint(1, value - 1)
                sentences.append(rng.choice((f"{n} are taken out.", f"{n} are removed.")))
                steps.append(f"{value} - {n}")
                value -= n
            elif kind == "mul":
                k = rng.choice((2, 3))
                sentences.append(f"The count is {'doubled' if k == 2 else 'tripled'}.")
                steps.append(f"{value} * {k}")
                value *= k
            else:
                k = rng.choice(divisors)
                sentences.append(f"They are split into {k} equal parts and one part is kept.")
                steps.append(f"{value} / {k}")
                value //= k
        sentences.append(f"How many {noun} are in the box?")
        return TaskItem(id=item_id, family=self.family, question=" ".join(sentences), gold=value,
                        meta={"steps": steps})

    def check_item(self, item: TaskItem) -> None:
        need(isinstance(item.gold, (int, float)) and not isinstance(item.gold, bool),
             "gold must be a number")
        steps = item.meta.get("steps")
        need(isinstance(steps, list) and all(isinstance(s, str) for s in steps),
             "meta.steps must be a list of expressions")

    def tools(self) -> list[dict[str, Any]]:
        return [CALCULATOR]

    def reset(self, item: TaskItem) -> None:
        return None  # the calculator has no state

    def call_tool(self, state: None, name: str, arguments: Mapping[str, Any]) -> str:
        if name != "calculator":
            raise ToolError(f"unknown tool {name!r}; available: calculator")
        check_arguments(CALCULATOR, arguments)
        return calculate(arguments["expression"])

    def verify(self, item: TaskItem, answer: Any) -> Verdict:
        got = _as_number(answer)
        em = float(got is not None and abs(got - float(item.gold)) < 1e-9)
        return Verdict(reward=em, metrics={"em": em})

    def expert_actions(self, item: TaskItem) -> list[Action]:
        steps = item.meta["steps"]
        return [Action(kind="tool", tool="calculator", arguments={"expression": s}) for s in steps] \
            + [Action(kind="answer", answer=str(item.gold))]


def expert_thoughts(item: TaskItem, actions: Sequence[Action]) -> list[str]:
    """Before the k-th calculator call, the sentence of the question that step k applies; before
    the answer, nothing. Restating the step turns "which numbers go into this call" from a search
    over the question into a copy of the words just written, which a tiny model learns far sooner."""
    steps = re.split(r"(?<=\.) ", item.question)[1:-1]  # drop the opening and the question
    thoughts, k = [], 0
    for action in actions:
        thoughts.append(steps[k] if action.kind == "tool" and k < len(steps) else "")
        k += action.kind == "tool"
    return thoughts
