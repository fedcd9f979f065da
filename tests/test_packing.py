"""Packed micro-batches (``trace_rl.policy.packing``): each shared prefix once, no padding, and
the same log-probs, loss and gradients as the padded batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trace_core.loss import policy_loss
from trace_rl.policy.packing import pack, worth_packing
from test_update import _settings as update_settings
from trace_rl.policy.update import PathSample, PolicyTrainer, _pad, token_logprobs


def test_pack_by_hand():
    """Two paths that share their first two tokens, given longest first: the row holds the
    sorted paths' distinct prefixes, each token at its path position, attending to its
    ancestors only; ``index`` maps each path position to its row (0 past the end)."""
    p = pack([[1, 2, 4, 5], [1, 2, 3]])
    assert p.ids.tolist() == [[1, 2, 3, 4, 5]]
    assert p.positions.tolist() == [[0, 1, 2, 2, 3]]
    assert p.index.tolist() == [[0, 1, 3, 4], [0, 1, 2, 0]]
    assert p.mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                           [1, 1, 0, 0, 0],
                                           [1, 1, 1, 0, 0],
                                           [1, 1, 0, 1, 0],
                                           [1, 1, 0, 1, 1]]
    assert torch.equal(pack([[1, 2, 3], [1, 2, 4, 5]]).ids, p.ids)  # order does not matter


class _Config:
    hidden_size, intermediate_size = 64, 128


def test_packing_pays_only_where_it_computes_less():
    shared = pack([[7] * 40 + [1, 2], [7] * 40 + [3]])  # a long shared prompt: 43 rows, not 84
    assert shared.size == 43 and worth_packing(shared, 2, 42, _Config)
    apart = pack([list(range(200)), list(range(200, 400))])  # nothing shared: attention 2x
    assert apart.size == 400 and not worth_packing(apart, 2, 200, _Config)


def _settings(**kw):
    """test_update's settings with two epochs and the guard re-scoring (never stopping)."""
    return update_settings(**{"epochs": 2, "agg": "seq-mean-token-sum", "target_kl": 1e3,
                              "target_position_kl": 1e3, **kw})


def _tree(tok):
    """A hand-built step: two trees, each one prompt; tree 0 has a shared first turn and two
    continuations, and one bare rollout; paths of three lengths (so the padded batch pads)."""
    def ids(text):
        return tok.encode(text)

    out = []
    for g, prompt in enumerate(["what is 2+3?", "what is 12*4?"]):
        p = ids(prompt)
        turn = ids("<think>add</think><tool_call>{\"x\": 1}</tool_call>")
        obs = ids(" 5")
        ends = [ids("<answer>5</answer>"), ids("<answer>6 or so</answer>")]
        for k, end in enumerate(ends):
            seq = p + turn + obs + end
            mask = [0] * len(p) + [1] * len(turn) + [0] * len(obs) + [1] * len(end)
            a = [1.0, -0.5][k] * (1 if g == 0 else -1)
            adv = [0.0] * len(p) + [0.25 * a] * len(turn) + [0.0] * len(obs) + [a] * len(end)
            out.append(PathSample(seq, mask, adv, group=g))
        bare = ids("<answer>4</answer>")
        out.append(PathSample(p + bare, [0] * len(p) + [1] * len(bare),
                              [0.0] * len(p) + [0.5] * len(bare), group=g))
    return out


def test_packed_batch_gives_the_padded_batchs_loss_and_gradients(tiny_model_dir):
    """One micro-batch of six paths with shared prompts and turns: the packed row computes 60%
    of the padded positions, and its log-probs, policy loss and every parameter's gradient
    equal the padded batch's to float rounding."""
    trainer = PolicyTrainer(tiny_model_dir, _settings())
    samples = _tree(trainer.tokenizer)
    b = _pad(samples, trainer.pad_id)
    packed = pack([x.token_ids for x in samples])
    assert packed.size < 0.6 * int(b["attn"].sum()) < 0.6 * b["ids"].numel()
    with torch.no_grad():
        old = token_logprobs(trainer.model, b["ids"], b["attn"]) - 0.05 * b["mask"]
    grads, losses, logps = [], [], []
    for p in (None, packed):
        trainer.model.zero_grad(set_to_none=True)
        logp = token_logprobs(trainer.model, b["ids"], b["attn"], packed=p)
        loss, _ = policy_loss(logp, old, b["adv"], b["mask"], clip_low=0.2, clip_high=0.28,
                              agg="seq-mean-token-sum")
        loss.backward()
        logps.append((logp * b["attn"]).detach())
        losses.append(float(loss))
        grads.append(torch.cat([q.grad.flatten() for q in trainer.model.parameters()]))
    assert torch.allclose(logps[0], logps[1], atol=1e-5)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)
    scale = float(grads[0].abs().max())
    assert scale > 1e-3  # a real gradient, not two zeros
    assert float((grads[0] - grads[1]).abs().max()) <= 1e-5 * scale  # float32 rounding


