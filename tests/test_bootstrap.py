"""The bootstrapped tiny policy: loss masks, shared-prefix loss, imperfect traces, and one real
(small) bootstrap checked for loading, caching and a measured success gain over the untrained
model."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trace_rl.engines import make_engine
from trace_rl.envs.registry import make_env
from trace_rl.policy.bootstrap import entry
from trace_rl.envs.synth_arith.env import expert_thoughts as arith_thoughts
from trace_rl.policy.bootstrap import (CORRUPTIONS, IGNORE_INDEX, RECORD, _tokenizer_texts,
                                       bootstrap_policy, episode_example, measure_success,
                                       read_record, sft_batch, sft_loss, shared_prefix_len,
                                       stop_early, trace_actions, wrong_final, wrong_step)
from trace_rl.policy.tiny import build_model, build_tokenizer, save_policy
from trace_rl.rollout.react import expert_episode
from trace_rl.rollout.types import GenRequest, SamplingSettings


@pytest.fixture(scope="module")
def arith():
    env = make_env("synth_arith", difficulty=2, n_train=40, n_test=8)
    items = env.load("train")
    tok = build_tokenizer(_tokenizer_texts(env, items), vocab_size=600)
    return env, items, tok


def test_batch_labels_cover_exactly_the_generated_tokens(arith):
    env, items, tok = arith
    episodes = [expert_episode(env, item, tok) for item in items[:3]]
    examples = [episode_example(ep) for ep in episodes]
    batch = sft_batch(examples, tok.pad_token_id)
    ids, attn, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]  # [B, T]
    assert ids.shape == attn.shape == labels.shape == (3, max(len(e.token_ids) for e in examples))
    for b, ep in enumerate(episodes):
        # Walk the segments by hand: prompt (off), then per turn gen (on) and obs (off).
        expected, pos = [], len(ep.prompt_ids)
        for turn in ep.turns:
            expected += list(range(pos, pos + len(turn.gen_ids)))
            pos += len(turn.gen_ids) + len(turn.obs_ids)
        on = (labels[b] != IGNORE_INDEX).nonzero().flatten().tolist()
        assert on == expected
        assert labels[b, on].tolist() == ids[b, on].tolist()
        assert int(attn[b].sum()) == pos == len(ep.token_ids())
        assert ids[b, :pos].tolist() == ep.token_ids()
        # Observation tokens (tool output and template glue) never carry a label.
        obs_at = len(ep.prompt_ids) + len(ep.turns[0].gen_ids)
        assert (labels[b, obs_at:obs_at + len(ep.turns[0].obs_ids)] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="example 0 has"):
        sft_batch([type(examples[0])((1, 2, 3), (0, 1))], tok.pad_token_id)
    with pytest.raises(ValueError, match="no examples"):
        sft_batch([], tok.pad_token_id)


def test_shared_prefix_loss_equals_plain_loss(arith):
    env, items, tok = arith
    examples = [episode_example(expert_episode(env, item, tok)) for item in items[:4]]
    shared = shared_prefix_len(examples)
    # The system prompt is shared; the question differs, and the split stays inside the prompt.
    assert 20 < shared < min(e.loss_mask.index(1) for e in examples)
    batch = sft_batch(examples, tok.pad_token_id)
    model = build_model(tok, "test", seed=1).train()
    grads = []
    for s in (0, shared):
        model.zero_grad()
        loss = sft_loss(model, batch, s)
        loss.backward()
        grads.append((float(loss.detach()), model.model.embed_tokens.weight.grad.clone(),
                      model.model.layers[0].self_attn.k_proj.weight.grad.clone()))
    (l0, e0, k0), (l1, e1, k1) = grads
    assert l0 == pytest.approx(l1, rel=1e-5)
    assert torch.allclose(e0, e1, atol=1e-5) and torch.allclose(k0, k1, atol=1e-5)


def test_corruptions_make_imperfect_traces_that_really_fail(arith):
    env, items, _ = arith
    rng = random.Random(0)
    own, donor = list(env.expert_actions(items[0])), list(env.expert_actions(items[1]))
    assert str(own[-1].answer) != str(donor[-1].answer)
    bad = wrong_final(own, donor, rng)
    assert bad[:-1] == own[:-1] and bad[-1].answer == donor[-1].answer
    early = stop_early(own, donor, rng)
    assert early[-1].kind == "answer" and len(early) < len(own)
    slip = wrong_step(own, donor, rng)
    assert len(slip) == len(own) and sum(a != b for a, b in zip(slip, own)) == 1
    # Graded by the real environment: a wrong or premature answer scores 0.
    for acts in (bad, early):
        state = env.reset(items[0])
        assert env.verify_final(items[0], state, acts[-1].answer).reward == 0.0
    # Function calling always answers "done": a wrong final answer cannot be made there.
    fn = make_env("synth_fncall", difficulty=2, n_train=4, n_test=1)
    f_items = fn.load("train")
    f_own, f_donor = list(fn.expert_actions(f_items[0])), list(fn.expert_actions(f_items[1]))
    assert wrong_final(f_own, f_donor, rng) is None
    # ...but stopping early can: fewer of its own calls (a proper prefix), then "done".
    early = stop_early(f_own, f_donor, rng)
    assert early[:-1] == f_own[:len(early) - 1] and len(early) < len(f_own)
    assert early[-1] == f_donor[-1] and early[-1].kind == "answer"
    assert set(CORRUPTIONS) == {"wrong_final", "stop_early", "wrong_step"}


def test_trace_actions_noise_fraction(arith):
    env, items, _ = arith
    clean = list(trace_actions(env, items, 0.0, random.Random(0)))
    assert all(kind == "expert" and acts == list(env.expert_actions(it)) for it, acts, kind in clean)
    noisy = list(trace_actions(env, items * 10, 0.3, random.Random(0)))
    share = sum(kind != "expert" for _, _, kind in noisy) / len(noisy)
    assert 0.2 < share < 0.4
    assert {kind for _, _, kind in noisy} == {"expert", *CORRUPTIONS}


def test_arith_thoughts_restate_each_step(arith):
    env, items, _ = arith
    item = items[0]
    actions = list(env.expert_actions(item))
    thoughts = arith_thoughts(item, actions)
    assert len(thoughts) == len(actions) == 3 and thoughts[-1] == ""
    # Each step's sentence is in the question, in order, and names the number the call uses.
    assert item.question.index(thoughts[0]) < item.question.index(thoughts[1])
    for thought, action in zip(thoughts[:2], actions[:2]):
        operand = action.arguments["expression"].split()[-1]
        assert operand in thought or ("doubled" in thought and operand == "2") or \
            ("tripled" in thought and operand == "3")
    # A premature answer gets no thought; a script longer than the question's steps gets "".
    assert arith_thoughts(item, [actions[0], actions[-1]]) == [thoughts[0], ""]


def test_bad_settings_are_named():
    with pytest.raises(TypeError, match="known settings"):
        bootstrap_policy("synth_arith", "/nonexistent/x", difficulty=1, learning_rat=1e-3)
    with pytest.raises(ValueError, match="target_success"):
        bootstrap_policy("synth_arith", "/nonexistent/x", difficulty=1, target_success=(0.8, 0.2))
    with pytest.raises(KeyError, match="unknown task family"):
        bootstrap_policy("no_such_family", "/nonexistent/x", difficulty=1)


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        bootstrap_policy("synth_arith", tmp_path, difficulty=1, preset="test", sft_examples=8,
                         sft_epochs=1,
                         eval_items=2, report_items=2)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# A real bootstrap small enough for the suite: difficulty 1 (one calculator call, then answer).
# Clean traces and an unreachable target, so all epochs run (225 steps, ~15-40 s on 1 thread).
SMALL = dict(difficulty=1, preset="test", seed=0, sft_examples=1200, sft_epochs=3,
             target_success=(0.99, 1.0), eval_items=16, report_items=32, batch_size=16,
             learning_rate=1e-2, noise=0.0, vocab_size=600, threads=1)


@pytest.fixture(scope="module")
def small_policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("bootstrap") / "policy"
    t0 = time.perf_counter()
    bootstrap_policy("synth_arith", out, **SMALL)
    return out, time.perf_counter() - t0


@pytest.mark.slow
def test_bootstrap_writes_a_loadable_policy_and_record(small_policy):
    out, _ = small_policy
    rec = read_record(out)
    assert rec is not None and len(rec["input_hash"]) == 64
    assert rec["config"]["family"] == "synth_arith" and rec["config"]["preset"] == "test"
    assert 1 <= rec["epochs_run"] <= SMALL["sft_epochs"]
    # One 0/1 rollout per report item: each success rate is a count out of report_items.
    for key in ("success_sampled", "success_greedy"):
        hits = rec[key] * rec["report_items"]
        assert rec["report_items"] == SMALL["report_items"] and hits == pytest.approx(round(hits))
    # The kept epoch is the one whose held-out success met the target (or came closest), and
    # training stopped before the last epoch only on meeting it.
    lo, hi = SMALL["target_success"]
    kept = rec["history"][rec["epoch_kept"] - 1]
    assert kept["epoch"] == rec["epoch_kept"]
    assert rec["target_met"] == (lo <= kept["eval_success"] <= hi)
    assert rec["epochs_run"] == SMALL["sft_epochs"] or rec["target_met"]
    assert not list(out.parent.glob(".policy.*")), "temporary directory left behind"
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == len(tok)
    engine = make_engine("hf", out)
    [[comp]] = engine.generate([GenRequest(prompt_ids=tuple(tok.encode("<think>")), n=1,
                                           sampling=SamplingSettings(max_tokens=4))])
    assert len(comp.token_ids) >= 1


@pytest.mark.slow
def test_second_call_is_cached(small_policy, monkeypatch):
    out, first_seconds = small_policy
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def build(*args, **kwargs):
        raise AssertionError("the second call trained the policy again")

    monkeypatch.setattr(entry, "_build", build)  # a cache hit builds nothing
    t0 = time.perf_counter()
    assert bootstrap_policy("synth_arith", out, **SMALL) == out
    assert weights.stat().st_mtime_ns == mtime
    print(f"\nbuilt in {first_seconds:.1f} s, cache hit in {time.perf_counter() - t0:.2f} s")


@pytest.mark.slow
def test_sft_raises_held_out_success_over_the_untrained_model(small_policy, tmp_path):
    out, _ = small_policy
    env = make_env("synth_arith", difficulty=1, seed=0, n_train=0, n_test=80)
    items = env.load("test")[-32:]  # outside the items the bootstrap measured itself on
    tok = AutoTokenizer.from_pretrained(out)
    untrained = save_policy(build_model(tok, "test", seed=0), tok, tmp_path / "untrained")
    rates = {}
    for name, path in (("untrained", untrained), ("sft", out)):
        engine = make_engine("hf", path, seed=0)
        rates[name] = measure_success(engine, env, items, temperature=0.0, seed=0,
                                      max_turn_tokens=read_record(out)["max_turn_tokens"])
    # Measured: untrained 0/32 (it never writes a parseable turn); after SFT 9/32 greedy.
    assert rates["untrained"] == 0.0
    assert rates["sft"] >= 3 / 32, rates
    assert json.loads((out / RECORD).read_text())["success_greedy"] > 0.0


# Small enough to build twice in a test: one epoch of 64 traces, two items measured.
TINY = dict(difficulty=1, preset="test", seed=0, sft_examples=64, sft_epochs=1,
            eval_items=2, report_items=2, vocab_size=600, threads=1)


@pytest.mark.slow
def test_cache_builds_once_per_machine_and_shows_progress(tmp_path, capsys):
    cache = tmp_path / "cache"
    first = tmp_path / "work-a" / "policy"
    bootstrap_policy("synth_arith", first, cache_dir=cache, show_progress=True, **TINY)
    err = capsys.readouterr().err
    assert "training a tokenizer" in err and "measuring the untrained policy" in err
    assert "epoch 1/1" in err and "kept epoch 1" in err
    [cached] = [p for p in (cache / "policies").iterdir() if p.is_dir()]
    assert read_record(cached)["input_hash"] == read_record(first)["input_hash"]
    weights = (cached / "model.safetensors").read_bytes()
    stamp = (cached / "model.safetensors").stat().st_mtime_ns

    second = tmp_path / "work-b" / "policy"  # another work dir: a copy, no training
    bootstrap_policy("synth_arith", second, cache_dir=cache, show_progress=True, **TINY)
    err = capsys.readouterr().err
    assert "reusing the policy cached at" in err and "training a tokenizer" not in err
    assert (second / "model.safetensors").read_bytes() == weights
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp
    assert not (second / "model.safetensors").samefile(cached / "model.safetensors")

    # A different input (here the seed) is a different policy: a second cache entry.
    bootstrap_policy("synth_arith", tmp_path / "work-c" / "policy", cache_dir=cache,
                     **{**TINY, "seed": 1})
    assert len([p for p in (cache / "policies").iterdir() if p.is_dir()]) == 2


@pytest.mark.slow
def test_the_bootstrap_trains_on_one_thread_however_idle_the_machine(tmp_path, monkeypatch):
    """Its policy depends on the CPU, not on the load: on an idle 4-core machine it still trains on
    one thread (a backward pass on 1 and 2 threads differs by ~1e-8), and torch's own setting is
    restored."""
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    before = torch.get_num_threads()
    out = bootstrap_policy("synth_arith", tmp_path / "policy", **{**TINY, "threads": None})
    assert read_record(out)["threads"] == 1
    assert torch.get_num_threads() == before


def test_input_hash_follows_the_chain_recipe(monkeypatch):
    from trace_rl.envs.synth_chain import env as chain
    from trace_rl.policy.bootstrap import BootstrapConfig, input_hash

    env = make_env("synth_chain", difficulty=1, n_train=4, n_test=2)
    items = env.load("sft") + env.load("test")
    config = BootstrapConfig(family="synth_chain", difficulty=1)
    key = input_hash(config, env, items)
    assert input_hash(BootstrapConfig(family="synth_chain", difficulty=1, split_names=True),
                      env, items) != key
    # Changed expert thoughts are a changed recipe: the cached policy must not be reused.
    monkeypatch.setattr(chain.expert_thoughts, "version", chain.expert_thoughts.version + 1)
    assert input_hash(config, env, items) != key
    # Options left at their defaults stay out of the record (older policies keep their key).
    assert "split_names" not in BootstrapConfig(family="synth_arith", difficulty=1).to_json()


def test_a_family_variant_gets_its_own_recipe():
    from trace_rl.policy.bootstrap import BootstrapConfig, family_config

    common = dict(difficulty=1, preset="tiny", seed=0, sft_examples=None, sft_epochs=None,
                  target_success=(0.3, 0.7))
    default = family_config("synth_chain", **common)
    assert (default.sft_examples, default.sft_epochs, default.split_names) == (800, 12, True)
    one = (("chain_facts", 1), ("chain_syllables", 1))
    variant = family_config("synth_chain", options=one, **common)
    assert (variant.sft_examples, variant.sft_epochs, variant.split_names) == (22400, 2, True)
    # Only the whole variant matches; what the caller sets still wins.
    half = family_config("synth_chain", options=(("chain_facts", 1),), **common)
    assert (half.sft_examples, half.sft_epochs) == (800, 12)
    assert family_config("synth_chain", options=one, **{**common, "sft_epochs": 3}).sft_epochs == 3
    assert family_config("synth_arith", options=one, **common).sft_examples == \
        BootstrapConfig.model_fields["sft_examples"].default


def test_options_at_their_defaults_do_not_name_the_policy(monkeypatch, tmp_path):
    import flows.bootstrap as fb
    from trace_rl.config import TrainConfig

    calls = []
    monkeypatch.setattr(fb, "bootstrap_policy", lambda family, out, **kw: calls.append((out, kw)))
    defaults = TrainConfig(family="synth_chain").family_options()
    fb.bootstrap.fn("synth_chain", 1, str(tmp_path), 0, options=defaults)
    fb.bootstrap.fn("synth_chain", 1, str(tmp_path), 0, options=None)
    fb.bootstrap.fn("synth_chain", 1, str(tmp_path), 0,
                    options={**defaults, "chain_facts": 1, "chain_syllables": 1})
    (out_a, kw_a), (out_b, kw_b), (out_c, kw_c) = calls
    assert out_a == out_b and kw_a == kw_b and kw_a["options"] == ()
    assert kw_c["options"] == (("chain_facts", 1), ("chain_syllables", 1))
    assert out_c != out_a and Path(out_c).name.startswith("tiny-synth_chain-d1-o")
