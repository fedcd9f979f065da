"""HotpotQA's warm-start traces (``trace_rl.policy.warmstart``): the gold trace of a training item
searches each supporting title and answers; a recovery trace searches a distractor first; with
thoughts, each thought quotes the span of an observation that the next action copies (the bridge
step made explicit)."""

from __future__ import annotations

import random
import re
from typing import Protocol, Sequence

from trace_rl.envs.base import Action, Environment, TaskItem


class Recipe(Protocol):
    """The warm start's settings this builder reads (``WarmstartConfig``'s fields)."""

    bridge_thoughts: bool
    question_first: bool


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
                   config: Recipe) -> tuple[list[Action], list[str]] | None:
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
