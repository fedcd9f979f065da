"""Shared fixtures: a tiny policy directory built locally (no downloads), one per test session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# No test may lean on a warm machine: Prefect's home (its database, profiles) and TRACE's shared
# cache (bootstrapped policies) are new, empty folders for every session, inherited by the CLI
# subprocesses the tests start. Set before anything imports prefect, which reads them on import.
# The machine's temporary folder as the first test process saw it (xdist workers inherit the
# TMPDIR set below, and must not nest their roots inside it).
_BASE = os.environ.setdefault("TRACE_TESTS_BASE_TMP", tempfile.gettempdir())
_FRESH = tempfile.mkdtemp(prefix="trace-tests-", dir=_BASE)
os.environ["PREFECT_HOME"] = os.path.join(_FRESH, "prefect")
os.environ["TRACE_CACHE_DIR"] = os.path.join(_FRESH, "cache")
# Temporary files too: the sandbox's scratch folders of this test process are then told apart from
# another test process's on the same machine (tests/sandbox_watch.py).
os.environ["TMPDIR"] = os.path.join(_FRESH, "tmp")
os.makedirs(os.environ["TMPDIR"])
tempfile.tempdir = os.environ["TMPDIR"]
# Ray puts its sockets under its temporary folder, and a Unix socket's path is limited to 107
# bytes: Ray keeps the machine's folder (its own default, /tmp/ray on Linux).
os.environ.setdefault("RAY_TMPDIR", _BASE)
atexit.register(shutil.rmtree, _FRESH, ignore_errors=True)

from trace_rl import environ  # noqa: E402

environ.apply()

import data_dirs  # noqa: E402
from browser import Chromium, chromium_or_skip  # noqa: E402

# The real families read the full data when TRACE_DATA_DIR (or ../shared/data) holds all of it,
# else the fixtures of tests/data/families; `full_data` tests read the full data or skip.
data_dirs.use_data()

import pytest  # noqa: E402
import torch  # noqa: E402

# Test models are tiny: their matmuls gain little from a second thread, while OpenMP spin-waiting
# on a busy 2-core machine made a 30-step fit 8x slower with 2 threads than with 1 (25 s vs 3 s).
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    # The `full_data` marker's skip, and TRACE_REQUIRE_FULL_DATA=1 failing a session that skipped
    # one where the full data directory exists (tests/data_dirs.py).
    config.pluginmanager.register(data_dirs.FullDataPlugin(data_dirs.FULL_DATA), "trace-full-data")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_LongestFirst(), "trace-longest-first")


class _LongestFirst:
    """``-n N`` (xdist's default ``--dist load``): the longest work first, modules with shared
    fixtures kept on one worker (tests/scheduling.py). Any other ``--dist`` is xdist's own."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") != "load":
            return None
        from scheduling import LongestFirst

        return LongestFirst(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved HF directory: the "test" preset (~0.15M params, head_dim 32, vocab 1024), seed 0,
    pre-trained 150 steps (~4 s) on ``react_corpus()`` so it writes ReAct-shaped text
    (``<think>..</think>``, ``<tool_call>{json}</tool_call>``, EOS = ``<|im_end|>``).
    Loadable by transformers and vLLM."""
    from trace_rl.policy.tiny import make_tiny_policy

    return make_tiny_policy(tmp_path_factory.mktemp("tiny_model"), preset="test",
                            pretrain_steps=150)


@pytest.fixture(scope="session")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Chromium:
    browser = Chromium(chromium_or_skip(), tmp_path_factory.mktemp("chromium-profile"))
    # The console check can fail: a page with an error is seen as one.
    bad = tmp_path_factory.mktemp("bad") / "bad.html"
    bad.write_text("<html><body><script>no_such_function();</script></body></html>")
    _, console = browser.load(bad.as_uri())
    assert any("no_such_function" in line for line in console), console
    return browser


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect server (with its own database) for every in-process flow run of the
    session, instead of an ephemeral server started and stopped around each flow call."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield



# scripts/test.sh runs the suite on two pytest-xdist workers (TRACE_TEST_WORKERS): most tests wait
# on subprocesses, servers and start-ups, so a second worker nearly halves the wall time even on
# two cores. Each worker imports this file, so each has its own PREFECT_HOME, cache and temporary
# root; the sandbox tests count only their own worker's sandboxes (tests/sandbox_watch.py).
# (xdist's --dist loadgroup cannot keep files together here: pytest 9 ignores the node-id suffix
# xdist 3.8 sets for it. tests/scheduling.py keeps a module with shared fixtures on one worker.)


@pytest.fixture(autouse=True)
def _log_handlers_outlive_captured_streams():
    """A logging handler created while a test captured ``sys.stderr`` (``capsys``) keeps writing
    to that capture after the test closed it; the next flow run's log line then fails inside
    Prefect's console handler and recurses through its ``log_prints``. After each test, such
    handlers are pointed back at the current ``sys.stderr``."""
    yield
    import logging
    import sys

    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers}:
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
            if hasattr(handler, "console"):  # Prefect's rich console handler
                handler.console.file = sys.stderr
