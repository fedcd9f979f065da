"""SmolLM2's converted directory lives in the machine's cache that every other cached policy uses
(``$TRACE_CACHE_DIR``, else ``$XDG_CACHE_HOME/trace-rl``, else ``~/.cache/trace-rl``): it once read
its own ``$TRACE_RL_CACHE``, so a fresh-machine check with a new ``TRACE_CACHE_DIR`` still reused a
warm ~/.cache. Processes converting at once take turns, and a reader never sees half a model.

The conversion itself (GGUF -> safetensors, ~20 s) runs in the tests that load SmolLM2
(tests/test_real_data.py, tests/test_exit.py); here a stand-in converter (``slow_fake_convert``)
writes a small directory slowly, so that the cache's placement and its lock are what is tested."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    import trace_rl.policy.smollm as smollm

    def slow_fake_convert(out: Path) -> dict:  # stands in for the ~20 s GGUF conversion
        out.mkdir(parents=True)
        (out / "model.safetensors").write_text("half")
        time.sleep(1.5)
        (out / "model.safetensors").write_text("whole")
        with open({log!r}, "a") as f:
            f.write("converted\\n")
        return {{"gguf": "fake"}}

    smollm._convert = slow_fake_convert
    d = smollm.smollm2_dir()
    print(d, (d / "model.safetensors").read_text())
""")


def _start(tmp_path: Path, env: dict[str, str]) -> subprocess.Popen:
    code = CHILD.format(repo=str(REPO), log=str(tmp_path / "log"))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_smollm2_dir_is_in_trace_cache_dir_and_converted_once_by_concurrent_processes(tmp_path):
    import os

    cache = tmp_path / "cache"
    env = {**os.environ, "TRACE_CACHE_DIR": str(cache), "HOME": str(tmp_path / "home")}
    procs = [_start(tmp_path, env)]
    time.sleep(0.3)
    procs.append(_start(tmp_path, env))
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    want = cache / "smollm2-135m-instruct"
    for out, _ in outs:
        assert out.split() == [str(want), "whole"]  # the finished directory, never half of it
    assert (tmp_path / "log").read_text().splitlines() == ["converted"]  # once, not twice
    assert not (tmp_path / "home" / ".cache").exists()  # nothing under ~/.cache
    leftovers = [p.name for p in cache.iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers  # the staging directory is gone


def test_a_finished_directory_is_reused_without_converting(tmp_path, monkeypatch):
    import trace_rl.policy.smollm as smollm

    monkeypatch.setenv("TRACE_CACHE_DIR", str(tmp_path))
    done = tmp_path / "smollm2-135m-instruct"
    done.mkdir()
    (done / ".complete").write_text("x\n")
    monkeypatch.setattr(smollm, "_convert", lambda out: (_ for _ in ()).throw(AssertionError("converted")))
    assert smollm.smollm2_dir() == done
