"""The project's own policy update on 2 gloo ranks (DDP and FSDP2) against one process: the same
gradients and the same weights after the update (within 1e-5). Plain
``torch.multiprocessing``: the Ray trainer group (``trace_rl.cluster.trainer``) runs these same
trainers (``trace_rl.cluster.fsdp.make_trainer``)."""

from __future__ import annotations

import gc
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trace_rl.cluster.fsdp import full, make_trainer
from trace_rl.policy.update import OPTIMIZER_STATE, PathSample, PolicyTrainer, Ranks, UpdateSettings

# Two spawned ranks per test (25-28 s each here, 79 s beside other jobs), after the one-process
# updates of the module fixture.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SETTINGS = {  # 7 paths of 4 trees in micro-batches of 3: 3 micro-batches, rank 0 gets 2 of them
    # (the ranks run different numbers of forwards and backwards: FSDP2 must not all-gather there)
    "one_step": dict(epochs=1, mini_batches=1, micro_batch=3, target_kl=0.0,
                     target_position_kl=0.0, agg="seq-mean-token-sum", learning_rate=1e-3),
    # Two mini-batches of whole trees (4 and 3 paths), each one micro-batch, two epochs, the KL
    # guard on: 4 optimiser steps, in each a rank with no micro-batch (its empty backward), and
    # the guard's decision taken on both ranks' KL. Only the top layer trained: DDP's ranks
    # reuse the frozen trunk's output (UpdateSettings.reuse_trunk), FSDP2 runs the whole model.
    "guarded": dict(epochs=2, mini_batches=2, micro_batch=4, target_kl=1.0,
                    target_position_kl=1.0, agg="token-mean", learning_rate=1e-5,
                    trainable_layers=1),
}
STRATEGIES = ("ddp", "fsdp2")


def _settings(name: str) -> UpdateSettings:
    return UpdateSettings(clip_low=0.2, clip_high=0.28, kl_coef=0.0, **SETTINGS[name])


