"""Multi-hop QA on HotpotQA (distractor setting) with a BM25 ``search`` tool.

The agent calls ``search(query)`` and ends with ``<answer>…</answer>``. Search is BM25 (the
``bm25s`` library) over the question's own context paragraphs (default: the distractor setting's
10 paragraphs) or over the pooled corpus of the whole file (``corpus="pooled"``); it returns the
top-k titles and texts, each text cut at a word boundary.

Reward (paper): 1 when the token F1 between the normalised prediction and the gold answer is at
least 0.3, else 0; exact match, F1 and ``strict`` are reported as metrics (``grade``, in
``trace_rl.envs.hotpotqa.metrics`` with the normalisation: the official HotpotQA evaluation's, and its
documented departures).

Data ($TRACE_DATA_DIR/multihop_qa; docs/families.md, "Data"): ``dev`` =
hotpotqa_dev_distractor_first500.jsonl (pooled corpus hotpotqa_dev_first500_corpus.jsonl), ``train`` = hotpotqa_train_distractor_100.jsonl (raw HotpotQA
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

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import bm25s

from trace_rl.envs.base import Action, Environment, TaskItem, ToolError, Verdict
from trace_rl.envs.datadir import default_data_dir
from trace_rl.envs.hotpotqa.metrics import (F1_THRESHOLD, STRICT_PRECISION, exact_match,  # noqa: F401
                                            f1_score, grade, normalize_answer, strict_match)
from trace_rl.envs.io import load_jsonl, row_field, split_path
from trace_rl.envs.prompt import system_prompt

FAMILY = "hotpotqa"

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
    """Items of one multi-hop QA file (any of the formats of $TRACE_DATA_DIR/multihop_qa)."""
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

