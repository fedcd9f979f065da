"""The warm start's training data: ReAct traces of a family's training items (gold, and recovery
traces that search a distractor first), with thoughts that teach HotpotQA's bridge step; and the
training and measured items, kept apart by id and by question."""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.envs.bfcl.constants import SINGLE_TURN
from trace_rl.rollout.types import Action

if TYPE_CHECKING:
    from trace_rl.policy.warmstart.config import WarmstartConfig

TraceBuilder = Callable[[Environment, TaskItem, random.Random, bool, "WarmstartConfig"],
                        "tuple[list[Action], list[str]] | None"]
"""(env, training item, rng, recovery?, config) -> (actions, the thought before each) or None
when the item cannot give that trace."""


def _name(title: str) -> str:
    """A title without its disambiguation ("Kiss and Tell (1945 film)" -> "Kiss and Tell")."""
    return title.split(" (")[0].strip()


def _hop_order(item: TaskItem) -> list[str]:
    """Supporting titles, those the question names first (the first hop of a bridge question)."""
    titles = list(dict.fromkeys(item.meta.get("supporting_titles") or []))
    q = item.question.lower()
    return sorted(titles, key=lambda t: (_name(t).lower() not in q, titles.index(t)))


QUOTE_CHARS = 60
"""Characters of observation a bridge thought quotes before the span it points at."""


def quote(observation: str, span: str) -> str | None:
    """The stretch of ``observation`` that ends with ``span`` (case aside, whole words only),
    starting at a word boundary at most ``QUOTE_CHARS`` before it and never in a result's
    ``[k] Title:`` head; None when no result's text holds ``span``."""
    if not span.strip():
        return None
    for found in re.finditer(rf"(?<!\w){re.escape(span.strip())}(?!\w)", observation,
                             re.IGNORECASE):
        at = found.start()
        line_start = observation.rfind("\n", 0, at) + 1
        head = observation.find(": ", line_start)
        text_start = line_start if head < 0 or "\n" in observation[line_start:head] else head + 2
        if at < text_start:
            continue  # the span is (in) the result's title, not its text
        start = max(text_start, at - QUOTE_CHARS)
        if start > text_start and observation[start - 1] != " ":
            space = observation.find(" ", start, at)
            start = space + 1 if space >= 0 else at
        return observation[start:found.end()].strip()
    return None


def _shown_titles(observation: str) -> set[str]:
    """Titles of the results an observation lists (``[k] Title: text`` lines)."""
    return set(re.findall(r"^\[\d+\] (.+?): ", observation, re.MULTILINE))


def _bridge_thought(target: str, question: str, seen: Sequence[str], search: bool) -> str:
    """The thought before an action that copies ``target``: empty for a search of an entity the
    question names and for a comparison's yes/no, else the latest observation's span that ends
    with ``target`` (empty when none holds it)."""
    if (search and target.lower() in question.lower()) or \
            target.strip().lower() in ("yes", "no"):
        return ""
    for obs in reversed(seen):
        span = quote(obs, target)
        if span is not None:
            return f'The result says "{span}".'
    return ""


