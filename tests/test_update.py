"""The CPU policy update: gradient accumulation over micro-batches, mini-batch steps, direction."""

from __future__ import annotations

import torch

import json
import math

import pytest

from trace_rl.policy.update import (
    PathSample,
    PolicyTrainer,
    UpdateSettings,
    _pad,
    position_kl,
    token_logprobs,
    warmup_scale,
)


def _samples(tok, advantages):
    out = []
    for i, a in enumerate(advantages):
        prompt = tok.encode(f"question {i}?")
        gen = tok.encode(f"<think>step {i}</think><answer>{i}</answer>")
        obs = tok.encode(" ok")
        ids = prompt + gen + obs
        mask = [0] * len(prompt) + [1] * len(gen) + [0] * len(obs)
        out.append(PathSample(ids, mask, [a * m for m in mask]))
    return out


def _settings(**kw):
    base = dict(learning_rate=1e-3, clip_low=0.2, clip_high=0.28, kl_coef=0.0, epochs=1,
                micro_batch=4, agg="seq-mean-token-mean", mini_batches=1, target_kl=0.0,
                target_position_kl=0.0)
    return UpdateSettings(**{**base, **kw})


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_accumulated_micro_batches_equal_one_big_batch(tiny_model_dir):
    for agg in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum"):
        whole = PolicyTrainer(tiny_model_dir, _settings(micro_batch=4, agg=agg))
        split = PolicyTrainer(tiny_model_dir, _settings(micro_batch=1, agg=agg))
        for t in (whole, split):  # plain SGD: Adam would magnify float-rounding gradients
            t.optimizer = torch.optim.SGD(t.model.parameters(), lr=0.1)
        samples = _samples(whole.tokenizer, [1.0, -1.0, 0.5, -0.25])
        sw = whole.update(samples, torch.Generator().manual_seed(0))
        ss = split.update(samples, torch.Generator().manual_seed(0))
        assert sw["updates"] == ss["updates"] == 1.0
        assert torch.allclose(_flat(whole.model), _flat(split.model), atol=1e-6), agg
        assert not torch.equal(_flat(whole.model), _flat(PolicyTrainer(tiny_model_dir, _settings()).model))


def test_mini_batches_set_the_number_of_optimiser_steps(tiny_model_dir):
    trainer = PolicyTrainer(tiny_model_dir, _settings(micro_batch=1, mini_batches=2, epochs=2))
    stats = trainer.update(_samples(trainer.tokenizer, [1.0, -1.0, 0.5, -0.5]),
                           torch.Generator().manual_seed(0))
    assert stats["updates"] == 4.0 and stats["paths_with_signal"] == 4.0


def test_update_moves_probability_toward_positive_advantage(tiny_model_dir):
    trainer = PolicyTrainer(tiny_model_dir, _settings(learning_rate=3e-3))
    samples = _samples(trainer.tokenizer, [1.0, -1.0])

    def seq_logp():
        b = _pad(samples, trainer.pad_id)
        with torch.no_grad():
            lp = token_logprobs(trainer.model, b["ids"], b["attn"])
        return (lp * b["mask"]).sum(dim=1)

    before = seq_logp()
    for step in range(3):
        trainer.update(samples, torch.Generator().manual_seed(step))
    after = seq_logp()
    assert after[0] > before[0] and after[1] < before[1]


def test_paths_without_signal_change_nothing(tiny_model_dir):
    trainer = PolicyTrainer(tiny_model_dir, _settings())
    before = _flat(trainer.model).clone()
    stats = trainer.update(_samples(trainer.tokenizer, [0.0, 0.0]), torch.Generator().manual_seed(0))
    assert stats["paths_with_signal"] == 0.0 and "updates" not in stats
    assert torch.equal(before, _flat(trainer.model))


