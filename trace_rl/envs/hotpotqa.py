"""Multi-hop QA on HotpotQA (distractor setting) with a BM25 ``search`` tool.

The agent calls ``search(query)`` and ends with ``<answer>…</answer>``. Search is BM25 (the
``bm25s`` library) over the question's own context paragraphs (default: the distractor setting's
10 paragraphs) or over the pooled corpus of the whole file (``corpus="pooled"``); it returns the
top-k titles and texts, each text cut at a word boundary.

Reward (paper): 1 when the token F1 between the normalised prediction and the gold answer is at
least 0.3, else 0. Exact match and F1 are reported as metrics, computed the way the official
HotpotQA evaluation does: lower case, punctuation and the articles a/an/the removed, whitespace
collapsed; when either side normalises to ``yes``, ``no`` or ``noanswer`` and the two differ, F1
is 0. One departure: a gold answer that normalises to nothing ("The The", "!!!") is matched on
its raw text (case and whitespace aside) instead of giving every prediction F1 = 0.

Data (../shared/data/multihop_qa): ``dev`` = hotpotqa_dev_distractor_first500.jsonl (pooled corpus
hotpotqa_dev_first500_corpus.jsonl), ``train`` = hotpotqa_train_distractor_100.jsonl (raw HotpotQA
rows; pooled corpus hotpotqa_train_100_corpus.jsonl); ``dev_heldout`` = the first 100 dev items and
``dev_rest`` = the other 400 (``BLOCKS``: disjoint, fixed by file order). The question/answer-only files
(hotpotqa_dev_qa, musique_dev_500_qa, 2wiki_dev_500_qa, bamboogle_125) load for grading
(``trace score``) and closed-book use; their items have no paragraphs, so ``search`` reports that
no corpus exists for them. Ids: ``id``, ``_id`` or ``idx`` (as a string), whichever the file has.

The environment is stateless: indexes are cached per question (and once for a pooled corpus), so
a restore from a stored prefix needs only a fresh state, and replaying a query returns the same
observation.
"""

from __future__ import annotations

import re
import string
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import bm25s

from trace_rl.envs.base import Action, Environment, TaskItem, ToolError, Verdict
from trace_rl.envs.datadir import default_data_dir
from trace_rl.envs.io import load_jsonl, row_field, split_path
from trace_rl.envs.prompt import system_prompt

FAMILY = "hotpotqa"
F1_THRESHOLD = 0.3
"""The paper's success criterion: token F1 >= 0.3."""

SPLITS: dict[str, tuple[str, str | None]] = {
    "dev": ("hotpotqa_dev_distractor_first500.jsonl", "hotpotqa_dev_first500_corpus.jsonl"),
    "train": ("hotpotqa_train_distractor_100.jsonl", "hotpotqa_train_100_corpus.jsonl"),
    "dev_qa": ("hotpotqa_dev_qa.jsonl", None),
    "musique_dev": ("musique_dev_500_qa.jsonl", None),
    "2wiki_dev": ("2wiki_dev_500_qa.jsonl", None),
    "bamboogle": ("bamboogle_125.jsonl", None),
}
"""Split name -> (question file, pooled corpus file or None), under ``<data_dir>/multihop_qa``."""

DEV_HELDOUT = 100
"""Size of the fixed held-out block of ``dev``: its first items, in file order."""
BLOCKS: dict[str, tuple[str, int, int | None]] = {
    "dev_heldout": ("dev", 0, DEV_HELDOUT),
    "dev_rest": ("dev", DEV_HELDOUT, None),
}
"""Deterministic, disjoint blocks of a split: name -> (split, start, stop). ``dev_heldout`` (the
first 100 dev items) is what the warm start is measured on; ``dev_rest`` (the other 400) may
give training traces, since no item of it is in ``dev_heldout``."""

SEARCH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search Wikipedia paragraphs with BM25; returns the best matches' titles "
                       "and text.",
        "parameters": {"type": "object",
                       "properties": {"query": {"type": "string",
                                                "description": "Keywords or a question."}},
                       "required": ["query"]},
    },
}

INSTRUCTIONS = ("Answer the question. Use the search tool to find evidence; questions need "
                "several hops. Put only the short answer (an entity, a date, yes or no) in "
                "<answer></answer>.")


# ---- answer normalisation and metrics (official HotpotQA evaluation semantics + a departure) ----

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


# ---- loading ----

