"""``synth_chain``: multi-hop relation chains whose outcome stays open past the first turn.

Each item holds a small knowledge base of people and asks for the end of an H-hop relation chain
("Start from Kalo and follow owner > mentor > friend. Who do you reach?"). The tool
``search(query)`` returns the records named ``query``; a record lists two facts ("owner Miru;
rival Pesa"). The expert searches the start, reads the next person off the relation of that hop,
searches them, ..., and answers the last one. H is drawn per item (``chain_hops``, default
2/3/4 hops with probabilities .35/.40/.25); the turn cap of an item is H + 3 (``turn_cap``).

Hazards, fixed in the item (so a prompt keeps its difficulty across epochs): each searched
person of the chain (hops 0..H-1) carries one with probability q, the item's hazard rate, drawn
from Beta(``chain_hazard_a``, ``chain_hazard_b``); a hazard is an alias with probability
``chain_alias_share``, else a homonym.

* **alias** (recoverable): the person is written hyphenated wherever the text names them
  ("Ka-lo"), but listed unhyphenated; the verbatim query fails ("No entry for Ka-lo. Did you
  mean Kalo?") and the retry costs a turn. Two retries fit in the cap; a third only if the agent
  drops the hyphen itself.
* **homonym** (unrecoverable): two people share the name; the search returns both records, in an
  order fixed per item, each with the same relations and different people. Following the wrong
  copy raises no error: the chain goes on through plausible facts to a wrong person.

So q spreads prompts from always solved (q near 0) to never solved, and a homonym hop decides the
outcome at that turn, not at the first. Difficulty cues visible in the text: the number of hops
in the question, and its directory of people, where hyphenated names (aliases) and names listed
twice (homonyms) appear; distractor people get the same hazards at the same rate, so the
directory is a cue to q, not a map of the chain's hazards.

Splits: ``train`` (``chain_train_items``, default 256: at a pool of 32 a prompt recurs every ~8
steps), ``test`` (``n_test``), ``hard`` (``n_test`` items with H = 5 and 1.5x the hazard rate) and
``sft`` (``n_train`` items for the tiny policy's supervised warm start, so it never sees the train
pool's solutions; ``sft_split``). ``test`` and ``hard`` hold only problem keys of the test bucket,
``train`` and ``sft`` only keys of the train bucket (``SyntheticEnv.split_of``). Reward: exact
match of the answer with the final person (case-insensitive; whitespace and a final period
ignored). The knowledge base is read-only, so the family is stateless and restores at any prefix
from its stored observations.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from trace_rl.envs.base import Action, TaskItem, ToolError, Verdict
from trace_rl.envs.synth_chain.options import ChainOptions, parse_hops
from trace_rl.envs.synthetic import (SynthConfig, SyntheticEnv, check_arguments,
                                            function_tool, need)

SYLLABLES = ("ka", "lo", "mi", "ru", "te", "vo", "zi", "na", "pe", "sa", "do", "gu", "ba", "fi",
             "ho", "je")
RELATIONS = ("owner", "manager", "friend", "mentor", "rival", "parent")
SEARCH = function_tool("search", "Records of the people with this name.",
                       {"query": {"type": "string"}})
HARD_HOPS = 5
"""Hops of every ``hard`` item."""
HARD_RATE = 1.5
"""Factor on the hazard rate of ``hard`` items (capped at 1)."""
DISTRACTORS = 3
"""People besides the chain (and homonym twins) in each knowledge base."""
SPARE_TURNS = 3
"""Turn cap of an item: its hops + this (H searches + one answer + two retries)."""
SPLITS = ("train", "test", "hard", "sft")
ALIAS, HOMONYM = "alias", "homonym"


def _normalise(text: Any) -> str:
    return str(text).strip().rstrip(".").strip().lower()


def _hyphenate(name: str) -> str:
    """How the text writes an alias: "Ka-lo" for "Kalo", "Ka-" for a one-syllable "Ka"."""
    return f"{name[:2]}-{name[2:]}"


def name_list(syllables: int) -> list[str]:
    """Every name an item can draw: the capitalised syllables (``syllables=1``) or every pair of
    syllables, the first capitalised (2)."""
    if syllables == 1:
        return [a.capitalize() for a in SYLLABLES]
    return [(a + b).capitalize() for a in SYLLABLES for b in SYLLABLES]


@dataclass(frozen=True)
class _Cast:
    """The people of one item: the chain (start to answer) and the distractors, the relation of
    each hop, the hazard of each person, and how the text writes each name."""

    names: list[str]
    """The chain's people, then the distractors."""
    chain: list[str]
    distractors: list[str]
    path: list[str]
    """The relation followed at each hop."""
    hazards: list[str]
    """Per chain person (the answer included, who carries none): ``ALIAS``, ``HOMONYM`` or ""."""
    kind: dict[str, str]
    """Every person's hazard, distractors' decoys included."""
    surface: dict[str, str]
    """Name -> as the text writes it (an alias hyphenated)."""