def test_a_resumed_optimiser_takes_the_configured_learning_rate(tiny_model_dir, tmp_path):
    first = PolicyTrainer(tiny_model_dir, _settings(learning_rate=1e-3))
    first.update(_samples(first.tokenizer, [1.0, -1.0]), torch.Generator().manual_seed(0))
    saved = first.save(tmp_path / "ckpt")
    resumed = PolicyTrainer(saved, _settings(learning_rate=2e-4))
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [2e-4]
    assert resumed.optimizer.state  # the moments came back with it


def test_trust_region_guard_undoes_an_overshooting_step(tiny_model_dir):
    samples = None
    for target in (1e-6, 1e9):  # a bound every step overshoots / one no step reaches
        trainer = PolicyTrainer(tiny_model_dir, _settings(learning_rate=5e-2, micro_batch=1,
                                                          mini_batches=2, target_kl=target))
        samples = samples or _samples(trainer.tokenizer, [1.0, -1.0, 0.5, -0.5])
        before = _flat(trainer.model).clone()
        stats = trainer.update(samples, torch.Generator().manual_seed(0))
        assert stats["kl_after_step_max"] > 1e-6
        assert stats["kl_token_max"] >= stats["kl_after_step_max"]  # a max over tokens >= their mean
        if target < 1:  # the first step is undone, weights and AdamW moments alike
            assert stats["kl_stopped"] == 1.0 and stats["updates"] == 0.0
            assert torch.equal(before, _flat(trainer.model))
            assert not trainer.optimizer.state
        else:
            assert stats["kl_stopped"] == 0.0 and stats["updates"] == 2.0
            assert not torch.equal(before, _flat(trainer.model))


def _with_engine_logprobs(trainer, samples, shift):
    """``samples`` carrying engine log-probs: the trainer's own for each sampled token, plus
    ``shift(b, t)`` (the engine's disagreement) at policy token t of path b."""
    b = _pad(samples, trainer.pad_id)
    with torch.no_grad():  # computed as the trainer computes it: packed where it packs
        lp = token_logprobs(trainer.model, b["ids"], b["attn"], packed=trainer._packing(samples, b))
    out = []
    for i, x in enumerate(samples):
        pol = [t for t, m in enumerate(x.loss_mask) if m]
        eng = [float(lp[i, t]) + (shift(i, pol.index(t)) if m else 0.0) if m else 0.0
               for t, m in enumerate(x.loss_mask)]
        out.append(PathSample(x.token_ids, x.loss_mask, x.advantages, engine_logprobs=eng))
    return out


def test_the_update_measures_the_engine_mismatch_and_truncates_importance_weights(tiny_model_dir):
    """The engine agrees with the trainer on every token but the first policy token of path 0,
    where it put 0.3 more log-probability: the mismatch is that token's alone, and with TIS on
    exactly that token is weighted below 1 (by exp(-0.3)), the rest at 1."""
    trainer = PolicyTrainer(tiny_model_dir, _settings(tis_cap=2.0))
    base = _samples(trainer.tokenizer, [1.0, -1.0, 0.5])
    n_policy = sum(sum(x.loss_mask) for x in base)
    agree = _with_engine_logprobs(trainer, base, lambda b, t: 0.0)
    shifted = _with_engine_logprobs(trainer, base, lambda b, t: 0.3 if (b, t) == (0, 0) else 0.0)
    st = PolicyTrainer(tiny_model_dir, _settings()).update(agree, torch.Generator().manual_seed(0))
    assert st["mismatch_tokens"] == n_policy and st["mismatch_kl"] < 1e-9
    assert "tis_weight_mean" not in st  # TIS off: measured, not applied
    st = trainer.update(shifted, torch.Generator().manual_seed(0))
    assert st["mismatch_abs_mean"] == pytest.approx(0.3 / n_policy, rel=1e-3)
    assert st["mismatch_kl_max"] == pytest.approx(math.exp(-0.3) - 1 + 0.3, rel=1e-3)
    # The same micro-batch as the engine's stand-in: agreeing tokens agree to the last bit.
    assert st["tis_below_one"] == pytest.approx(1 / n_policy)
    assert st["tis_weight_mean"] == pytest.approx((n_policy - 1 + math.exp(-0.3)) / n_policy, rel=1e-4)
    # TIS needs the engine's log-probs of every path; measuring needs none.
    with pytest.raises(ValueError, match="tis_cap > 0 needs the engine's log-probs"):
        PolicyTrainer(tiny_model_dir, _settings(tis_cap=2.0)).update(base, torch.Generator().manual_seed(0))
    assert "mismatch_kl" not in PolicyTrainer(tiny_model_dir, _settings()).update(
        base, torch.Generator().manual_seed(0))