def _paragraph(para: Any, where: str) -> dict[str, str]:
    """One titled paragraph: ``{title, text}`` (HotpotQA distractor), ``{title,
    paragraph_text}`` (MuSiQue) or ``[title, [sentences]]`` (raw HotpotQA, 2Wiki)."""
    if isinstance(para, dict):
        try:
            text = para["paragraph_text"] if "paragraph_text" in para else row_field(para, "text", str)
            if not isinstance(text, str):
                raise ValueError(f"field 'paragraph_text' must be a string, got {type(text).__name__}")
            return {"title": row_field(para, "title", str), "text": text}
        except ValueError as exc:
            raise ValueError(f"{where}: {exc} (a paragraph is {{title, text}}, {{title, "
                             f"paragraph_text}} or [title, [sentences]])") from None
    if isinstance(para, list) and len(para) == 2 and isinstance(para[1], list):
        return {"title": str(para[0]), "text": "".join(map(str, para[1]))}
    raise ValueError(f"{where} is neither {{title, text}}, {{title, paragraph_text}} nor "
                     "[title, sentences]")


def _qa_row(row: dict[str, Any]) -> TaskItem:
    """Any of the multi-hop formats: HotpotQA distractor (``context`` as {title, text}), raw
    HotpotQA or 2Wiki (``context`` as [title, sentences]), MuSiQue (``paragraphs`` as {title,
    paragraph_text, is_supporting}, ``answer_aliases``), or question/answer only."""
    for key in ("id", "_id", "idx"):
        if key in row:
            item_id = str(row_field(row, key, (str, int)))
            break
    else:
        raise ValueError("missing field 'id' (or '_id' / 'idx')")
    key = "paragraphs" if "paragraphs" in row else "context"
    raw = row_field(row, key, list, default=[])
    paragraphs = [_paragraph(p, f"{key}[{k}]") for k, p in enumerate(raw)]
    if "supporting_titles" in row:
        support = list(row_field(row, "supporting_titles", list))
    elif "supporting_facts" in row:
        support = list(dict.fromkeys(str(f[0]) for f in row.get("supporting_facts") or []))
    else:  # MuSiQue marks its supporting paragraphs
        support = [p["title"] for p, r in zip(paragraphs, raw)
                   if isinstance(r, dict) and r.get("is_supporting")]
    answer = row_field(row, "answer", (str, int))
    aliases = row_field(row, "answer_aliases", list, default=[])
    for k, alias in enumerate(aliases):
        if not isinstance(alias, (str, int)) or isinstance(alias, bool):
            raise ValueError(f"answer_aliases[{k}] must be a string, got {alias!r:.60}")
    return TaskItem(id=item_id, family=FAMILY, question=row_field(row, "question", str),
                    gold=str(answer),
                    meta={"paragraphs": paragraphs, "supporting_titles": support,
                          "aliases": [str(a) for a in aliases], "type": row.get("type", "")})


def load_qa_file(path: str | Path, limit: int | None = None) -> list[TaskItem]:
    """Items of one multi-hop QA file (any of the formats in ../shared/data/multihop_qa)."""
    return load_jsonl(path, _qa_row, limit)


def load_corpus(path: str | Path) -> list[dict[str, str]]:
    """A pooled corpus file: rows ``{id, title, text}``."""
    return load_jsonl(path, lambda r: {"title": row_field(r, "title", str),
                                       "text": row_field(r, "text", str)})


# ---- BM25 search ----

class BM25Index:
    """BM25 over paragraphs (title + text), built once."""

    def __init__(self, paragraphs: Sequence[Mapping[str, str]]):
        if not paragraphs:
            raise ValueError("BM25Index needs at least one paragraph")
        self.paragraphs = list(paragraphs)
        corpus = [f"{p['title']}. {p['text']}" for p in self.paragraphs]
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(corpus, stopwords="en", show_progress=False),
                             show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """(paragraph index, score) of the top ``k`` paragraphs with a positive score."""
        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not tokens[0]:
            return []
        k = min(k, len(self.paragraphs))
        docs, scores = self.retriever.retrieve(tokens, k=k, show_progress=False)
        return [(int(d), float(s)) for d, s in zip(docs[0], scores[0]) if s > 0]


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = text[:limit].rsplit(" ", 1)[0]
    return head + " ..."


@dataclass(frozen=True)
class HotpotConfig:
    """How the multi-hop QA family searches."""

    data_dir: Path | None = None
    """Data root holding ``multihop_qa/``; None: ``$TRACE_DATA_DIR`` or ``<repo>/../shared/data``."""
    corpus: Literal["question", "pooled"] = "question"
    """Search the question's own paragraphs (distractor setting) or the file's pooled corpus."""
    top_k: int = 3
    """Paragraphs returned per search."""
    max_chars: int = 600
    """Characters of each paragraph's text shown (cut at a word boundary)."""
    cache_size: int = 4096
    """Per-question indexes kept (least recently used dropped)."""
    max_turns: int = 6
    """Turn cap of one episode."""

    def __post_init__(self) -> None:
        if self.corpus not in ("question", "pooled"):
            raise ValueError(f"HotpotConfig.corpus={self.corpus!r}: use 'question' or 'pooled'")
        if self.top_k < 1 or self.max_chars < 20 or self.cache_size < 1:
            raise ValueError("HotpotConfig: top_k >= 1, max_chars >= 20, cache_size >= 1")


