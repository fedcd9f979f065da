"""trace_rl.integrations.trl: TRL's rollout_func and reward function on a family (the tiny policy
on synth_arith), and the GRPOConfig it derives from a TrainConfig."""

from __future__ import annotations

import importlib.util

import pytest

from trace_rl.config import TrainConfig
from trace_rl.envs.registry import make_env
from trace_rl.integrations.trl import Rollouts, grpo_config


class _Trainer:
    """What the rollout function reads of TRL's trainer: its model's weights."""

    def __init__(self, policy):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(policy)


def test_rollouts_give_trl_aligned_completions_and_the_loops_rewards(tiny_model_dir):
    """Each prompt repeated K times is one start of K episodes; every completion's ids, logprobs
    and env_mask are aligned, the mask counts exactly the generated tokens, and the family's
    grader as TRL's reward function agrees with the reward the ReAct loop gave."""
    cfg = TrainConfig(family="synth_arith", max_turns=2, max_new_tokens=16, temperature=1.0)
    env = make_env("synth_arith", difficulty=1)
    items = {it.id: it for it in env.load("train", limit=2)}
    rollouts = Rollouts(cfg, str(tiny_model_dir), env, items, seed=0)
    prompts = [q for q in rollouts.questions for _ in range(3)]
    out = rollouts(prompts, _Trainer(tiny_model_dir))
    assert len(out["completion_ids"]) == len(prompts) and rollouts.calls == 1
    for ids, lp, mask in zip(out["completion_ids"], out["logprobs"], out["env_mask"]):
        assert len(ids) == len(lp) == len(mask) > 0 and set(mask) <= {0, 1}
    assert sum(sum(m) for m in out["env_mask"]) == rollouts.generated_tokens > 0
    reward = rollouts.reward(prompts, out["completion_ids"], **{k: out[k] for k in
                                                               ("answer", "answered", "episode_reward")})
    assert reward == out["episode_reward"] and rollouts.reward_mismatches == 0
    assert all(r == 0.0 for r, ok in zip(reward, out["answered"]) if not ok)
    # the grader on answers: the gold is right, a wrong answer or none scores 0, and a reward
    # that differs from the loop's is counted
    q = rollouts.questions[0]
    gold = str(items[next(iter(items))].gold)
    assert rollouts.reward([q] * 3, [[]] * 3, answer=[gold, gold + "1", None],
                           answered=[True, True, False], episode_reward=[1.0, 1.0, 0.0]) == [1.0, 0.0, 0.0]
    assert rollouts.reward_mismatches == 1


def test_a_stateful_family_is_rewarded_as_its_episodes_were_graded(tiny_model_dir):
    """Function calling grades the final state (the calls made), which a reward function does
    not see: the rollout's episodes run on the family as on any other, and TRL's reward is the
    one the loop gave each, whatever the answer text (a re-grade of the text alone would give
    the answerless first 0 and could not give the second its 0)."""
    env = make_env("synth_fncall", difficulty=1)
    items = {it.id: it for it in env.load("train", limit=2)}
    cfg = TrainConfig(family="synth_fncall", max_turns=2, max_new_tokens=16, temperature=1.0)
    rollouts = Rollouts(cfg, str(tiny_model_dir), env, items, seed=0)
    prompts = [q for q in rollouts.questions for _ in range(2)]
    out = rollouts(prompts, _Trainer(tiny_model_dir))
    assert len(out["episode_reward"]) == len(prompts)
    assert rollouts.reward(prompts, out["completion_ids"], answer=out["answer"],
                           answered=out["answered"], episode_reward=out["episode_reward"]) \
        == out["episode_reward"]
    q = rollouts.questions[0]
    gold = items[next(iter(items))].gold
    assert rollouts.reward([q, q], [[], []], answer=[None, gold], answered=[False, True],
                           episode_reward=[1.0, 0.0]) == [1.0, 0.0]


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed "
                    "(the optional extra: pip install -e .[peers] -c requirements/cpu-constraints.txt)")
def test_grpo_config_carries_the_train_config(tmp_path):
    cfg = TrainConfig(steps=3, ppo_epochs=2, group_size=4, learning_rate=2e-5)
    args = grpo_config(cfg, seed=7, out_dir=tmp_path)
    assert (args.max_steps, args.num_iterations, args.num_generations) == (6, 2, 4)
    assert (args.learning_rate, args.seed, args.beta) == (2e-5, 7, cfg.kl_coef)
    assert args.per_device_train_batch_size == cfg.leaf_budget
    assert (args.epsilon, args.epsilon_high) == (cfg.clip_low, cfg.clip_high)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed "
                    "(the optional extra: pip install -e .[peers] -c requirements/cpu-constraints.txt)")
def test_trl_trains_the_layers_the_train_flow_trains(tiny_model_dir, tmp_path):
    """``trainable_layers`` reaches TRL's model: the same top layers trainable, the rest frozen
    (else TRL would update every parameter where the train flow updates a few layers)."""
    from trace_rl.integrations.trl import grpo_trainer

    env = make_env("synth_arith", difficulty=1)
    items = {it.id: it for it in env.load("train", limit=2)}
    cfg = TrainConfig(family="synth_arith", trainable_layers=1, group_size=2, root_budget=2,
                      multiplier=1)
    trainer = grpo_trainer(cfg, str(tiny_model_dir), Rollouts(cfg, str(tiny_model_dir), env, items,
                                                              seed=0), tmp_path)
    layers = trainer.model.model.layers
    assert all(p.requires_grad for p in layers[-1].parameters())
    assert not any(p.requires_grad for layer in layers[:-1] for p in layer.parameters())
    assert not trainer.model.model.embed_tokens.weight.requires_grad