def _samples(tok) -> list[PathSample]:
    out = []
    for i, a in enumerate([1.0, -1.0, 0.5, -0.5, 0.25, -0.75, 0.6]):
        prompt = tok.encode(f"question {i}?")
        gen = tok.encode(f"<think>step {i} " + "x " * i + f"</think><answer>{i}</answer>")
        obs = tok.encode(" ok")
        ids = prompt + gen + obs
        mask = [0] * len(prompt) + [1] * len(gen) + [0] * len(obs)
        out.append(PathSample(ids, mask, [a * m for m in mask], group=i // 2))
    return out


def _run(trainer: PolicyTrainer) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    stats = trainer.update(_samples(trainer.tokenizer), torch.Generator().manual_seed(3))
    # FSDP2's are DTensor shards: gathered whole (every rank, in the same order).
    grads = {n: full(p.grad).detach().clone() for n, p in trainer.model.named_parameters()
             if p.grad is not None}  # a frozen layer's have none
    weights = {n: full(p).detach().clone() for n, p in trainer.model.named_parameters()}
    return stats, grads, weights


def _rank(rank: int, world: int, port: int, model_dir: str, name: str, out: str,
          one_ckpt: str) -> None:
    """Both strategies, one after the other, on one gloo group (one spawn for both); then FSDP2
    resumed from one process's checkpoint (its AdamW state cut into shards)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for strategy in STRATEGIES:
            trainer = make_trainer(strategy, model_dir, _settings(name), seed=0,
                                   ranks=Ranks(rank, world))
            assert type(trainer).__name__ == {"ddp": "PolicyTrainer",
                                              "fsdp2": "FSDPTrainer"}[strategy]
            assert (trainer.trunk is not None) == (strategy == "ddp" and name == "guarded")
            torch.save(_run(trainer), f"{out}.{strategy}.{rank}")
            if rank == 0 or strategy == "fsdp2":  # FSDP2 gathers the full state on every rank
                trainer.save(f"{out}.{strategy}.ckpt")
            # Drop the DDP model (its Reducer holds the gloo group) while the group is alive:
            # freed at the function's return instead, the group's destructor joins a gloo thread
            # that waits for the GIL this thread holds, and the rank hangs (seen once in a
            # fresh-clone run).
            del trainer
            gc.collect()
        resumed = make_trainer("fsdp2", one_ckpt, _settings(name), seed=0, ranks=Ranks(rank, world))
        torch.save(_run(resumed), f"{out}.resumed.{rank}")
        del resumed
        gc.collect()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkpoint(path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    return (load_file(str(path / "model.safetensors")),
            torch.load(path / OPTIMIZER_STATE, weights_only=True))


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """Per setting: one process's (statistics, gradients, weights), its saved checkpoint (and
    where), and the same of a second update resumed from that checkpoint."""
    out = {}
    for name in SETTINGS:
        trainer = PolicyTrainer(tiny_model_dir, _settings(name), seed=0)
        ckpt = tmp_path_factory.mktemp(f"one_{name}") / "ckpt"
        first = (_run(trainer), _checkpoint(trainer.save(ckpt)))
        out[name] = (first, ckpt, _run(PolicyTrainer(ckpt, _settings(name), seed=0)))
    return out


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_two_gloo_ranks_match_one_process(tiny_model_dir, one_process, tmp_path, name):
    first, ckpt, resumed = one_process[name]
    out = str(tmp_path / "rank")
    mp.start_processes(_rank, args=(2, _free_port(), str(tiny_model_dir), name, out, str(ckpt)),
                       nprocs=2, start_method="spawn")
    for strategy in STRATEGIES:
        _check(tiny_model_dir, first[0], name, f"{out}.{strategy}")
        _check_saved(first[1], f"{out}.{strategy}.ckpt")
    _check(ckpt, resumed, name, f"{out}.resumed")


def _check(model_dir, one, name: str, out: str) -> None:
    """Both ranks' statistics, gradients and weights after the update against one process's."""
    stats1, grads1, weights1 = one
    before = dict(PolicyTrainer(model_dir, _settings(name), seed=0).model.named_parameters())
    for rank in range(2):
        stats, grads, weights = torch.load(f"{out}.{rank}", weights_only=False)
        assert stats["updates"] == stats1["updates"] >= (1 if name == "one_step" else 2)
        for n in grads1:
            assert torch.allclose(grads[n], grads1[n], atol=1e-5, rtol=0), (rank, n)
            assert torch.allclose(weights[n], weights1[n], atol=1e-5, rtol=0), (rank, n)
        for k in ("loss", "grad_norm", "paths_with_signal", "kl_after_step_max", "kl_position_max"):
            if k not in stats1:
                continue
            assert stats[k] == pytest.approx(stats1[k], rel=1e-4, abs=1e-6), k
    # The update moved the weights: the comparison is not between two untouched models.
    assert any(not torch.allclose(weights1[n], p.detach(), atol=1e-5) for n, p in before.items())


def _check_saved(one, ckpt: str) -> None:
    """Rank 0's checkpoint is one process's: full weights, the AdamW moments in the same order
    (a run resumes across strategies and group sizes)."""
    saved_w1, saved_opt1 = one
    saved_w, saved_opt = _checkpoint(Path(ckpt))
    assert saved_w.keys() == saved_w1.keys()
    for k in saved_w1:
        assert torch.allclose(saved_w[k], saved_w1[k], atol=1e-5, rtol=0), k
    assert saved_opt["param_groups"] == saved_opt1["param_groups"]
    assert saved_opt["state"].keys() == saved_opt1["state"].keys()
    for i, s1 in saved_opt1["state"].items():
        for k, v in s1.items():
            assert saved_opt["state"][i][k].shape == v.shape, (i, k)
            assert torch.allclose(saved_opt["state"][i][k], v, atol=1e-5, rtol=0), (i, k)
