"""Which data the tests of the real families read: the full data sets, or the fixtures.

``FULL_DATA`` is the data directory as the session found it (``$TRACE_DATA_DIR``, else the
``shared/data`` folder beside the repository). When it holds every file of every real family
(``trace data check``), the tests read it; otherwise ``use_data()`` points ``TRACE_DATA_DIR`` at
``FIXTURES`` (tests/data/families: a few rows of each file in the same layout, cut by
scripts/make_test_fixtures.py), so the same tests run on any clone. Tests that need the full
files themselves (row counts, statistics over hundreds of items) carry the ``full_data`` marker:
they read ``FULL_DATA`` and skip, naming the missing file, when it lacks their family's files
(tests/conftest.py; with ``TRACE_REQUIRE_FULL_DATA=1`` such a skip fails the session).
"""

from __future__ import annotations

import os
from pathlib import Path

from trace_rl.envs.datadir import check_data_dir, data_families, default_data_dir

FIXTURES = Path(__file__).resolve().parent / "data" / "families"
# Kept across the xdist workers and CLI subprocesses, which inherit the TRACE_DATA_DIR set below.
FULL_DATA = Path(os.environ.setdefault("TRACE_TESTS_FULL_DATA", str(default_data_dir())))


def missing_files(root: Path, families: tuple[str, ...] | None = None) -> list[Path]:
    """The files of ``families`` (default: every family that reads a data directory) that the
    data directory ``root`` lacks (as full paths)."""
    return [root / f.path for _, missing in check_data_dir(root, families).values()
            for f in missing]


def use_data() -> Path:
    """Point ``TRACE_DATA_DIR`` at the full data when it is whole, else at the fixtures; the
    directory chosen."""
    chosen = FIXTURES if missing_files(FULL_DATA) else FULL_DATA
    os.environ["TRACE_DATA_DIR"] = str(chosen)
    return chosen


def on_fixtures() -> bool:
    """Whether this session's tests read the fixtures (set by ``use_data``)."""
    return Path(os.environ.get("TRACE_DATA_DIR", "")) == FIXTURES


class FullDataPlugin:
    """The ``full_data`` marker (``@pytest.mark.full_data("math")``; no argument: every real
    family): such a test is skipped, with a reason naming the first missing file, when
    ``full_data`` lacks its families' files. With ``TRACE_REQUIRE_FULL_DATA=1`` and ``full_data``
    a directory, a skipped ``full_data`` test fails the session (exit status 1), and the summary
    names it: CI that has the data runs every test that needs it."""

    def __init__(self, full_data: Path):
        self.full_data = full_data
        self.skipped: list[str] = []

    def _required(self, config) -> bool:
        return (os.environ.get("TRACE_REQUIRE_FULL_DATA") == "1" and self.full_data.is_dir()
                and not hasattr(config, "workerinput"))  # the xdist controller alone decides

    def pytest_collection_modifyitems(self, items) -> None:
        import pytest

        missing: dict[tuple[str, ...], list[Path]] = {}
        for item in items:
            marker = item.get_closest_marker("full_data")
            if marker is None:
                continue
            families = tuple(marker.args) or tuple(data_families())
            if families not in missing:
                missing[families] = missing_files(self.full_data, families)
            if missing[families]:
                first, more = missing[families][0], len(missing[families]) - 1
                item.add_marker(pytest.mark.skip(
                    reason=f"full data: no {first}" + (f" (and {more} more)" if more else "")
                    + f"; point TRACE_DATA_DIR at the full data of {', '.join(families)} "
                    "(trace data check)"))

    def pytest_runtest_logreport(self, report) -> None:
        if report.skipped and "full_data" in report.keywords and report.nodeid not in self.skipped:
            self.skipped.append(report.nodeid)

    def pytest_sessionfinish(self, session) -> None:
        import pytest

        if self.skipped and self._required(session.config):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, config) -> None:
        if self.skipped and self._required(config):
            terminalreporter.section("TRACE_REQUIRE_FULL_DATA=1: full_data tests skipped",
                                     sep="=", red=True, bold=True)
            terminalreporter.line(f"{self.full_data} exists, but these tests that need the full "
                                  "data skipped (the session fails):", red=True)
            for nodeid in self.skipped:
                terminalreporter.line(f"  {nodeid}", red=True)