class HotpotQAEnv(Environment):
    """HotpotQA distractor with BM25 search; reward = token F1 >= 0.3."""

    family = FAMILY
    stateful = False

    def __init__(self, config: HotpotConfig | None = None, **kwargs: Any):
        self.config = config or HotpotConfig(**kwargs)
        self.max_turns = self.config.max_turns
        self.data_dir = Path(self.config.data_dir or default_data_dir())
        self._per_question: OrderedDict[tuple[str, str], BM25Index] = OrderedDict()
        self._pooled: dict[str, BM25Index] = {}
        self._corpora: dict[str, list[dict[str, str]]] = {}  # pooled corpora of loaded files
        self._lock = threading.Lock()  # the ReAct loop runs tools from worker threads

    def load(self, split: str, limit: int | None = None) -> list[TaskItem]:
        """A split of ``SPLITS``, a block of ``BLOCKS`` or a file path; items remember their pooled
        corpus file."""
        if split in BLOCKS:
            parent, start, stop = BLOCKS[split]
            block = self.load(parent)[start:stop]
            return block[:limit] if limit is not None else block
        if split in SPLITS:
            qfile, cfile = SPLITS[split]
            path = self.data_dir / "multihop_qa" / qfile
            corpus = str(self.data_dir / "multihop_qa" / cfile) if cfile else None
        else:
            path, corpus = split_path(FAMILY, split, [*SPLITS, *BLOCKS]), None
        items = load_qa_file(path, limit)
        if corpus is None and any(it.meta["paragraphs"] for it in items):
            # A file of its own: its pooled corpus is every item's paragraphs, once each.
            corpus = f"items:{Path(path).resolve()}:{limit}"
            pooled = {(p["title"], p["text"]): p for it in items for p in it.meta["paragraphs"]}
            with self._lock:
                self._corpora[corpus] = list(pooled.values())
        if corpus is None:
            return items
        return [TaskItem(it.id, it.family, it.question, it.gold, {**it.meta, "corpus": corpus})
                for it in items]

    def tools(self) -> list[dict[str, Any]]:
        return [SEARCH_TOOL]

    def system_prompt(self) -> str:
        return system_prompt(INSTRUCTIONS, self.tools())

    def _index(self, item: TaskItem) -> BM25Index:
        with self._lock:
            return self._index_locked(item)

    def _index_locked(self, item: TaskItem) -> BM25Index:
        if self.config.corpus == "pooled":
            corpus = item.meta.get("corpus")
            if not corpus:
                raise ToolError(f"item {item.id} has no pooled corpus (load a split that has one)")
            if corpus not in self._pooled:
                paragraphs = self._corpora.get(corpus)
                self._pooled[corpus] = BM25Index(paragraphs if paragraphs is not None
                                                 else load_corpus(corpus))
            return self._pooled[corpus]
        key = (item.id, item.question)  # ids alone may repeat across files
        cached = self._per_question.get(key)
        if cached is not None:
            self._per_question.move_to_end(key)
            return cached
        paragraphs = item.meta.get("paragraphs") or []
        if not paragraphs:
            raise ToolError(f"item {item.id} has no paragraphs to search (a question/answer-only "
                            "file)")
        index = BM25Index(paragraphs)
        self._per_question[key] = index
        if len(self._per_question) > self.config.cache_size:
            self._per_question.popitem(last=False)
        return index

    def reset(self, item: TaskItem) -> dict[str, Any]:
        # The index is built lazily on the first search and cached per question, not per state.
        return {"item": item}

    def call_tool(self, state: Any, name: str, arguments: Mapping[str, Any]) -> str:
        if name != "search":
            raise ToolError(f"unknown tool {name!r}; available: search")
        query = arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ToolError("search needs a non-empty string argument 'query'")
        index = self._index(state["item"])
        hits = index.search(query, self.config.top_k)
        if not hits:
            return "No results."
        lines = []
        for rank, (doc, _score) in enumerate(hits, start=1):
            para = index.paragraphs[doc]
            lines.append(f"[{rank}] {para['title']}: {_cut(para['text'], self.config.max_chars)}")
        return "\n".join(lines)

    def verify(self, item: TaskItem, answer: Any) -> Verdict:
        return grade(str(item.gold), answer, item.meta.get("aliases") or ())

    def expert_actions(self, item: TaskItem) -> list[Action]:
        """Search each supporting title, then answer with the gold answer."""
        titles = item.meta.get("supporting_titles") or []
        return [Action(kind="tool", tool="search", arguments={"query": t}) for t in titles] + \
            [Action(kind="answer", answer=str(item.gold))]

