"""``trace_rl.session.Session``: what the pipeline's tasks share, handed to them by the flow."""

from __future__ import annotations

import shutil

import pytest

from trace_rl.session import PROCESS, Session


class _Engine:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_weights(self, policy_dir: str) -> None:
        self.loaded.append(policy_dir)


def test_an_engine_loads_weights_only_when_it_holds_others():
    s, engine = Session(), _Engine()
    assert s.engine_home("hf", "run", "/p0") == "/p0"
    assert s.engine_home("hf", "run", "/p1") == "/p0"  # keyed by the run's first policy
    s.serve(engine, "/p0", "/p0")
    assert engine.loaded == []  # started from home: nothing to load
    s.serve(engine, "/p0", "/p1")
    s.serve(engine, "/p0", "/p1")
    assert engine.loaded == ["/p1"]
    assert Session().engine_home("hf", "run", "/p1") == "/p1"  # another session knows nothing


def test_memo_keeps_values_per_key_and_drops_the_least_recently_used():
    s, made = Session(), []

    def make(x):
        made.append(x)
        return [x]

    first = s.memo("k", 1, lambda: make(1), maxsize=2)
    assert s.memo("k", 1, lambda: make(1), maxsize=2) is first
    s.memo("k", 2, lambda: make(2), maxsize=2)
    s.memo("k", 1, lambda: make(1), maxsize=2)  # 1 used last: 2 goes first
    s.memo("k", 3, lambda: make(3), maxsize=2)
    s.memo("k", 1, lambda: make(1), maxsize=2)
    s.memo("k", 2, lambda: make(2), maxsize=2)
    assert made == [1, 2, 3, 2]


def test_trainers_and_queued_jobs_belong_to_their_session(tmp_path):
    s = Session()
    s.keep_trainer("/ckpt1", "trainer")
    assert Session().take_trainer("/ckpt1") is None
    assert s.take_trainer("/ckpt1") == "trainer" and s.take_trainer("/ckpt1") is None
    entry = tmp_path / "job.json"
    s.queue(entry)
    assert s.queued(entry) and not Session().queued(entry)
    s.finish(entry)
    assert not s.queued(entry)


def test_a_fitted_predictor_is_kept_for_the_next_step_and_equals_its_file(tmp_path):
    import numpy as np
    import torch

    from tasks import runtime
    from trace_rl.config import TrainConfig

    cfg, wd, texts = TrainConfig(), str(tmp_path), [f"question {i} answer {i % 3}" for i in range(12)]
    y = np.linspace(0, 1, 12)
    with Session().use() as s:
        fitted = runtime.load_predictor(cfg.predictor, cfg.seed, wd, "run", -1, take=True)
        fitted.fit(texts, y)
        runtime.save_predictor(fitted, wd, "run", 0)
        assert runtime.load_predictor(cfg.predictor, cfg.seed, wd, "run", 0) is fitted  # scoring shares it
        assert s.kept_predictor(wd, "run", 1) is None and s.kept_predictor(wd, "other", 0) is None
        rng = torch.random.get_rng_state()
        kept = runtime.load_predictor(cfg.predictor, cfg.seed, wd, "run", 0, take=True)
        assert torch.equal(torch.random.get_rng_state(), rng)  # seeded as a read from disk is
        assert kept is fitted and s.kept_predictor(wd, "run", 0) is None  # a fit takes it
    with Session().use():  # a resumed run (another process) reads the file
        read = runtime.load_predictor(cfg.predictor, cfg.seed, wd, "run", 0)
        assert read is not fitted
        np.testing.assert_array_equal(read.predict(texts), kept.predict(texts))
        np.testing.assert_array_equal(read.fit(texts, 1 - y)["loss"], kept.fit(texts, 1 - y)["loss"])
        np.testing.assert_array_equal(read.predict(texts), kept.predict(texts))
        with pytest.raises(FileNotFoundError):
            runtime.load_predictor(cfg.predictor, cfg.seed, wd, "run", 1)


