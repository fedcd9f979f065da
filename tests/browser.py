"""Headless Debian chromium for the browser tests (tests/test_view.py, tests/test_ui.py): the DOM
of a page after its scripts ran and what it wrote to its console."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path


@functools.cache
def install_chromium() -> str | None:
    """Debian's chromium: on PATH, or installed with apt-get (as root); else why not. One process
    at a time installs (a file lock in the machine's temporary folder): two xdist workers must not
    race for dpkg's lock, the loser skipping its browser tests. Once per process: a failed install
    (up to 600 s of apt-get) is not retried by every browser test."""
    import fcntl
    import tempfile

    if shutil.which("chromium"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "chromium is not installed and this user cannot apt-get install it (not root)"
    base = os.environ.get("TRACE_TESTS_BASE_TMP", tempfile.gettempdir())
    with open(Path(base) / "trace-chromium-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shutil.which("chromium"):  # another process installed it while this one waited
            return None
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in (["apt-get", "install", "-y", "chromium"],
                    ["sh", "-c", "apt-get update && apt-get install -y chromium"]):
            try:  # bounded: a package mirror that does not answer must not stall the suite
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
            except subprocess.TimeoutExpired:
                return f"apt-get did not finish installing chromium in 300 s ({' '.join(cmd)})"
            if done.returncode == 0 and shutil.which("chromium"):
                return None
    return f"apt-get could not install chromium: {(done.stdout + done.stderr).strip()[-300:]}"


def chromium_or_skip() -> str:
    """The chromium executable for a browser test, installed if need be; if there is none, the
    test skips saying why, or, with ``TRACE_REQUIRE_BROWSER=1`` (``.ci/run``), fails: CI never
    passes without its browser checks (the Prefect and MLflow UI pages, the tree viewer)."""
    import pytest

    why = install_chromium()
    if why is None:
        return shutil.which("chromium")
    if os.environ.get("TRACE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"TRACE_REQUIRE_BROWSER=1 and no browser: {why}", pytrace=False)
    pytest.skip(why)


if __name__ == "__main__":  # scripts/test.sh: install once, before the workers start
    print(f"browser tests: {install_chromium() or 'chromium ' + shutil.which('chromium')}")


class Chromium:
    """Headless chromium: the DOM after the page's scripts ran, and what it wrote to its console
    (``--enable-logging=stderr`` prints each console message as an ``INFO:CONSOLE`` line)."""

    def __init__(self, exe: str, profile: Path):
        self.exe, self.profile = exe, profile

    def load(self, url: str, *extra: str) -> tuple[str, list[str]]:
        out = subprocess.run([self.exe, "--headless", "--no-sandbox", "--disable-gpu",
                              "--no-first-run", f"--user-data-dir={self.profile}",
                              "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000",
                              *extra, "--dump-dom", url],
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
        return out.stdout, console


class Page:
    """One tab of a headless chromium driven over the DevTools protocol (``websockets``), for
    single-page apps that a DOM dump cannot judge (the Prefect and MLflow UIs): navigate, wait
    for a condition, click, read the page's text, and collect its console errors, uncaught
    exceptions and failed loads (``errors``). ``profile``: a fresh folder is a fresh browser.
    Use as a context manager; the browser is stopped on exit."""

    def __init__(self, exe: str, profile: Path, width: int = 1400, height: int = 900):
        self.profile, self.errors, self._id = profile, [], 0
        profile.mkdir(parents=True, exist_ok=True)
        (profile / "DevToolsActivePort").unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def __enter__(self) -> "Page":
        import json
        import time
        import urllib.request

        from websockets.sync.client import connect

        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert self.proc.poll() is None, "chromium exited"
            assert time.monotonic() < deadline, "chromium opened no DevTools port in 60 s"
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            [target] = [t for t in json.load(r) if t["type"] == "page"]
        self.ws = connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        try:
            self.ws.close()
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def _event(self, msg: dict) -> None:
        method, p = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description")))
                                                     for a in p["args"]))
        elif method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.errors.append("exception: " + d.get("exception", {}).get("description", d["text"]))
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.errors.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")

    def call(self, method: str, timeout: float = 60, **params: object) -> dict:
        import json
        import time

        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            if msg.get("id") == self._id:
                assert "error" not in msg, (method, msg["error"])
                return msg.get("result", {})
            self._event(msg)

    def eval(self, js: str) -> object:
        out = self.call("Runtime.evaluate", expression=js, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in out, (js, out["exceptionDetails"])
        return out["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, js: str, within: float = 60, what: str = "") -> object:
        """Poll the expression ``js`` until it is truthy; return it (fail after ``within`` s,
        showing the page's text)."""
        import time

        deadline = time.monotonic() + within
        while True:
            try:
                value = self.eval(js)
            except (AssertionError, TimeoutError):  # mid-navigation: no context yet
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not in {within:.0f} s: {what or js}\npage text:\n"
                                     f"{(self.text() or '')[:3000]}\nerrors: {self.errors}")
            self.call("Runtime.evaluate", expression="0")  # drains events while waiting
            time.sleep(0.5)

    def text(self) -> str:
        return str(self.eval("document.body ? document.body.innerText : ''") or "")

    def click_text(self, text: str, selector: str = "button, a, [role=tab], li") -> None:
        """Click the first element of ``selector`` whose own text is ``text``."""
        import json

        clicked = self.eval(f"""(() => {{
            const el = [...document.querySelectorAll({json.dumps(selector)})]
                .find(e => e.innerText && e.innerText.trim() === {json.dumps(text)});
            if (el) el.click();
            return !!el; }})()""")
        assert clicked, f"nothing to click reads {text!r}:\n{self.text()[:2000]}"