def _update(model_dir, samples, **kw):
    trainer = PolicyTrainer(model_dir, _settings(**kw))
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)  # Adam magnifies rounding
    stats = trainer.update(samples, torch.Generator().manual_seed(0))
    return trainer, stats, torch.cat([q.detach().flatten() for q in trainer.model.parameters()])


@pytest.mark.parametrize("micro_batch", [3, 6])
def test_packed_update_lands_on_the_padded_updates_weights(tiny_model_dir, micro_batch):
    """Two epochs with the guard's re-scoring, on packed and on padded micro-batches: the same
    weights and statistics to float rounding."""
    samples = _tree(PolicyTrainer(tiny_model_dir, _settings()).tokenizer)
    packed, ps, pw = _update(tiny_model_dir, samples, micro_batch=micro_batch)
    padded, qs, qw = _update(tiny_model_dir, samples, micro_batch=micro_batch, pack=False)
    assert packed.pack and packed._pack_checked and not padded._pack_checked
    assert ps["updates"] == qs["updates"] == 2.0
    assert torch.allclose(pw, qw, atol=1e-6)
    for k in ("loss", "approx_kl", "kl_after_step_max", "kl_position_max", "grad_norm", "clip_frac"):
        assert ps[k] == pytest.approx(qs[k], rel=1e-4, abs=1e-7), k


def test_a_model_that_packs_wrong_is_run_padded(tiny_model_dir, monkeypatch):
    """Where the packed row does not reproduce the padded batch (here: every row position may
    see every other), the trainer warns once, packs no more, and updates as the padded one."""
    import trace_rl.policy.logprobs as logprobs
    from trace_rl.policy import packing

    monkeypatch.setattr(packing, "VERDICTS", {})  # this process has not checked the shape yet
    monkeypatch.setattr(logprobs, "model_mask",
                        lambda model, p: torch.ones_like(p.mask))
    samples = _tree(PolicyTrainer(tiny_model_dir, _settings()).tokenizer)
    with pytest.warns(UserWarning, match="pack: .* running padded micro-batches"):
        broken, _, bw = _update(tiny_model_dir, samples)
    assert not broken.pack
    _, _, qw = _update(tiny_model_dir, samples, pack=False)
    assert torch.equal(bw, qw)
    again, _, aw = _update(tiny_model_dir, samples)  # the process's verdict: no check, no warning
    assert not again.pack and torch.equal(aw, qw)


def test_the_packing_check_runs_once_per_process_and_shape(tiny_model_dir, monkeypatch):
    """A second trainer of the same model shape (the next step's, a benchmark's) reuses the
    first one's check instead of running the padded micro-batch again."""
    from trace_rl.policy import packing

    monkeypatch.setattr(packing, "VERDICTS", {})
    calls = []
    real = packing.packing_agrees

    def counted(model, gap, tol=1e-4):
        agrees, measured = real(model, gap, tol)
        calls.append(measured)
        return agrees, measured

    import trace_rl.policy.update as update

    monkeypatch.setattr(update, "packing_agrees", counted)
    samples = _tree(PolicyTrainer(tiny_model_dir, _settings()).tokenizer)
    first, _, w1 = _update(tiny_model_dir, samples)
    second, _, w2 = _update(tiny_model_dir, samples)
    assert first.pack and second.pack and torch.equal(w1, w2)
    assert len(calls) == 2 and calls[0] is not None and calls[0] <= 1e-4 and calls[1] is None


def test_pack_is_an_update_setting_not_a_run_parameter():
    from trace_rl.config import TrainConfig

    assert TrainConfig().update_settings.pack is True
    assert "pack" not in TrainConfig.model_fields
    assert dataclasses.replace(_settings(), pack=False).pack is False


def test_optimiser_bench_counts_positions_and_measures_a_roofline(tiny_model_dir):
    """``studies.optimiser``'s pieces on the hand-built step: a pass computes fewer positions
    packed than padded, the paths' tokens are counted once, and the roofline is a rate."""
    from studies import optimiser

    trainer = PolicyTrainer(tiny_model_dir, _settings(micro_batch=3))
    samples = _tree(trainer.tokenizer)
    padded, packed, tokens = optimiser._positions(trainer, samples, 0)
    assert tokens == sum(len(x.token_ids) for x in samples)
    assert packed < tokens < padded
    shapes = optimiser._linear_shapes(trainer.model)
    assert len(shapes) == 7 * trainer.model.config.num_hidden_layers + 1  # + the LM head
    assert 1e6 < optimiser.roofline(trainer.model, 64, repeats=1) < 1e14