def test_current_is_the_session_in_use_else_the_process_s():
    assert Session.current() is PROCESS
    s = Session()
    with s.use():
        assert Session.current() is s
        with Session().use() as inner:
            assert Session.current() is inner
        assert Session.current() is s
    assert Session.current() is PROCESS


def test_the_flow_s_phases_run_their_tasks_in_its_session(tiny_model_dir, tmp_path):
    """A task called through ``flows.common.Phases`` finds the session the flow handed over: the
    engine it started is then the session's, holding the weights the task loaded into it."""
    from scripted_engine import scripted_rollouts

    from flows.common import Phases
    from tasks import runtime
    from trace_rl.config import TrainConfig

    cfg = TrainConfig(engine="hf", policy=str(tiny_model_dir), run_id="session-engine")
    run = (cfg.engine, cfg.cluster_section, cfg.resolved_run_id)  # what the engine is keyed by
    s, checkpoint = Session(), str(tmp_path / "step-0")
    shutil.copytree(tiny_model_dir, checkpoint)  # the policy after a step
    with scripted_rollouts(lambda context, j, seed: "") as built:
        Phases(str(tmp_path), session=s).sync_weights(*run, str(tiny_model_dir))
        with s.use():  # the same session: the run's engine, no second start
            engine = runtime.engine_for(*run, checkpoint)
        assert built == [engine] and engine.loaded == [checkpoint]
        with Session().use():  # a session that never saw the run starts from ``checkpoint``
            assert runtime.engine_for(*run, checkpoint) is not engine
        assert len(built) == 2


def test_phases_names_an_unknown_task_as_a_missing_attribute(tmp_path):
    from flows.common import Phases

    phases = Phases(str(tmp_path), session=Session())
    assert not hasattr(phases, "score_rootz")
    with pytest.raises(AttributeError, match="no task named 'score_rootz'"):
        phases.score_rootz


def test_phases_bind_a_task_once_per_session_and_work_dir(tmp_path, monkeypatch):
    import flows.common
    from flows.common import Phases

    bound, real = [], flows.common.bind
    monkeypatch.setattr(flows.common, "bind", lambda task, wd: bound.append(wd) or real(task, wd))
    s, a, b = Session(), str(tmp_path / "a"), str(tmp_path / "b")
    for step in range(3):  # the train flow makes a Phases per step
        Phases(a, where=f"step {step}: ", session=s).tree_advantages
    Phases(b, session=s).tree_advantages
    Phases(a, session=Session()).tree_advantages
    assert bound == [a, b, a]


def test_a_phase_beside_runs_in_a_thread_of_its_own_as_a_task_run_of_the_flow(
        tmp_path, monkeypatch, prefect_harness):
    """``Phases.beside`` (the predictor fit beside the update): the phase runs while this thread
    goes on (it waits for an event set only after it started), as a task run of the same flow
    run, in the flow's session; its error comes back through the future."""
    import threading

    from prefect import flow, task
    from prefect.context import TaskRunContext

    import tasks.learn
    from flows.common import Phases
    from trace_rl.session import Session

    gate = threading.Event()

    @task(name="probe-beside")
    def probe_beside(fail: bool) -> tuple[str, str, bool]:
        if fail:
            raise RuntimeError("the phase beside failed")
        assert gate.wait(60), "the caller did not go on while the phase ran"
        run = TaskRunContext.get().task_run
        return threading.current_thread().name, str(run.flow_run_id), Session.current() is s

    monkeypatch.setattr(tasks.learn, "probe_beside", probe_beside, raising=False)
    s = Session()

    @flow(name="beside")
    def beside() -> tuple[tuple[str, str, bool], str]:
        from prefect.runtime import flow_run

        do = Phases(str(tmp_path), session=s)
        running = do.beside("probe_beside", False)
        gate.set()  # only now: a phase run in this thread would have waited for it in vain
        failing = do.beside("probe_beside", True)
        with pytest.raises(RuntimeError, match="the phase beside failed"):
            failing.result(60)
        return running.result(60), str(flow_run.id)

    (thread, parent, in_session), flow_run_id = beside()
    assert thread == "trace-phase-probe_beside" and parent == flow_run_id and in_session
