"""``ScriptedEngine``: a test double of the rollout ``Engine`` whose turns are written by a Python
function instead of sampled from a model.

It exists to test the ReAct loop (parsing, tools, errors, prefixes) with exactly chosen outputs,
and the train flow with trees that are the same on every machine (``scripted_rollouts``,
``ArithAgent``). It tokenises its scripted texts with a real tokenizer and honours stop strings
and ``max_tokens`` the way the real engines do (stop string kept, ``finish_reason`` "stop" or
"length"), and records every request it receives so tests can check the exact tokens fed. Every
token's log-probability is -0.5: deterministic, and read by nothing that is compared (the policy
update recomputes its own).
"""

from __future__ import annotations

import hashlib
import re
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from trace_rl.rollout.types import Completion, GenRequest

Respond = Callable[[str, int], str]
"""(decoded context, copy index within the request) -> the turn's text."""

SeededRespond = Callable[[str, int, "int | None"], str]
"""(decoded context, copy index within the request, the request's sampling seed) -> the turn's
text. The ReAct loop derives each request's seed from the run's seed and the request's place
(start, copy, depth: ``trace_rl.rollout.react``), so a function of these three is a
reproducible stand-in for sampling."""


class ScriptedEngine:
    name = "scripted"

    def __init__(self, tokenizer: Any, respond: Respond | SeededRespond, *, seeded: bool = False):
        """``respond`` is called as ``respond(context, j)``, or with ``seeded`` as
        ``respond(context, j, request.sampling.seed)``."""
        self._tokenizer = tokenizer
        self.respond = respond
        self.seeded = seeded
        self.requests: list[GenRequest] = []
        self.loaded: list[str] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def _complete(self, req: GenRequest, j: int) -> Completion:
        context = self._tokenizer.decode(list(req.prompt_ids), skip_special_tokens=False)
        text = (self.respond(context, j, req.sampling.seed) if self.seeded  # type: ignore[call-arg]
                else self.respond(context, j))  # type: ignore[call-arg]
        stops = [text.find(s) + len(s) for s in req.sampling.stop if s in text]
        finish = "stop"
        if stops:
            text = text[:min(stops)]
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > req.sampling.max_tokens:
            ids, finish = ids[:req.sampling.max_tokens], "length"
            text = self._tokenizer.decode(ids, skip_special_tokens=False)
        return Completion(token_ids=list(ids), logprobs=[-0.5] * len(ids), text=text,
                          finish_reason=finish)

    def generate(self, requests: Sequence[GenRequest]) -> list[list[Completion]]:
        self.requests.extend(requests)
        return [[self._complete(r, j) for j in range(r.n)] for r in requests]

    def load_weights(self, model_dir: str) -> float:
        """A script has no weights: the flow's weight sync after a policy update is recorded
        (``loaded``) and changes nothing."""
        self.loaded.append(model_dir)
        return 0.0

    def close(self) -> None:
        pass


@contextmanager
def scripted_rollouts(respond: SeededRespond, kind: str = "hf") -> Iterator[list[ScriptedEngine]]:
    """Inside the block, every rollout engine of ``kind`` that a flow starts is a seeded
    ``ScriptedEngine`` over ``respond``, with the tokenizer of the model directory it is started
    on; yields the engines built, so a test can check that they served the rollouts.

    The injection point is the engine registry ``trace_rl.engines.ENGINES`` (kind -> constructor):
    every engine a flow uses is built through it (``get_engine`` -> ``make_engine``), so a flow
    run here with ``engine=<kind>`` runs unchanged with scripted turns. An existing kind is
    replaced rather than a new one added because ``TrainConfig.engine`` accepts the kinds
    registered when ``trace_rl.config`` is imported. The process's cached engines are closed on
    entry and on exit, so that no real engine started earlier serves the block and no scripted
    one outlives it."""
    from transformers import AutoTokenizer

    from trace_rl import engines

    built: list[ScriptedEngine] = []

    def build(model_dir: str, **opts: Any) -> ScriptedEngine:
        engine = ScriptedEngine(AutoTokenizer.from_pretrained(model_dir), respond, seeded=True)
        built.append(engine)
        return engine

    real = engines.ENGINES[kind]
    engines.close_engines()
    engines.ENGINES[kind] = build
    try:
        yield built
    finally:
        engines.ENGINES[kind] = real
        engines.close_engines()