def _draw_cast(rng: random.Random, n_hops: int, rate: float, alias_share: float,
               names: Sequence[str]) -> _Cast:
    """Names (drawn from ``names``), the path of relations and the hazards (each person one with
    probability ``rate``, an alias with probability ``alias_share``, else a homonym) of an item
    with ``n_hops`` hops."""
    def draw() -> str:
        if rng.random() >= rate:
            return ""
        return ALIAS if rng.random() < alias_share else HOMONYM

    n_people = n_hops + 1 + DISTRACTORS
    names = rng.sample(list(names), n_people)
    chain, distractors = names[:n_hops + 1], names[n_hops + 1:]
    path = [rng.choice(RELATIONS) for _ in range(n_hops)]
    hazards = [draw() for _ in range(n_hops)] + [""]  # the answer carries none
    decoys = [draw() for _ in distractors]
    kind = dict(zip(chain, hazards)) | dict(zip(distractors, decoys))
    surface = {n: _hyphenate(n) if kind[n] == ALIAS else n for n in names}
    return _Cast(names, chain, distractors, path, hazards, kind, surface)


def _draw_record(rng: random.Random, cast: _Cast, name: str,
                 fixed: Mapping[str, str | None], n_facts: int = 2) -> dict[str, Any]:
    """``n_facts`` facts: the relations of ``fixed`` (to their target, or to anyone when None;
    up to two of them), then other relations to anyone."""
    others = [r for r in RELATIONS if r not in fixed]
    rels = list(fixed)[:2] + rng.sample(others, max(0, n_facts - len(fixed)))
    facts = {r: cast.surface[fixed.get(r) or rng.choice([p for p in cast.names if p != name])]
             for r in rels}
    return {"name": name, "facts": dict(rng.sample(sorted(facts.items()), len(facts)))}


def _draw_twin(rng: random.Random, cast: _Cast, i: int, rec: Mapping[str, Any],
               needs: dict[str, dict[str, str | None]]) -> dict[str, Any]:
    """The second record of homonym ``cast.names[i]``: the same relations, other people. On the
    chain, the hop's relation leads to a distractor, which then ``needs`` the next hop's relation,
    so the wrong copy leads on through plausible records instead of stopping at once."""
    name, n_hops = cast.names[i], len(cast.path)
    twin = {}
    for r in rec["facts"]:
        if i < n_hops and r == cast.path[i]:
            wrong = rng.choice(cast.distractors)
            if i + 1 < n_hops:
                needs[wrong].setdefault(cast.path[i + 1], None)
        else:
            wrong = rng.choice([p for p in cast.names if p != name])
        twin[r] = cast.surface[wrong]
    return {"name": name, "facts": twin}


def _draw_records(rng: random.Random, cast: _Cast, n_facts: int = 2
                  ) -> tuple[list[dict[str, Any]], list[int]]:
    """(the knowledge base's records in a shuffled order, per hop which record of the searched
    name is the chain's): one record per person, two for a homonym (in a drawn order)."""
    needs: dict[str, dict[str, str | None]] = {d: {} for d in cast.distractors}
    groups: list[list[dict[str, Any]]] = []
    gold_copy: list[int] = []
    for i, name in enumerate(cast.names):
        on_chain = i < len(cast.path)
        rec = _draw_record(rng, cast, name,
                           {cast.path[i]: cast.chain[i + 1]} if on_chain else needs.get(name, {}),
                           n_facts)
        group = [rec]
        if cast.kind[name] == HOMONYM:
            group.append(_draw_twin(rng, cast, i, rec, needs))
            rng.shuffle(group)
        if on_chain:
            gold_copy.append(group.index(rec))
        groups.append(group)
    rng.shuffle(groups)
    return [r for group in groups for r in group], gold_copy


