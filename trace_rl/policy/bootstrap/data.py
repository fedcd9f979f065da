"""The bootstrap's training data: expert traces of a synthetic family, a share of them made
imperfect on purpose (``CORRUPTIONS``), with the family's expert thoughts (``family_thoughts``:
those it registered), rendered in the turn format as SFT examples; and the text the family's
tokenizer is trained on."""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator, Sequence

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.envs.registry import Thoughts, spec
from trace_rl.policy.bootstrap.config import BootstrapConfig
from trace_rl.policy.sft import SFTExample, ScriptedEnv, episode_example
from trace_rl.rollout.format import render_action
from trace_rl.rollout.react import expert_episode
from trace_rl.rollout.types import Action

Corruption = Callable[[list[Action], list[Action], random.Random], "list[Action] | None"]
"""(expert actions of the item, expert actions of a donor item, rng) -> imperfect actions, or
None where the corruption would not change this item's trace."""


def _tools(actions: Sequence[Action]) -> list[Action]:
    return [a for a in actions if a.kind == "tool"]


def wrong_final(own: list[Action], donor: list[Action], rng: random.Random) -> list[Action] | None:
    """All the right calls, then another item's answer (a plausible value of the right type)."""
    if str(donor[-1].answer) == str(own[-1].answer):
        return None  # e.g. function calling, whose answer is always "done"
    return _tools(own) + [donor[-1]]


def stop_early(own: list[Action], donor: list[Action], rng: random.Random) -> list[Action] | None:
    """Only the first j < n calls, then another item's answer: the agent quits too soon."""
    calls = _tools(own)
    if not calls:
        return None
    return calls[:rng.randrange(len(calls))] + [donor[-1]]


def wrong_step(own: list[Action], donor: list[Action], rng: random.Random) -> list[Action] | None:
    """One call's arguments swapped for a donor's call to the same tool; the rest unchanged (the
    real environment decides whether the slip still ends in success)."""
    calls = _tools(own)
    slots = [(i, d) for i, a in enumerate(calls) for d in _tools(donor)
             if d.tool == a.tool and dict(d.arguments or {}) != dict(a.arguments or {})]
    if not slots:
        return None
    i, d = rng.choice(slots)
    return calls[:i] + [d] + calls[i + 1:] + [own[-1]]


CORRUPTIONS: dict[str, Corruption] = {"wrong_final": wrong_final, "stop_early": stop_early,
                                      "wrong_step": wrong_step}
"""The registry of imperfect-trace generators; one is drawn uniformly among those that apply."""


def no_thoughts(item: TaskItem, actions: Sequence[Action]) -> list[str]:
    return [""] * len(actions)


def family_thoughts(family: str) -> Thoughts:
    """The expert thoughts ``family`` registered (``Bootstrap.thoughts``), else none."""
    recipe = spec(family).bootstrap
    return recipe.thoughts if recipe is not None and recipe.thoughts is not None else no_thoughts


def trace_actions(env: Environment, items: Sequence[TaskItem], noise: float,
                  rng: random.Random) -> Iterator[tuple[TaskItem, list[Action], str]]:
    """Per item: (item, action script, kind), kind ``expert`` or the corruption's name."""
    for item in items:
        own = list(env.expert_actions(item))
        if rng.random() >= noise:
            yield item, own, "expert"
            continue
        donor = list(env.expert_actions(items[rng.randrange(len(items))]))
        options = [(name, fn(own, donor, rng)) for name, fn in CORRUPTIONS.items()]
        options = [(name, acts) for name, acts in options if acts is not None]
        if not options:
            yield item, own, "expert"
            continue
        name, acts = options[rng.randrange(len(options))]
        yield item, acts, name


def tokenizer_texts(env: Environment, items: Sequence[TaskItem]) -> list[str]:
    """The family's text as the policy will see it: system prompt, question, each expert turn and
    each observation, plus the chat role names the template writes around them."""
    texts = ["system\n", "user\n", "assistant\n", "tool\n"]
    for item in items:
        texts += [env.system_prompt(), env.user_prompt(item)]
        state = env.reset(item)
        for action in env.expert_actions(item):
            texts.append(render_action(action))
            result = env.step(state, action)
            if result.observation:
                texts.append(result.observation)
    return texts


def write_examples(config: BootstrapConfig, env: Environment, train: Sequence[TaskItem],
                   tokenizer: Any, rng: random.Random, thoughts: Thoughts | None = None
                   ) -> tuple[list[SFTExample], dict[str, int], dict[str, float]]:
    """(SFT examples, traces per kind, mean reward per kind) of ``train``: per item the expert
    trace or, for a share ``config.noise``, an imperfect one (``trace_actions``), really run and
    graded by ``expert_episode`` with the family's expert thoughts (or ``thoughts``, for an
    experiment with other ones: ``studies.chain_sft``)."""
    think = thoughts or family_thoughts(config.family)
    examples, kinds, rewards = [], {}, {}
    for item, actions, kind in trace_actions(env, train, config.noise, rng):
        ep = expert_episode(ScriptedEnv(env, actions), item, tokenizer,
                            thoughts=think(item, actions))
        examples.append(episode_example(ep))
        kinds[kind] = kinds.get(kind, 0) + 1
        rewards[kind] = rewards.get(kind, 0.0) + float(ep.reward or 0.0)
    return examples, kinds, {k: rewards[k] / kinds[k] for k in kinds}


def turn_budget(env: Environment, train: Sequence[TaskItem], tokenizer: Any) -> int:
    """Token cap of a measured turn: room for a turn somewhat longer than any expert turn of the
    first 50 training items, without letting junk run on."""
    longest_turn = max(len(t.gen_ids) for item in train[:50]
                       for t in expert_episode(env, item, tokenizer).turns)
    return 2 * longest_turn + 8
