"""``ScriptedEngine``: a test double of the rollout ``Engine`` whose turns are written by a Python
function instead of sampled from a model.

It exists to test the ReAct loop (parsing, tools, errors, prefixes) with exactly chosen outputs.
It tokenises its scripted texts with a real tokenizer and honours stop strings and ``max_tokens``
the way the real engines do (stop string kept, ``finish_reason`` "stop" or "length"), and records
every request it receives so tests can check the exact tokens fed.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from trace_rl.rollout.types import Completion, GenRequest

Respond = Callable[[str, int], str]
"""(decoded context, copy index within the request) -> the turn's text."""


class ScriptedEngine:
    name = "scripted"

    def __init__(self, tokenizer: Any, respond: Respond):
        self._tokenizer = tokenizer
        self.respond = respond
        self.requests: list[GenRequest] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def _complete(self, req: GenRequest, j: int) -> Completion:
        context = self._tokenizer.decode(list(req.prompt_ids), skip_special_tokens=False)
        text = self.respond(context, j)
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
        raise NotImplementedError("ScriptedEngine has no weights")

    def close(self) -> None:
        pass