class SynthChain(SyntheticEnv):
    family = "synth_chain"
    instructions = ("Find the person at the end of the chain with the search tool. Follow the "
                    "relations in order; answer with the last name.")
    sft_split = "sft"
    """The split the tiny policy's supervised warm start draws its traces from."""

    def __init__(self, config: SynthConfig | None = None, options: ChainOptions | None = None):
        """``config``: the seed and split sizes (``difficulty`` is not used, ``mix`` refused);
        ``options``: the generator's parameters."""
        super().__init__(config)
        if self.config.mix:
            raise ValueError("synth_chain: mix is not an option of this family (use chain_hops)")
        self.options = options or ChainOptions()
        self.hops = parse_hops(self.options.chain_hops)
        self.max_turns = max(max(self.hops), HARD_HOPS) + SPARE_TURNS
        self.names = name_list(self.options.chain_syllables)
        # 8 hops at most (parse_hops): 12 people, within even the 16 one-syllable names.

    # ---- generation -----------------------------------------------------------------------
    def make_item(self, rng: random.Random, item_id: str, hard: bool = False) -> TaskItem:
        o = self.options
        if hard:
            n_hops = HARD_HOPS
        else:
            n_hops = rng.choices(list(self.hops), weights=list(self.hops.values()))[0]
        rate = rng.betavariate(o.chain_hazard_a, o.chain_hazard_b)
        rate = min(1.0, rate * HARD_RATE) if hard else rate
        cast = _draw_cast(rng, n_hops, rate, o.chain_alias_share, self.names)
        records, gold_copy = _draw_records(rng, cast, o.chain_facts)
        surface = cast.surface
        directory = sorted(surface[r["name"]] for r in records)
        question = (f"People: {', '.join(directory)}. Start from {surface[cast.chain[0]]} and "
                    f"follow {' > '.join(cast.path)}. Who do you reach?")
        return TaskItem(id=item_id, family=self.family, question=question, gold=cast.chain[-1],
                        meta={"records": records, "chain": cast.chain, "path": cast.path,
                              "hazards": cast.hazards[:n_hops], "copy": gold_copy,
                              "surface": [surface[n] for n in cast.chain], "hops": n_hops,
                              "rate": rate})

    def item_key(self, item: TaskItem) -> str:
        return item.question + json.dumps(item.meta["records"], sort_keys=True)

    def _draw(self, split: str, n: int) -> list[TaskItem]:
        seed, o = self.config.seed, self.options
        return self._draw_items(
            n, "test" if split in ("test", "hard") else "train",
            f"{self.family}:{seed}:{o.chain_hops}:{o.chain_hazard_a}:{o.chain_hazard_b}:"
            f"{o.chain_alias_share}:{split}"
            + (f":facts{o.chain_facts}" if o.chain_facts != 2 else "")
            + (f":syllables{o.chain_syllables}" if o.chain_syllables != 2 else ""),
            f"{self.family}-s{seed}-{split}",
            lambda rng, item_id: self.make_item(rng, item_id, hard=split == "hard"), f"{split} items")

    def load(self, split: str, limit: int | None = None) -> list[TaskItem]:
        """``train``, ``test``, ``hard``, ``sft`` (generated), or a JSONL file written by ``save``."""
        if split not in SPLITS:
            if not split.endswith(".jsonl"):
                raise ValueError(f"{self.family}.load: split must be one of {SPLITS} or a .jsonl "
                                 f"path, got {split!r}")
            return self._load_file(split, limit)
        c = self.config
        n = {"train": self.options.chain_train_items, "sft": c.n_train}.get(split, c.n_test)
        return self._draw(split, n if limit is None else min(limit, n))

    def check_item(self, item: TaskItem) -> None:
        m = item.meta
        records, chain, path = m.get("records"), m.get("chain"), m.get("path")
        need(isinstance(records, list) and all(isinstance(r, dict) and isinstance(r.get("name"), str)
                                               and isinstance(r.get("facts"), dict)
                                               for r in records),
             "meta.records must be a list of {name, facts}")
        need(isinstance(chain, list) and isinstance(path, list) and len(chain) == len(path) + 1,
             "meta.chain must list one person more than meta.path has relations")
        need(isinstance(m.get("hops"), int) and m["hops"] == len(path),
             "meta.hops must equal the number of relations")
        for key in ("hazards", "copy", "surface"):
            need(isinstance(m.get(key), list), f"meta.{key} must be a list")
        need(isinstance(item.gold, str) and item.gold == chain[-1],
             "gold must be the last person of meta.chain")

    # ---- the environment ------------------------------------------------------------------
    def turn_cap(self, item: TaskItem) -> int:
        return int(item.meta["hops"]) + SPARE_TURNS

    def oracle_success(self, item: TaskItem) -> float:
        """0.5 per homonym on the chain (the copies cannot be told apart), times 0 where its
        aliases need more retries than the cap leaves (an agent that retries each alias; the
        expert drops the hyphen there instead)."""
        hazards = item.meta["hazards"]
        fits = hazards.count(ALIAS) <= self.turn_cap(item) - item.meta["hops"] - 1
        return 0.5 ** hazards.count(HOMONYM) * float(fits)

    def tools(self) -> list[dict[str, Any]]:
        return [SEARCH]

    def reset(self, item: TaskItem) -> list[Mapping[str, Any]]:
        # The knowledge base is read-only, so the state is the item's records themselves.
        return item.meta["records"]

    def call_tool(self, state: list[Mapping[str, Any]], name: str,
                  arguments: Mapping[str, Any]) -> str:
        if name != "search":
            raise ToolError(f"unknown tool {name!r}; available: search")
        check_arguments(SEARCH, arguments)
        query = arguments["query"].strip()
        found = [r for r in state if r["name"].lower() == query.lower()]
        if found:
            return " | ".join(f"{r['name']}: " + "; ".join(f"{rel} {obj}" for rel, obj in
                                                           r["facts"].items()) for r in found)
        plain = query.replace("-", "")
        listed = next((r["name"] for r in state if r["name"].lower() == plain.lower()), None)
        if listed is not None and plain != query:
            return f"No entry for {query}. Did you mean {listed}?"
        return f"No entry for {query}."

    def verify(self, item: TaskItem, answer: Any) -> Verdict:
        em = float(_normalise(answer) == _normalise(item.gold))
        return Verdict(reward=em, metrics={"em": em})

    # ---- the expert -----------------------------------------------------------------------
    def expert_actions(self, item: TaskItem) -> list[Action]:
        """Search each person as the text names them; an alias costs a retry under the listed
        name while the turn cap leaves room, else the agent drops the hyphen itself; at a
        homonym, follow the chain's copy."""
        m = item.meta
        spare = self.turn_cap(item) - m["hops"] - 1
        actions = []
        for hazard, surface, name in zip(m["hazards"], m["surface"], m["chain"]):
            if hazard == ALIAS and spare > 0:
                actions.append(Action(kind="tool", tool="search", arguments={"query": surface}))
                spare -= 1
            actions.append(Action(kind="tool", tool="search", arguments={"query": name}))
        return actions + [Action(kind="answer", answer=m["chain"][-1])]


