"""``synth_lookup``: multi-hop lookup over a knowledge base generated per item.

Each item holds a small KB ``{entity: {relation: entity}}`` and asks for the end of a relation
chain, e.g. "Who is the mentor of the owner of Kalo?". The tool ``search(query)`` returns the
facts whose subject is the queried entity, so the agent must search Kalo, read its owner, search
the owner, read its mentor, and answer. The KB is new for every item, so the chain cannot be
memorised: only the tool use is learnable.

Difficulty d (1..5): d hops (d searches + 1 answer turn), ``min(2 + d // 2, 4)`` relations per
entity (the others are distractors), and d + 1 distractor entities. Reward: exact match of the
answer with the gold entity (case-insensitive, surrounding whitespace and a final period ignored).
"""

from __future__ import annotations

import json
import random
from typing import Any, Mapping

from trace_rl.envs.base import Action, TaskItem, ToolError, Verdict
from trace_rl.envs.synthetic import SynthConfig, SyntheticEnv, check_arguments, function_tool, need

SYLLABLES = ("ka", "lo", "mi", "ru", "te", "vo", "zi", "na", "pe", "sa", "do", "gu", "ba", "fi",
             "ho", "je")
RELATIONS = ("owner", "manager", "friend", "mentor", "rival", "parent")
SEARCH = function_tool("search", "Facts about an entity.", {"query": {"type": "string"}})


def _normalise(text: Any) -> str:
    return str(text).strip().rstrip(".").strip().lower()


class SynthLookup(SyntheticEnv):
    family = "synth_lookup"
    instructions = "Answer the question about people using the search tool."

    def __init__(self, config: SynthConfig | None = None):
        super().__init__(config)
        self.hops = self.config.difficulty
        self.relations_per_entity = min(2 + self.config.difficulty // 2, 4)
        self.distractors = self.config.difficulty + 1
        self.max_turns = self.hops + 3

    def make_item(self, rng: random.Random, item_id: str) -> TaskItem:
        n_entities = self.hops + 1 + self.distractors
        names = rng.sample([(a + b).capitalize() for a in SYLLABLES for b in SYLLABLES], n_entities)
        chain = names[: self.hops + 1]  # the rest are distractors
        path = [rng.choice(RELATIONS) for _ in range(self.hops)]
        kb: dict[str, dict[str, str]] = {name: {} for name in names}
        for i, rel in enumerate(path):
            kb[chain[i]][rel] = chain[i + 1]
        for name in names:
            free = [r for r in RELATIONS if r not in kb[name]]
            for rel in rng.sample(free, self.relations_per_entity - len(kb[name])):
                kb[name][rel] = rng.choice([n for n in names if n != name])
        # Shuffle each entity's facts so the chain relation is not always listed first.
        kb = {name: dict(rng.sample(sorted(facts.items()), len(facts))) for name, facts in kb.items()}
        phrase = " of the ".join(reversed(path))
        return TaskItem(id=item_id, family=self.family,
                        question=f"Who is the {phrase} of {chain[0]}?", gold=chain[-1],
                        meta={"kb": kb, "chain": chain, "path": path})

    def item_key(self, item: TaskItem) -> str:
        # The same question over a different KB is a different problem.
        return item.question + json.dumps(item.meta["kb"], sort_keys=True)

    def check_item(self, item: TaskItem) -> None:
        kb, chain = item.meta.get("kb"), item.meta.get("chain")
        need(isinstance(kb, dict) and all(isinstance(v, dict) for v in kb.values()),
             "meta.kb must map entity -> {relation: entity}")
        need(isinstance(chain, list) and all(c in kb for c in chain),
             "meta.chain must list entities of meta.kb")
        need(isinstance(item.gold, str) and item.gold in kb, "gold must be an entity of meta.kb")

    def tools(self) -> list[dict[str, Any]]:
        return [SEARCH]

    def reset(self, item: TaskItem) -> Mapping[str, Mapping[str, str]]:
        # The KB is read-only, so the state is the item's KB itself.
        return item.meta["kb"]

    def call_tool(self, state: Mapping[str, Mapping[str, str]], name: str,
                  arguments: Mapping[str, Any]) -> str:
        if name != "search":
            raise ToolError(f"unknown tool {name!r}; available: search")
        check_arguments(SEARCH, arguments)
        query = arguments["query"].strip().lower()
        for entity, facts in state.items():
            if entity.lower() == query:
                return f"{entity}: " + "; ".join(f"{rel} {obj}" for rel, obj in facts.items())
        return f"No entry for {arguments['query']!r}."

    def verify(self, item: TaskItem, answer: Any) -> Verdict:
        em = float(_normalise(answer) == _normalise(item.gold))
        return Verdict(reward=em, metrics={"em": em})

    def expert_actions(self, item: TaskItem) -> list[Action]:
        chain = item.meta["chain"]
        return [Action(kind="tool", tool="search", arguments={"query": e}) for e in chain[:-1]] + \
            [Action(kind="answer", answer=chain[-1])]
