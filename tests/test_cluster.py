"""The Ray scale-out on a local cluster of two simulated nodes: the engine pool returns
what one engine returns, an engine actor killed mid-batch is replaced and its requests sent again
(nothing lost or duplicated), and a broadcast weight sync from the trainer group gives the engines
the weights a reload of the checkpoint from disk gives (FSDP2 trainer ranks). Real Ray actors,
real engines, real gloo groups. One cluster for the module (its start costs ~20-50 s on this
2-core machine) and one pool of two HF engines for the two pool tests."""

from __future__ import annotations

import os
import signal

import pytest

# A Ray cluster started once for the module (87 s beside other jobs), then 45-88 s per test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ray = pytest.importorskip("ray")

from trace_rl.engines import make_engine  # noqa: E402
from trace_rl.envs.registry import make_env  # noqa: E402
from trace_rl.rollout.react import Start, run_episodes  # noqa: E402
from trace_rl.rollout.types import GenRequest, SamplingSettings  # noqa: E402

SAMPLING = SamplingSettings(max_tokens=24, temperature=1.0)


@pytest.fixture(scope="module")
def cluster():
    from trace_rl import cluster as rc

    rc.connect("local:2", cpus_per_node=3)
    yield rc
    rc.shutdown()


@pytest.fixture(scope="module")
def hf_pool(cluster, tiny_model_dir):
    """One pool of two HF engine actors for the pool tests (two actor start-ups, 30-60 s under
    load, instead of four): the first test reads it as it starts (its sticky table empty), the
    second kills and replaces one of its engines."""
    from trace_rl.cluster.pool import EnginePool

    pool = EnginePool("hf", tiny_model_dir, 2)
    yield pool
    pool.close()


def _episodes(engine, n_items=6, k=2, seed=11):
    env = make_env("synth_arith", difficulty=1)
    items = env.load("train")[:n_items]
    return run_episodes(engine, env, [Start(it, k=k) for it in items], sampling=SAMPLING,
                        max_turns=3, seed=seed)


def _same(a, b, tol=1e-4):
    assert [e.item_id for e in a] == [e.item_id for e in b]
    for x, y in zip(a, b):
        assert x.reward == y.reward and len(x.turns) == len(y.turns)
        for s, t in zip(x.turns, y.turns):
            assert s.gen_ids == t.gen_ids and s.obs_ids == t.obs_ids
            assert max((abs(p - q) for p, q in zip(s.gen_logprobs, t.gen_logprobs)), default=0) < tol


def test_pool_of_two_returns_what_one_engine_returns(hf_pool, tiny_model_dir):
    from trace_rl.cluster.pool import EnginePool

    pool = hf_pool
    assert pool._routes == {} and pool.replaced == 0, "the pool's first test"
    one = _episodes(make_engine("hf", tiny_model_dir))
    nodes = {node for _, node in pool.where()}
    assert len(nodes) == 2, "SPREAD puts the two engines on the two simulated nodes"
    _same(_episodes(pool), one)
    # Sticky: every item (tree) had one engine, and both engines had work.
    assert len(pool._routes) == 6 and set(pool._routes.values()) == {0, 1}
    rr = EnginePool.route.__get__(pool)  # the table decides, not the request order
    reqs = [GenRequest((1, 2), 1, SAMPLING, affinity=a) for a in ("x", "y", "x", "x", "y")]
    owners = rr(reqs)
    assert owners[0] == owners[2] == owners[3] != owners[1] == owners[4]


def test_engine_killed_mid_batch_is_replaced_and_nothing_is_lost(hf_pool):
    pool = hf_pool
    calls: list[int] = []
    kill_at: list[int] = []
    generate = pool.generate

    def generate_and_maybe_kill(requests):
        calls.append(len(requests))
        if len(calls) in kill_at:  # the batch is under way: engine 0 dies before this turn
            os.kill(pid, signal.SIGKILL)
        return generate(requests)

    pool.generate = generate_and_maybe_kill  # what run_episodes calls, turn by turn
    try:
        reference = _episodes(pool, n_items=8, k=3)
        turns = len(calls)
        pid = pool.where()[0][0]
        # Kill engine 0's process at the batch's second turn (its first when the batch is one
        # turn long), not on a timer: under load a timed kill landed after the batch ended.
        calls.clear()
        kill_at.append(2 if turns >= 2 else 1)
        again = _episodes(pool, n_items=8, k=3)
        assert pool.replaced >= 1, "the kill landed after the batch: no replacement exercised"
        assert pid not in [p for p, _ in pool.where()]
        assert len(calls) == turns, "the batch went on after the kill, turn for turn"
        _same(again, reference)  # same episodes: none lost, none twice
        assert len(again) == 24
    finally:
        del pool.generate  # the class's again


def test_broadcast_sync_equals_reloading_the_checkpoint(cluster, tiny_model_dir, tmp_path):
    from trace_rl.cluster.session import Session
    from trace_rl.policy.update import PathSample, UpdateSettings

    settings = UpdateSettings(learning_rate=5e-3, clip_low=0.2, clip_high=0.28, kl_coef=0.0,
                              epochs=1, micro_batch=2, agg="seq-mean-token-sum", mini_batches=1,
                              target_kl=0.0, target_position_kl=0.0)
    # FSDP2 ranks (the DDP ones run in test_cluster_train): the broadcast sends the full weights
    # rank 0 gathered for the checkpoint.
    s = Session("local:2", "hf", engines=2, ranks=2, weight_sync="broadcast", strategy="fsdp2")
    try:
        pool = s.engine(str(tiny_model_dir), str(tiny_model_dir))
        tok = pool.tokenizer
        samples = []
        for i, a in enumerate([1.0, -1.0, 0.5, -0.5, 0.8]):
            p, g = tok.encode(f"question {i}?"), tok.encode(f"<think>{i}</think><answer>{i}</answer>")
            samples.append(PathSample(p + g, [0] * len(p) + [1] * len(g), [0.0] * len(p) + [a] * len(g),
                                      group=i // 2))
        out = tmp_path / "step0"
        stats = s.update(settings, 0, str(tiny_model_dir), samples, 5, 1.0, out)
        assert stats["updates"] == 1.0 and (out / "model.safetensors").is_file()
        before = _episodes(pool, n_items=4)
        s.sync(str(out))
        assert s.syncs[-1][0] == "broadcast"
        after = _episodes(pool, n_items=4)
        disk = make_engine("hf", tiny_model_dir)
        disk.load_weights(out)
        _same(after, _episodes(disk, n_items=4))
        # The sync changed what the engines generate (the update moved the policy).
        assert any(a.turns[0].gen_logprobs != b.turns[0].gen_logprobs for a, b in zip(after, before))
    finally:
        s.close()