def hotpotqa_trace(env: Environment, item: TaskItem, rng: random.Random, recovery: bool,
                   config: WarmstartConfig) -> tuple[list[Action], list[str]] | None:
    """Gold: search each supporting title, answer. Recovery: a distractor title first.

    With ``config.bridge_thoughts`` (the bridge step made explicit), queries are the entity names
    (titles without their disambiguation, as a policy can copy them from the question or an
    observation) and each thought quotes what the next action copies: before a search for an
    entity the question does not name, the span of an earlier observation that names it; before
    the answer, the span of an observation that holds it. With ``config.question_first``
    (recipe 4) the first search is the question itself, and the entities are searched only when
    its results hold neither the answer nor (for yes/no) every supporting paragraph.
    Observations are the environment's real ones."""
    titles = _hop_order(item)
    if not titles:
        return None
    thoughts = config.bridge_thoughts or config.question_first
    gold = str(item.gold)
    queries = [item.question] if config.question_first else \
        [_name(t) if thoughts else t for t in titles]
    if recovery:
        distractors = sorted({p["title"] for p in item.meta.get("paragraphs") or []} - set(titles))
        if not distractors:
            return None
        bad = rng.choice(distractors)
        queries.insert(0, _name(bad) if thoughts else bad)
    if not thoughts:
        # Empty thoughts (recipe 2): recipe 1's fixed phrases ("I search for the first entity.")
        # carried nothing, and the policy answered with them (0/40 on dev).
        actions = [Action(kind="tool", tool="search", arguments={"query": q}) for q in queries]
        return [*actions, Action(kind="answer", answer=gold)], [""] * (len(actions) + 1)
    state = env.reset(item)
    actions: list[Action] = []
    said: list[str] = []
    seen: list[str] = []

    def search(query: str) -> None:
        action = Action(kind="tool", tool="search", arguments={"query": query})
        said.append(_bridge_thought(query, item.question, seen, search=True))
        actions.append(action)
        seen.append(env.step(state, action).observation or "")

    for query in queries:
        search(query)
    answer_thought = _bridge_thought(gold, item.question, seen, search=False)
    if config.question_first and not answer_thought:  # no quotable answer yet (or yes/no)
        shown = set().union(*map(_shown_titles, seen))
        for title in titles:
            if title not in shown:
                search(_name(title))
        answer_thought = _bridge_thought(gold, item.question, seen, search=False)
    said.append(answer_thought)
    actions.append(Action(kind="answer", answer=gold))
    return actions, said


def bfcl_trace(env: Environment, item: TaskItem, rng: random.Random, recovery: bool,
               config: WarmstartConfig) -> tuple[list[Action], list[str]] | None:
    """A single-turn BFCL item's gold answer (the environment's own expert calls, graded by its
    AST checker when the trace is rendered), with an empty thought. None for a multi-turn item
    (its traces run to thousands of tokens) and for ``recovery``: a single-turn item has one
    turn, so there is no bad step to recover from. Thoughts do not apply."""
    if recovery or item.meta.get("category") not in SINGLE_TURN:
        return None
    actions = list(env.expert_actions(item))
    return actions, [""] * len(actions)


TRACES: dict[str, TraceBuilder] = {"hotpotqa": hotpotqa_trace, "bfcl": bfcl_trace}
"""Family -> trace builder (the registry of families this recipe supports)."""


def build_traces(config: WarmstartConfig, env: Environment, items: Sequence[TaskItem],
                 rng: random.Random) -> Iterator[tuple[TaskItem, list[Action], list[str], str]]:
    """(item, actions, thoughts, kind) per trace: a gold trace per item, and a recovery trace
    for a share ``config.recovery`` of them."""
    build = TRACES[config.family]
    for item in items:
        for kind in ("gold", "recovery"):
            if kind == "recovery" and rng.random() >= config.recovery:
                continue
            made = build(env, item, rng, kind == "recovery", config)
            if made is not None:
                yield item, made[0], made[1], kind


def load_split_items(config: WarmstartConfig, env: Environment
                     ) -> tuple[list[TaskItem], list[TaskItem]]:
    """(training items, measured items): the ``+``-joined parts of ``train_split`` in order (the
    first ``train_items`` of them), and the first ``eval_items`` of ``eval_split``.
    ``ValueError`` when an item of the measured split is among the training items (by id, and by
    question, as ids alone may repeat across files): traces never come from evaluation items."""
    train: list[TaskItem] = []
    for part in config.train_splits:
        train.extend(env.load(part))
    if config.train_items:
        train = train[:config.train_items]
    held = env.load(config.eval_split) if config.eval_split else []
    ids, questions = {it.id for it in train}, {it.question for it in train}
    shared = [it.id for it in held if it.id in ids or it.question in questions]
    if shared:
        raise ValueError(f"warmstart: {len(shared)} item(s) of eval_split={config.eval_split!r} "
                         f"are in train_split={config.train_split!r} (e.g. {shared[0]!r}); "
                         "traces are never built from evaluation items")
    return train, held[:config.eval_items]