# ---- a scripted synth_arith agent ------------------------------------------------------------

def uniform(*key: object) -> float:
    """A number in [0, 1) fixed by ``key`` (blake2b of its repr): the same on every machine,
    Python build and process (the built-in ``hash`` of a string is salted per process)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


_STEP = re.compile(r"(\d+) more are (?:added|put in)\.|(\d+) are (?:taken out|removed)\.|"
                   r"The count is (doubled|tripled)\.|They are split into (\d+) equal parts")


def arith_problem(question: str) -> tuple[int, list[tuple[str, int]]]:
    """(start value, [(operator, operand)]) of a synth_arith word problem, read from its text
    (``trace_rl.envs.synth_arith.env``'s sentences)."""
    start = int(re.match(r"A box has (\d+) ", question).group(1))
    ops = []
    for m in _STEP.finditer(question):
        add, sub, mul, div = m.groups()
        ops.append(("+", int(add)) if add else ("-", int(sub)) if sub else
                   ("*", 2 if mul == "doubled" else 3) if mul else ("/", int(div)))
    return start, ops


def arith_answer(question: str) -> int:
    """The gold answer of a synth_arith word problem, computed from its text."""
    value, ops = arith_problem(question)
    for op, n in ops:
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
    return value


def question_of(context: str) -> str:
    """The (last) user message of a ChatML context: the item's question."""
    return re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", context, re.S)[-1]


def observations_of(context: str) -> list[str]:
    """The tool messages of a ChatML context, in order."""
    return re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", context, re.S)


def say(kind: str, value: Any, thought: str) -> str:
    """A turn in the ReAct format: a calculator call on the expression ``value``
    (``kind="call"``) or the final answer ``value`` (``kind="answer"``)."""
    from trace_rl.rollout.format import render_action
    from trace_rl.rollout.types import Action

    action = (Action(kind="tool", tool="calculator", arguments={"expression": str(value)})
              if kind == "call" else Action(kind="answer", answer=str(value)))
    return render_action(action, thought=thought)


class ArithAgent:
    """A synth_arith agent whose every turn is a seeded, deterministic function of (context, copy
    index, request seed): with probability ``skill(question)`` it calls the calculator on the
    next operation of the running value (read from the last observation), otherwise it makes a
    wrong call (the operand off by one) or answers at once (the start value, wrong); once every
    operation is done it answers the running value, or that value + 1 with probability
    (1 - skill) / 2. A skill of 1 always succeeds, 0 always fails; between, outcomes are mixed
    and episodes take 1 to d + 1 turns (d operations), so trees branch at several depths.

    ``seed`` draws another agent (another set of choices) from the same skills."""

    def __init__(self, skill: Callable[[str], float], seed: int = 0):
        self.skill, self.seed = skill, seed

    def __call__(self, context: str, j: int, request_seed: int | None) -> str:
        question = question_of(context)
        value, ops = arith_problem(question)
        seen = observations_of(context)
        for obs in seen:
            value = obs if re.fullmatch(r"-?[\d.]+", obs) else value
        p = self.skill(question)
        u = uniform(self.seed, request_seed, j, context)
        if len(seen) < len(ops):
            op, n = ops[len(seen)]
            if u < p:
                return say("call", f"{value} {op} {n}", f"step {len(seen) + 1}")
            if u < p + (1 - p) / 2:
                return say("call", f"{value} {op} {n + 1}", f"step {len(seen) + 1}")
            return say("answer", value, "it is what we started with")
        if u < (1 + p) / 2:
            return say("answer", value, "done")
        return say("answer", f"{float(value) + 1:g}", "done, plus one")


def mixed_skill(question: str) -> float:
    """A fixed skill per question: 0 (always wrong) for a fifth of the questions, 1 (always
    right) for a fifth, 0.6 or 0.85 for the rest, so a step holds uniform and mixed groups."""
    u = uniform("skill", question)
    return 0.0 if u < 0.2 else 1.0 if u < 0.4 else 0.6 if u < 0.7 else 0.85