def test_position_kl_by_hand():
    # A likely token losing its mass: old (0.94, 0.04, rest 0.02) -> new (0.02, 0.96, rest 0.02).
    old = torch.tensor([[[math.log(0.94), math.log(0.04)]]])
    new = torch.tensor([[[math.log(0.02), math.log(0.96)]]])
    want = 0.94 * math.log(0.94 / 0.02) + 0.04 * math.log(0.04 / 0.96) + 0.02 * math.log(1.0)
    assert float(position_kl(old, new)) == pytest.approx(want, rel=1e-5)
    assert float(position_kl(old, old)) == pytest.approx(0.0, abs=1e-7)
    # A rare token gaining (0.01 -> 0.3) moves little mass: small here, large as sampled k3.
    old = torch.tensor([[[math.log(0.99), math.log(0.01)]]])
    new = torch.tensor([[[math.log(0.70), math.log(0.30)]]])
    assert float(position_kl(old, new)) < 0.35


def test_position_kl_bounds_the_full_kl_from_below():
    g = torch.Generator().manual_seed(0)
    old = torch.log_softmax(torch.randn(3, 5, 50, generator=g) * 2, dim=-1)
    new = torch.log_softmax(torch.randn(3, 5, 50, generator=g) * 2, dim=-1)
    full = (old.exp() * (old - new)).sum(-1)  # [3, 5]
    top = old.topk(8, dim=-1).indices
    part = position_kl(old.gather(-1, top), new.gather(-1, top))
    assert torch.all(part <= full + 1e-6) and torch.all(part >= 0)
    assert torch.allclose(position_kl(old, new), full, atol=1e-5)  # every id kept: the full KL


def test_position_guard_undoes_a_step_that_moves_one_position(tiny_model_dir):
    samples = None
    for target in (1e-6, 1e9):
        trainer = PolicyTrainer(tiny_model_dir, _settings(learning_rate=5e-2, micro_batch=1,
                                                          mini_batches=2, target_position_kl=target))
        samples = samples or _samples(trainer.tokenizer, [1.0, -1.0, 0.5, -0.5])
        before = _flat(trainer.model).clone()
        stats = trainer.update(samples, torch.Generator().manual_seed(0))
        assert stats["kl_position_max"] > 1e-6
        if target < 1:
            assert stats["kl_stopped"] == 1.0 and stats["updates"] == 0.0
            assert torch.equal(before, _flat(trainer.model))
        else:
            assert stats["kl_stopped"] == 0.0 and stats["updates"] == 2.0


def test_mini_batches_hold_whole_groups_of_balanced_size():
    from trace_rl.policy.update import _whole_group_bins

    sizes = [4, 2, 2, 6, 3, 1, 4, 2]  # paths per group (tree)
    samples = [PathSample([1, 2], [0, 1], [0.0, 1.0], group=g) for g, n in enumerate(sizes)
               for _ in range(n)]
    for seed in range(5):
        bins = _whole_group_bins(samples, 4, torch.Generator().manual_seed(seed))
        assert sorted(i for b in bins for i in b) == list(range(len(samples)))
        for b in bins:  # no group is split across mini-batches
            groups = {samples[i].group for i in b}
            assert sum(sizes[g] for g in groups) == len(b)
        assert max(map(len, bins)) - min(map(len, bins)) <= max(sizes)
    loose = [PathSample([1], [1], [1.0]) for _ in range(5)]  # group -1: each its own group
    assert sorted(map(len, _whole_group_bins(loose, 2, torch.Generator().manual_seed(0)))) == [2, 3]


