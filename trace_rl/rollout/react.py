"""The multi-turn ReAct loop, continuation from stored prefixes, and episode (de)serialisation.

An episode alternates policy turns and tool observations (docs/architecture.md):
generate until the action closes (a stop string of ``format.STOP``), parse it, run the tool,
append the observation, repeat up to the turn cap; a final answer goes to the verifier. Each
``Turn`` is one node of the rollout tree: the depth-t prefix history H_t is ``prompt_ids`` plus the
first t turns' ``gen_ids + obs_ids`` (``Episode.token_ids(t)``).

Batching: every live episode advances one turn per ``engine.generate`` call. The K fresh
continuations of one start share a single request with ``n = K`` for their first generated turn
(so the engine reads the shared prefix once); after that each episode has its own request.

Continuation (Stage 2's "continue K times from its stored history"): a ``Start`` with a stored
prefix re-feeds exactly that prefix's tokens and rebuilds the environment with
``env.restore(item, actions, observations)``. A tool is re-run only where a stored observation is
missing, or, for a stateful family, to replay its effect.

Failure policy (bad input never crashes a batch): an unparseable turn, an unknown tool, bad
arguments or a raising tool give an ``Error: …`` observation and count as a turn; a tool that
outlives ``tool_timeout_s`` gives ``Error: tool timed out after Xs`` and the batch goes on (its
thread is a daemon and is abandoned; a stateful family's state is then rebuilt by replay, since
the abandoned call may still write to the old one). Failed calls are left out when a state is
replayed, so a stateful family's tools must validate before they mutate (a failed call changes
nothing). A turn
that hits ``max_tokens`` before its action closes, or an episode that reaches the turn cap (or
``max_context``) without answering, ends with reward 0.

Ledger per episode: ``prompt_tokens`` = context tokens fed to the engine for this episode's new
turns (before any prefix-cache reuse; a shared first-turn request counts once per episode),
``generated_tokens`` = sampled tokens, ``tool_calls`` = tools run including replays needed to
restore the prefix, ``wall_seconds`` = from the start of ``run_episodes`` to the episode's end.
An episode that ends without an answer carries ``metrics = {"truncated": 1}`` (max_tokens or
max_context) or ``{"turn_cap": 1}``; an answered one carries the verifier's metrics.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from trace_rl.envs.base import Environment, StepResult, TaskItem
from trace_rl.rollout.format import STOP, TurnFormat, parse_action, render_action
from trace_rl.rollout.types import (Action, Completion, Engine, Episode, GenRequest, Ledger,
                                    SamplingSettings, Turn)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Start:
    """Where K episodes begin: an item and, to continue a stored node, its prefix turns."""

    item: TaskItem
    """The task."""
    prefix: Sequence[Turn] = ()
    """Stored turns to continue from (empty = a fresh rollout from the prompt)."""
    k: int = 1
    """Number of episodes (continuations) to sample from this start."""


@dataclass
class _Live:
    """An episode in flight, with its environment state and its full token context."""

    episode: Episode
    item: TaskItem
    state: Any
    ids: list[int]
    start_index: int
    copy_index: int
    cap: int
    """Turn cap of this episode (the loop's, or the item's own where smaller)."""


def _request_seed(seed: int | None, start_index: int, copy_index: int, depth: int) -> int | None:
    """A per-request seed from the run seed and the request's place, so reruns reproduce."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{start_index}:{copy_index}:{depth}".encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "big") & 0x7FFFFFFF


def _timed_out(timeout_s: float) -> StepResult:
    return StepResult(observation=f"Error: tool timed out after {timeout_s:g}s", done=False,
                      tool_called=True, error=True)


