"""The browser tests' chromium (tests/browser.py): where none can be had, a browser test skips
saying why, or fails under ``TRACE_REQUIRE_BROWSER=1`` (``.ci/run``), so CI never passes without
its UI checks."""

from __future__ import annotations

import pytest

import browser


@pytest.fixture(autouse=True)
def fresh_install_memo():
    """``install_chromium`` answers once per process: each test here asks anew."""
    browser.install_chromium.cache_clear()
    yield
    browser.install_chromium.cache_clear()


@pytest.fixture
def no_chromium(monkeypatch):
    """A machine without chromium whose user cannot install it (not root)."""
    monkeypatch.setattr(browser.shutil, "which", lambda name: None)
    monkeypatch.setattr(browser.os, "geteuid", lambda: 1000)


def test_without_a_browser_a_browser_test_skips_saying_why(no_chromium, monkeypatch):
    monkeypatch.delenv("TRACE_REQUIRE_BROWSER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="chromium is not installed and this user "
                                                    "cannot apt-get install it"):
        browser.chromium_or_skip()


def test_ci_fails_a_browser_test_that_has_no_browser(no_chromium, monkeypatch):
    monkeypatch.setenv("TRACE_REQUIRE_BROWSER", "1")
    with pytest.raises(pytest.fail.Exception, match="TRACE_REQUIRE_BROWSER=1 and no browser: "
                                                    "chromium is not installed"):
        browser.chromium_or_skip()


def test_an_installed_browser_is_used(monkeypatch):
    monkeypatch.setattr(browser.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setenv("TRACE_REQUIRE_BROWSER", "1")
    assert browser.chromium_or_skip() == "/opt/bin/chromium"