def test_lr_scale_scales_adamws_first_step_and_is_reported(tiny_model_dir):
    """AdamW's first step moves each parameter by about lr (sign of its gradient), so the largest
    move is lr * lr_scale: a warm-up step at scale 1/4 moves the weights a quarter as far."""
    moves, lrs = [], []
    for scale in (1.0, 0.25):
        trainer = PolicyTrainer(tiny_model_dir, _settings(learning_rate=1e-3))
        before = _flat(trainer.model).clone()
        stats = trainer.update(_samples(trainer.tokenizer, [1.0, -1.0]),
                               torch.Generator().manual_seed(0), lr_scale=scale)
        moves.append(float((_flat(trainer.model) - before).abs().max()))
        lrs.append(stats["lr"])
    assert lrs == [1e-3, 2.5e-4]
    assert moves[0] == pytest.approx(1e-3, rel=0.05)
    assert moves[1] == pytest.approx(2.5e-4, rel=0.05)
    with pytest.raises(ValueError, match="lr_scale"):
        trainer.update(_samples(trainer.tokenizer, [1.0]), torch.Generator(), lr_scale=0.0)
    assert [warmup_scale(4, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_scale(0, 0) == 1.0


def test_config_names_a_bad_warmup_and_accepts_the_branch_estimator():
    from trace_rl.config import config_from_mapping

    with pytest.raises(ValueError, match="lr_warmup_steps=-1"):
        config_from_mapping({"lr_warmup_steps": -1})
    assert config_from_mapping({"advantage": "branch", "lr_warmup_steps": 5}).lr_warmup_steps == 5


def test_trainable_layers_trains_only_the_top_layers_and_resumes(tiny_model_dir, tmp_path):
    """``trainable_layers=1``: an update moves the top decoder layer and the final norm, and leaves
    the embeddings and every lower layer bit-identical; the saved optimiser state resumes."""
    trainer = PolicyTrainer(tiny_model_dir, _settings(learning_rate=1e-2, trainable_layers=1))
    layers = trainer.model.model.layers
    assert len(layers) >= 2
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.update(_samples(trainer.tokenizer, [1.0, -1.0]), torch.Generator().manual_seed(0))
    after = dict(trainer.model.named_parameters())
    top = f"model.layers.{len(layers) - 1}."
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(k.startswith((top, "model.norm.")) for k in moved), moved
    assert any(k.startswith(top) for k in moved)
    assert trainer.trainable == sum(p.numel() for k, p in after.items()
                                    if k.startswith((top, "model.norm.")))
    saved = trainer.save(tmp_path / "ckpt")
    resumed = PolicyTrainer(saved, _settings(learning_rate=1e-2, trainable_layers=1))
    assert resumed.optimizer.state
    resumed.update(_samples(resumed.tokenizer, [1.0, -1.0]), torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="only .* decoder layers"):
        PolicyTrainer(tiny_model_dir, _settings(trainable_layers=len(layers) + 1))


def _trunk_runs(reuse_trunk, model_dir, samples_of=None):
    """An update with the bottom layer frozen (two epochs, two mini-batches, the KL guard on
    but never stopping), with plain SGD; (the trainer, its statistics, how many times the frozen
    layer ran)."""
    settings = _settings(learning_rate=1e-2, trainable_layers=1, epochs=2, micro_batch=2,
                         mini_batches=2, target_kl=1e3, target_position_kl=1e3,
                         reuse_trunk=reuse_trunk)
    trainer = PolicyTrainer(model_dir, settings)
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    calls = []
    trainer.model.model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    samples = _samples(trainer.tokenizer, [1.0, -1.0, 0.5, -0.5])
    for i, x in enumerate(samples):  # two groups of two, so each mini-batch is one group
        samples[i] = PathSample(x.token_ids, x.loss_mask, x.advantages, group=i // 2)
    stats = trainer.update(samples, torch.Generator().manual_seed(0))
    return trainer, stats, len(calls)


def test_reusing_the_frozen_trunk_gives_the_whole_models_update_with_fewer_layers_run(
        tiny_model_dir, monkeypatch):
    """``reuse_trunk``: the frozen layer runs once per micro-batch (the old log-probs), not in
    every epoch's forward and guard pass, and the update lands on the same weights and
    statistics as computing the whole model each time."""
    from trace_rl.policy import packing

    monkeypatch.setattr(packing, "VERDICTS", {})  # each run checks packing, as a new process
    reuse, rs, reuse_calls = _trunk_runs(True, tiny_model_dir)
    monkeypatch.setattr(packing, "VERDICTS", {})
    whole, ws, whole_calls = _trunk_runs(False, tiny_model_dir)
    assert reuse.trunk is not None and whole.trunk is None
    assert rs["updates"] == ws["updates"] == 4.0  # 2 epochs x 2 mini-batches
    # the process's one check of packing (a padded and a packed forward of the first
    # micro-batch), then the two micro-batches' old log-probs
    assert reuse_calls == 2 + 2
    assert whole_calls == 2 + 2 + 2 * 2 + 2 * 2  # ... and each epoch's forward and guard pass
    assert torch.allclose(_flat(reuse.model), _flat(whole.model), atol=1e-6)
    assert not torch.equal(_flat(whole.model), _flat(PolicyTrainer(tiny_model_dir, _settings()).model))
    for k in ("loss", "approx_kl", "kl_after_step_max", "grad_norm"):
        assert rs[k] == pytest.approx(ws[k], rel=1e-4, abs=1e-7), k


def test_a_trunk_that_does_not_reproduce_the_model_is_not_reused(tiny_model_dir, monkeypatch):
    """Where the trainable layers on the kept trunk output do not give the whole model's
    log-probs (here: the cut is skipped, so the trunk runs twice), the trainer warns once, turns
    the reuse off and updates as the whole model does."""
    import contextlib

    from trace_rl.policy.trunk import FrozenTrunk

    monkeypatch.setattr(FrozenTrunk, "top_only", lambda self: contextlib.nullcontext())
    with pytest.warns(UserWarning, match="reuse_trunk: .* computing the whole model"):
        broken, bs, _ = _trunk_runs(True, tiny_model_dir)
    whole, ws, _ = _trunk_runs(False, tiny_model_dir)
    assert broken.trunk is None
    assert torch.allclose(_flat(broken.model), _flat(whole.model), atol=1e-6)


def test_trunk_reuse_bench_times_both_settings_on_the_same_paths(tiny_model_dir, tmp_path):
    """``python -m studies.trunk_reuse`` on the test preset: both settings timed, the same weights."""
    from studies.trunk_reuse import main

    out = tmp_path / "trunk.json"
    result = main(["--policy", str(tiny_model_dir), "--trainable-layers", "1", "--paths", "4",
                   "--tokens", "48", "--repeats", "1", "--out", str(out)])
    assert len(result["seconds_off"]) == len(result["seconds_on"]) == 1
    assert result["speedup"] > 0 and result["max_weight_difference"] < 1e-6
    assert json.loads(out.read_text()) == result


def test_update_threads_bench_times_both_counts_and_restores_its_caller(tiny_model_dir, tmp_path):
    """``python -m studies.update_threads`` on the test preset: one and two threads timed with the
    benchmark's settings, and the caller's thread count left as it was."""
    from studies.update_threads import main

    before = torch.get_num_threads()
    out = tmp_path / "threads.json"
    result = main(["--policy", str(tiny_model_dir), "--trainable-layers", "1", "--paths", "4",
                   "--tokens", "48", "--out", str(out)])
    assert torch.get_num_threads() == before
    assert {k: len(v) for k, v in result["seconds"].items()} == {1: 1, 2: 1}
    assert result["speedup"] > 0
    assert json.loads(out.read_text())["paths"] == 4
