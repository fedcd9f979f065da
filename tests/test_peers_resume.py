"""bench.peers' TRL run resumes: a BFCL seed of TRL's GRPOTrainer takes about three hours here,
longer than the sessions that run it, so it checkpoints after every RL step and a rerun on the
same settings goes on from there. A run stopped after its second step and started again gives
the uninterrupted run's tokens, evaluated weights and accuracies (the tiny policy, synth_arith)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not "
                                "installed (pip install -e .[peers] -c requirements/cpu-constraints.txt)")

BASE = {"family": "synth_arith", "difficulty": 1, "steps": 3, "root_budget": 4, "multiplier": 1,
        "group_size": 4, "pool_size": 8, "engine": "hf", "eval_items": 0, "max_turns": 2,
        "max_new_tokens": 16, "ppo_epochs": 2, "temperature": 1.0, "plot_every": 0,
        "extra": {"n_test": 8}}
EV = {"eval_items": 4, "eval_skip": 0, "eval_samples": 1, "eval_temperature": 1.0}


class Killed(Exception):
    pass


def test_a_stopped_trl_run_goes_on_from_its_last_rl_step(tiny_model_dir, tmp_path, monkeypatch):
    from bench.peers import RESUME, _resumable, run_trl
    from trace_rl.integrations.trl import Rollouts

    policy = str(tiny_model_dir)
    whole = run_trl(0, BASE, policy, tmp_path / "whole", [1, 2], 0.0, **EV)

    calls = Rollouts.__call__

    def stopped_at_the_third_step(self, prompts, trainer):
        if self.calls == 2:  # the third RL step's rollouts: the second step's checkpoint is saved
            raise Killed("stopped")
        return calls(self, prompts, trainer)

    monkeypatch.setattr(Rollouts, "__call__", stopped_at_the_third_step)
    with pytest.raises(Killed):
        run_trl(0, BASE, policy, tmp_path / "parts", [1, 2], 0.0, **EV)
    monkeypatch.undo()
    out_dir = tmp_path / "parts" / "trl_grpo-s0"
    checkpoint, kept = _resumable(out_dir, "settings of another run")
    assert checkpoint is None and kept == {}              # another run's settings: a new run
    assert (out_dir / "checkpoint-4" / RESUME).exists()   # 2 RL steps x 2 PPO epochs

    parts = run_trl(0, BASE, policy, tmp_path / "parts", [1, 2], 0.0, **EV)
    assert (whole.extra["resumed"], parts.extra["resumed"]) == (0, 1)
    assert parts.generated_tokens == whole.generated_tokens > 0
    assert parts.eval_tokens == whole.eval_tokens
    assert parts.accuracy == whole.accuracy
    assert len(parts.extra["step_s"]) == 3 and parts.wall_s > 0
    for step in (1, 2):
        a = load_file(tmp_path / "whole" / "trl_grpo-s0" / f"step-{step}" / "model.safetensors")
        b = load_file(out_dir / f"step-{step}" / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    assert not list(out_dir.glob("checkpoint-*"))          # evaluated: the resumable state goes