def run_steps(jobs: Sequence[Callable[[], StepResult]], timeout_s: float) -> list[StepResult | None]:
    """Run environment steps concurrently, each on a daemon thread, under one shared deadline.

    A step still running at the deadline gives None; its thread is left behind (Python cannot
    kill a thread) and, being a daemon, never blocks interpreter exit.
    """
    results: list[StepResult | None] = [None] * len(jobs)

    def work(i: int, job: Callable[[], StepResult]) -> None:
        try:
            results[i] = job()
        except Exception as exc:  # env.step already catches tool errors; this is the last guard
            results[i] = StepResult(observation=f"Error: {type(exc).__name__}: {exc}", done=False,
                                    tool_called=True, error=True)

    threads = [threading.Thread(target=work, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [None if t.is_alive() else r for r, t in zip(results, threads)]


def _replayable(turn: Turn) -> bool:
    """Whether a replay re-applies this turn's action: failed calls changed nothing."""
    return turn.action.kind == "tool" and not turn.error


def _restore(env: Environment, item: TaskItem, turns: Sequence[Turn]) -> Any:
    ok = [t for t in turns if _replayable(t)]
    return env.restore(item, [t.action for t in ok], [t.obs_text for t in ok])


def _check_prefix(item: TaskItem, prefix: Sequence[Turn], max_turns: int) -> None:
    if len(prefix) >= max_turns:
        raise ValueError(f"item {item.id}: prefix has {len(prefix)} turns; the turn cap is "
                         f"{max_turns}, so nothing can follow it")
    for t, turn in enumerate(prefix):
        if turn.action.kind == "answer":
            raise ValueError(f"item {item.id}: prefix turn {t} is a final answer; a finished "
                             "episode cannot be continued")
        if not turn.gen_ids:
            raise ValueError(f"item {item.id}: prefix turn {t} has no gen_ids; generated text is "
                             "never re-tokenised, so the stored token ids are required")


def _materialise_prefix(env: Environment, item: TaskItem, prefix: Sequence[Turn], fmt: TurnFormat,
                        timeout_s: float) -> tuple[Any, list[Turn], int]:
    """Rebuild the state after ``prefix``: (state, prefix turns with every observation filled in,
    tool calls run). Stored observations are reused; a missing one is recomputed by running its
    action on the state at that point."""
    turns = [copy.deepcopy(t) for t in prefix]
    first_missing = next((i for i, t in enumerate(turns) if t.obs_text is None), len(turns))
    state = _restore(env, item, turns[:first_missing])
    calls = sum(map(_replayable, turns[:first_missing])) if env.stateful else 0
    for t, turn in enumerate(turns[first_missing:], start=first_missing):
        if turn.obs_text is None:
            result = run_steps([lambda a=turn.action: env.step(state, a)], timeout_s)[0]
            if result is None and env.stateful:
                # The abandoned call may still mutate the old state from its thread: start afresh.
                turn.error = True
                state = _restore(env, item, turns[:t + 1])
                calls += sum(map(_replayable, turns[:t + 1]))
            result = result or _timed_out(timeout_s)
            turn.obs_text, turn.tool_called, turn.error = result.observation, result.tool_called, result.error
            turn.obs_ids = []
            calls += int(result.tool_called)
        elif env.stateful and _replayable(turn):
            env.step(state, turn.action)
            calls += 1
    for turn in turns:
        if not turn.obs_ids:
            # Observations are not sampled, so tokenising them anew keeps the layout exact.
            turn.obs_ids = fmt.obs_ids(turn.obs_text or "", turn.gen_ids)
    return state, turns, calls


def run_episodes(engine: Engine, env: Environment, starts: Sequence[Start], *,
                 sampling: SamplingSettings = SamplingSettings(), max_turns: int | None = None,
                 tool_timeout_s: float = 10.0, seed: int | None = None,
                 max_context: int | None = None) -> list[Episode]:
    """Roll out ``k`` episodes per start to termination; returns them start by start, K each.

    ``sampling.stop`` is extended with the turn format's stop strings. ``max_turns`` (default
    ``env.max_turns``) caps the depth including prefix turns, as does an item's own cap
    (``env.turn_cap``) where it is smaller. ``seed`` derives a per-request seed
    from (start, copy, depth). ``max_context`` caps prompt + all turns in tokens (the policy's
    context window); a turn's ``max_tokens`` shrinks to fit it.
    """
    loop = _Rollout(engine, env, sampling, tool_timeout_s, seed, max_context)
    episodes, groups = loop.begin(starts, max_turns if max_turns is not None else env.max_turns)
    # The first round holds one group request per start (n = K); later rounds one per episode.
    rounds: list[list[_Live]] = groups
    while rounds:
        batch = loop.requests(rounds)
        if not batch:
            break
        outputs = engine.generate([req for _, req in batch])
        if len(outputs) != len(batch) or any(len(o) != req.n for o, (_, req) in zip(outputs, batch)):
            raise RuntimeError(f"engine {engine.name} returned {[len(o) for o in outputs]} "
                               f"completions for requests with n={[r.n for _, r in batch]}")
        pending = loop.take_turns(batch, outputs)
        loop.run_tools(pending)
        rounds = [[live] for live, _ in pending]
    return episodes


class _Rollout:
    """The state of one ``run_episodes`` call: its engine, environment, turn format, sampling
    settings and clock, and the steps of a round (requests, turns taken, tools run)."""

    def __init__(self, engine: Engine, env: Environment, sampling: SamplingSettings,
                 tool_timeout_s: float, seed: int | None, max_context: int | None):
        self.t0 = time.monotonic()
        self.env, self.tool_timeout_s, self.seed, self.max_context = env, tool_timeout_s, seed, max_context
        self.fmt = TurnFormat(engine.tokenizer)
        self.sampling = replace(sampling, stop=tuple(dict.fromkeys((*sampling.stop, *STOP))))

    def begin(self, starts: Sequence[Start], cap: int) -> tuple[list[Episode], list[list[_Live]]]:
        """(the episodes, start by start, K each; per start its K live episodes): each start's
        prefix checked and materialised, its state rebuilt once per further copy."""
        env = self.env
        prompts: dict[str, list[int]] = {}
        episodes: list[Episode] = []
        groups: list[list[_Live]] = []
        for si, start in enumerate(starts):
            if start.k < 1:
                raise ValueError(f"start {si} (item {start.item.id}): k={start.k} must be >= 1")
            item = start.item
            item_cap = min(cap, env.turn_cap(item) or cap)
            _check_prefix(item, start.prefix, item_cap)
            if item.id not in prompts:
                prompts[item.id] = self.fmt.prompt_ids(env.system_prompt(), env.user_prompt(item))
            state, prefix, calls = _materialise_prefix(env, item, start.prefix, self.fmt,
                                                       self.tool_timeout_s)
            group = []
            for j in range(start.k):
                if j > 0:
                    state = _restore(env, item, prefix)
                    calls = sum(map(_replayable, prefix)) if env.stateful else 0
                ep = Episode(item_id=item.id, prompt_ids=list(prompts[item.id]),
                             turns=copy.deepcopy(prefix), prefix_turns=len(prefix),
                             ledger=Ledger(tool_calls=calls, trajectories=1))
                episodes.append(ep)
                group.append(_Live(ep, item, state, ep.token_ids(), si, j, item_cap))
            groups.append(group)
        return episodes, groups

    def finish(self, live: _Live, reward: float, metrics: Mapping[str, float]) -> None:
        ep = live.episode
        ep.done, ep.reward, ep.metrics = True, float(reward), dict(metrics)
        ep.ledger.wall_seconds = time.monotonic() - self.t0

    def room(self, live: _Live) -> int:
        """Tokens the next turn of ``live`` may take (its context window's room)."""
        return self.sampling.max_tokens if self.max_context is None else \
            min(self.sampling.max_tokens, self.max_context - len(live.ids))

    def requests(self, rounds: list[list[_Live]]) -> list[tuple[list[_Live], GenRequest]]:
        """One request per target (a start's K episodes, or one episode); a target whose context
        window is full ends unanswered (``truncated``) instead."""
        batch = []
        for target in rounds:
            if self.room(target[0]) <= 0:  # the context window is full: no answer can follow
                for live in target:
                    self.finish(live, 0.0, {"truncated": 1.0})
                continue
            first = target[0]
            depth = len(first.episode.turns)
            req_seed = _request_seed(self.seed, first.start_index,
                                     -1 if len(target) > 1 else first.copy_index, depth)
            s = replace(self.sampling, max_tokens=self.room(first),
                        seed=req_seed if self.seed is not None else self.sampling.seed)
            batch.append((target, GenRequest(prompt_ids=tuple(first.ids), n=len(target), sampling=s,
                                             affinity=first.item.id)))
        return batch

    def take_turns(self, batch: list[tuple[list[_Live], GenRequest]],
                   outputs: Sequence[Sequence[Completion]]) -> list[tuple[_Live, Turn]]:
        """Append each completion as a turn; grade an answer, end a turn cut at ``max_tokens`` or
        an episode at its turn cap. Returns the (episode, turn) pairs whose tool is to run."""
        pending: list[tuple[_Live, Turn]] = []
        for (target, req), completions in zip(batch, outputs):
            for live, comp in zip(target, completions):
                live.episode.ledger.prompt_tokens += len(req.prompt_ids)
                live.episode.ledger.generated_tokens += len(comp.token_ids)
                turn = _new_turn(comp)
                live.episode.turns.append(turn)
                live.ids += turn.gen_ids
                if turn.action.kind == "answer":
                    self.finish(live, *_grade(self.env, live, turn.action))
                elif comp.finish_reason == "length":
                    turn.action = Action(kind="invalid", error="turn hit max_tokens before its "
                                         "action closed")
                    turn.error = True
                    self.finish(live, 0.0, {"truncated": 1.0})
                elif len(live.episode.turns) >= live.cap:
                    self.finish(live, 0.0, {"turn_cap": 1.0})  # its tool is not run: nothing follows
                else:
                    pending.append((live, turn))
        return pending

    def run_tools(self, pending: list[tuple[_Live, Turn]]) -> None:
        """Run the pending turns' tools concurrently and append their observations; a stateful
        family's state is rebuilt by replay after a timed-out call."""
        env, timeout_s = self.env, self.tool_timeout_s
        results = run_steps([lambda lv=lv, t=t: env.step(lv.state, t.action) for lv, t in pending],
                            timeout_s)
        for (live, turn), result in zip(pending, results):
            timed_out = result is None
            result = result or _timed_out(timeout_s)
            turn.obs_text = result.observation or ""
            turn.obs_ids = self.fmt.obs_ids(turn.obs_text, turn.gen_ids)
            turn.tool_called, turn.error = result.tool_called, result.error
            live.episode.ledger.tool_calls += int(result.tool_called)
            live.ids += turn.obs_ids
            if timed_out and env.stateful:
                # The abandoned call may still mutate the old state from its thread: start afresh.
                live.state = _restore(env, live.item, live.episode.turns)
                live.episode.ledger.tool_calls += sum(map(_replayable, live.episode.turns))


def _new_turn(comp: Completion) -> Turn:
    """The turn holding exactly the engine's tokens; its action is parsed from the engine's text."""
    action = parse_action(comp.text)
    return Turn(gen_ids=list(comp.token_ids), gen_logprobs=list(comp.logprobs), text=comp.text,
                action=action, obs_text=None, obs_ids=[], error=action.kind == "invalid")


def _grade(env: Environment, live: _Live, action: Action) -> tuple[float, Mapping[str, float]]:
    try:
        verdict = env.verify_final(live.item, live.state, action.answer)
    except Exception:  # a verifier choking on odd model output must not end the batch
        log.exception("verifier of %s failed on item %s", env.family, live.item.id)
        return 0.0, {"verify_error": 1.0}
    return verdict.reward, verdict.metrics


def continue_from(engine: Engine, env: Environment, item: TaskItem, prefix_turns: Sequence[Turn],
                  k: int, **kwargs: Any) -> list[Episode]:
    """Sample ``k`` continuations of the stored node ``prefix_turns`` of ``item`` to termination
    (``kwargs`` as for ``run_episodes``). Each returned episode starts with copies of the prefix."""
    return run_episodes(engine, env, [Start(item, tuple(prefix_turns), k)], **kwargs)


def expert_episode(env: Environment, item: TaskItem, tokenizer: Any,
                   thoughts: Sequence[str] | None = None) -> Episode:
    """The gold solution of ``item`` as an episode in the turn format (for SFT traces and tests).

    Turn texts are written by hand, so here (only) they are tokenised; they have no engine
    log-probs (NaN). Tools really run and the answer is really graded.
    """
    fmt = TurnFormat(tokenizer)
    actions = list(env.expert_actions(item))
    thoughts = list(thoughts) if thoughts is not None else [""] * len(actions)
    if len(thoughts) != len(actions):
        raise ValueError(f"expert_episode: {len(thoughts)} thoughts for {len(actions)} actions")
    state = env.reset(item)
    ep = Episode(item_id=item.id, prompt_ids=fmt.prompt_ids(env.system_prompt(), env.user_prompt(item)),
                 turns=[], ledger=Ledger(trajectories=1))
    for action, thought in zip(actions, thoughts):
        text = render_action(action, thought)
        ids = fmt.turn_ids(text)
        turn = Turn(gen_ids=ids, gen_logprobs=[float("nan")] * len(ids), text=text, action=action,
                    obs_text=None, obs_ids=[])
        ep.turns.append(turn)
        ep.ledger.generated_tokens += len(ids)
        if action.kind == "answer":
            verdict = env.verify_final(item, state, action.answer)
            ep.done, ep.reward, ep.metrics = True, verdict.reward, dict(verdict.metrics)
            break
        result = env.step(state, action)
        turn.obs_text, turn.tool_called, turn.error = result.observation, result.tool_called, result.error
        turn.obs_ids = fmt.obs_ids(result.observation or "")
        ep.ledger.tool_calls += int(result.tool_called)
    return ep


def turn_to_json(turn: Turn) -> dict[str, Any]:
    """A JSON-ready dict of one turn (what a DuckDB node row stores)."""
    return {"text": turn.text, "action": turn.action.to_json(), "obs_text": turn.obs_text,
            "gen_ids": list(turn.gen_ids), "gen_logprobs": list(turn.gen_logprobs),
            "obs_ids": list(turn.obs_ids), "tool_called": turn.tool_called, "error": turn.error}


def turn_from_json(d: Mapping[str, Any]) -> Turn:
    return Turn(gen_ids=list(d["gen_ids"]), gen_logprobs=[float(x) for x in d["gen_logprobs"]],
                text=d["text"], action=Action.from_json(d["action"]), obs_text=d.get("obs_text"),
                obs_ids=list(d.get("obs_ids") or []), tool_called=bool(d.get("tool_called", False)),
                error=bool(d.get("error", False)))


def episode_to_json(ep: Episode) -> dict[str, Any]:
    return {"item_id": ep.item_id, "prompt_ids": list(ep.prompt_ids),
            "turns": [turn_to_json(t) for t in ep.turns], "done": ep.done, "reward": ep.reward,
            "metrics": dict(ep.metrics), "prefix_turns": ep.prefix_turns,
            "ledger": {"prompt_tokens": ep.ledger.prompt_tokens,
                       "generated_tokens": ep.ledger.generated_tokens,
                       "tool_calls": ep.ledger.tool_calls, "wall_seconds": ep.ledger.wall_seconds,
                       "trajectories": ep.ledger.trajectories}}


def episode_from_json(d: Mapping[str, Any]) -> Episode:
    return Episode(item_id=d["item_id"], prompt_ids=list(d["prompt_ids"]),
                   turns=[turn_from_json(t) for t in d["turns"]], done=bool(d["done"]),
                   reward=d.get("reward"), metrics=dict(d.get("metrics") or {}),
                   ledger=Ledger(**d.get("ledger", {})), prefix_turns=int(d.get("prefix_turns", 0)))