def expert_thoughts(item: TaskItem, actions: Sequence[Action]) -> list[str]:
    """Before each action of a script (the expert's or an imperfect one), the fact it
    follows: "start Kalo" before the first search (restating the question's "Start from
    Kalo"), "owner Miru" before searching Miru on the second hop, "rival Dova" before
    answering Dova after a one-hop chain; nothing before a retry under the listed name (the
    observation just named it). Each query then copies the name just written."""
    path = item.meta["path"]
    thoughts, hop, last = [], 0, None
    for action in actions:
        value = str((action.arguments or {}).get("query", "")) if action.kind == "tool" \
            else str(action.answer)
        retry = action.kind == "tool" and last is not None and last != value \
            and last.replace("-", "") == value
        if retry:
            thoughts.append("")
        elif hop == 0:
            thoughts.append(f"start {value}")
        else:
            thoughts.append(f"{path[min(hop, len(path)) - 1]} {value}")
        hop += action.kind == "tool" and not retry
        last = value if action.kind == "tool" else None
    return thoughts


expert_thoughts.version = 2  # type: ignore[attr-defined]
"""Enters the bootstrap's input hash (``trace_rl.policy.bootstrap.input_hash``): bump it when
the thoughts change, so that a policy trained on the old ones is not reused. 1: no thought before
the first search; 2: "start NAME" there."""
