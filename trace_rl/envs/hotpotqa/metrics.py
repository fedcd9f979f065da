"""Answers of the multi-hop QA family (``trace_rl.envs.hotpotqa``) graded as the official HotpotQA
evaluation does, with documented departures.

Reward (paper): 1 when the token F1 between the normalised prediction and the gold answer is at
least 0.3, else 0. Exact match and F1 are reported as metrics, computed the way the official
HotpotQA evaluation does: lower case, punctuation and the articles a/an/the removed, whitespace
collapsed; when either side normalises to ``yes``, ``no`` or ``noanswer`` and the two differ, F1
is 0. Departures: a gold answer that normalises to nothing ("The The", "!!!") is matched on its
raw text (case and whitespace aside) instead of giving every prediction F1 = 0; number words are
read as digits and common abbreviations expanded (docs/families.md). ``strict`` is a stricter
match reported beside them.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any, Sequence

from trace_rl.envs.base import Verdict

F1_THRESHOLD = 0.3
"""The paper's success criterion: token F1 >= 0.3."""

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)
_UNITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
          "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
          "eighteen", "nineteen"]
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
NUMBER_WORDS: dict[str, int] = {**{w: i for i, w in enumerate(_UNITS)},
                                **{w: 20 + 10 * i for i, w in enumerate(_TENS)}}
"""Cardinal number words read as digits (with ``hundred``, ``thousand``, ``million``)."""
_SCALES = {"hundred": 100, "thousand": 1000, "million": 1_000_000}
_NUMBER_RUN = re.compile(r"\b(?:(?:%s)(?:[\s-]+(?:and[\s-]+)?)?)+\b" % "|".join(
    sorted([*NUMBER_WORDS, *_SCALES], key=len, reverse=True)))
ABBREVIATIONS: dict[str, str] = {
    "uk": "united kingdom", "us": "united states", "usa": "united states",
    "ussr": "soviet union", "un": "united nations", "eu": "european union",
    "nyc": "new york city", "dc": "district of columbia", "st": "saint", "mt": "mount",
    "ft": "fort", "jr": "junior", "sr": "senior", "dr": "doctor", "co": "company",
    "corp": "corporation", "inc": "incorporated", "ltd": "limited", "univ": "university",
}
"""Common abbreviations, expanded token by token after punctuation is removed (so ``U.S.`` is
``us``): the departure that lets "UK" match "United Kingdom"."""


def _number_value(words: list[str]) -> int | None:
    total, current = 0, 0
    for w in words:
        if w == "and":
            continue
        if w in NUMBER_WORDS:
            current += NUMBER_WORDS[w]
        elif w == "hundred":
            current = max(current, 1) * 100
        elif w in _SCALES:
            total += max(current, 1) * _SCALES[w]
            current = 0
        else:
            return None
    return total + current


def _numbers_to_digits(text: str) -> str:
    """"thirty-five" -> "35", "one hundred and five" -> "105" (lower-case text)."""
    def repl(m: re.Match) -> str:
        run = m.group(0)
        words = [w for w in re.split(r"[\s-]+", run.strip()) if w]
        while words and words[-1] == "and":
            words.pop()
        value = _number_value(words)
        tail = run[len(run.rstrip()):]
        return (run if value is None else str(value) + (" and" if run.strip().endswith("and")
                                                          else "")) + tail
    return _NUMBER_RUN.sub(repl, text)


def normalize_answer(text: str) -> str:
    """Lower case, number words as digits, drop punctuation, drop articles, expand common
    abbreviations, collapse whitespace. The official HotpotQA normalisation plus the documented
    departure (number words and ``ABBREVIATIONS``, docs/families.md)."""
    text = _numbers_to_digits(text.lower())
    text = "".join(ch for ch in text if ch not in _PUNCT)
    tokens = _ARTICLES.sub(" ", text).split()
    return " ".join(ABBREVIATIONS.get(t, t) for t in tokens)


def _blank_gold_match(prediction: str, gold: str) -> float:
    # Departure: a gold answer made only of articles and punctuation ("The The", "!!!" in the
    # dev set) normalises to nothing, where the official script gives every prediction F1 = 0
    # and EM = 1. Here such a gold needs the same text, up to case and whitespace.
    return float(" ".join(prediction.lower().split()) == " ".join(gold.lower().split()))


def _overlap(prediction: str, gold: str) -> tuple[float, float, float] | None:
    """(precision, recall, F1) of the normalised tokens; None for a gold that normalises to
    nothing; yes/no/noanswer must match exactly (else all 0)."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if not ref:
        return None
    special = ("yes", "no", "noanswer")
    if (pred in special or ref in special) and pred != ref:
        return 0.0, 0.0, 0.0
    common = Counter(pred.split()) & Counter(ref.split())
    same = sum(common.values())
    if same == 0:
        return 0.0, 0.0, 0.0
    precision, recall = same / len(pred.split()), same / len(ref.split())
    return precision, recall, 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 after normalisation; yes/no/noanswer must match exactly (else 0)."""
    o = _overlap(prediction, gold)
    return _blank_gold_match(prediction, gold) if o is None else o[2]


def exact_match(prediction: str, gold: str) -> float:
    if not normalize_answer(gold):
        return _blank_gold_match(prediction, gold)
    return float(normalize_answer(prediction) == normalize_answer(gold))


STRICT_PRECISION = 0.5
"""``strict_match``: share of the prediction's tokens that must belong to the gold."""


def strict_match(prediction: str, gold: str) -> float:
    """1 when the prediction holds every normalised gold token and at least half of its own
    tokens are gold tokens: "Paris, France" passes for "Paris", but neither "North Pacific" for
    "South Pacific" nor "June 1968" for "June 1967", which F1 >= 0.3 passes."""
    o = _overlap(prediction, gold)
    if o is None:
        return _blank_gold_match(prediction, gold)
    precision, recall, _ = o
    return float(recall == 1.0 and precision >= STRICT_PRECISION)


def grade(gold: str, answer: Any, aliases: Sequence[str] = ()) -> Verdict:
    """Reward = [F1 >= 0.3] (the paper's criterion); EM, F1 and ``strict`` as metrics. Each is
    the best over the gold answer and its ``aliases``."""
    pred = "" if answer is None else str(answer)
    golds = [gold, *[a for a in aliases if a]]
    f1 = max(f1_score(pred, g) for g in golds)
    return Verdict(reward=float(f1 >= F1_THRESHOLD),
                   metrics={"em": max(exact_match(pred, g) for g in golds), "f1": f1,
                            "strict": max(strict_match(pred, g) for g in golds)})
