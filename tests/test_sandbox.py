"""The sandboxed Python tool: plain code works, a batch of attacks is contained and finishes, no
process is left running afterwards (checked independently of the sandbox's own sweep), and a
machine without namespaces refuses model code unless the user opts out.
tests/test_sandbox_hostile.py holds the full hostile battery."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from sandbox_watch import sandbox_processes

from trace_rl.sandbox import box as sandbox
from trace_rl.sandbox import (SandboxLimits, SandboxUnavailable, probe_containment,
                                    run_python)

# A roomy wall limit: every program must get to run (on a machine at load 16 starting Python in a
# new box took over 2.5 s, and a flood that never started printed nothing to truncate); the CPU
# limit still ends the endless loops in about a second of CPU time, and code that finishes ends
# its box at once, so a roomy limit costs nothing.
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=20, memory_bytes=512 << 20, max_processes=16)


def _sandbox_processes() -> list[psutil.Process]:
    """Every process started by this test process's sandbox calls (tests/sandbox_watch.py)."""
    return sandbox_processes()


def _sandbox_processes_once_settled(patience_s: float = 60) -> list[psutil.Process]:
    """``_sandbox_processes()`` once it is empty, or as it is after ``patience_s``: a process
    killed by the sandbox's sweep can stay listed a moment, until it has been reaped."""
    deadline = time.monotonic() + patience_s
    while (left := _sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _interpreter_under_tmp() -> set[str]:
    """First folders under /tmp of the box's read-only binds (an interpreter or venv that lives
    under the host's /tmp, e.g. a clone in /tmp/x, is bound there inside the scratch /tmp)."""
    from trace_rl.sandbox.host import mounts

    return {dst.split("/")[2] for dst, _ in mounts(sys.executable)[0] if dst.startswith("/tmp/")}


def test_plain_code_runs_and_sees_only_its_folder():
    r = run_python("import os\nopen('a.txt','w').write('hi')\nprint(open('a.txt').read(), "
                   "os.listdir('.'))", LIMITS)
    assert r.ok, r.stderr
    text, listing = r.stdout.split(" ", 1)
    assert text == "hi" and sorted(eval(listing)) == sorted({"a.txt", "main.py"} | _interpreter_under_tmp())


def test_numpy_and_sympy_import_inside():
    r = run_python("import numpy, sympy\nprint(int(numpy.arange(5).sum()), sympy.factorint(60))",
                   SandboxLimits(wall_seconds=20))
    assert r.ok, r.stderr
    assert r.stdout.strip() == "10 {2: 2, 3: 1, 5: 1}"


@pytest.mark.slow  # twelve boxed attacks, two at a time (22 s here)
def test_hostile_batch_is_contained(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-7731")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    attacks = {
        "endless loop": "while True:\n    pass",
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                     "        pass",
        "huge allocation": "x = bytearray(50 * 1024**3)\nprint('allocated')",
        "read outside": f"print(open('/etc/passwd').read())\nprint(open({str(secret)!r}).read())",
        "read outside via os.open": f"import os\nfd = os.open({str(secret)!r}, os.O_RDONLY)\n"
                                    "print(os.read(fd, 100))",
        "socket": "import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
                  "print('connected')",
        "delete outside": f"import os\nos.remove({str(victim)!r})",
        "rmtree outside": f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        "spawn a program": "import subprocess\nprint(subprocess.run(['cat', '/etc/passwd'], "
                           "capture_output=True).stdout)",
        "native escape": "import ctypes\nctypes.CDLL(None).system(b'cat /etc/passwd')",
        "background daemon": "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                             "    if os.fork() == 0:\n        time.sleep(600)\n    os._exit(0)\n"
                             "print('parent leaves')",
        "flood stdout": "while True:\n    print('y' * 1000)",
    }
    limits = LIMITS
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(attacks, pool.map(lambda c: run_python(c, limits), attacks.values())))
    elapsed = time.monotonic() - t0

    assert results["endless loop"].returncode != 0 or results["endless loop"].timed_out
    assert not results["fork bomb"].ok
    assert "allocated" not in results["huge allocation"].stdout
    assert "MemoryError" in results["huge allocation"].stderr
    for name in ("read outside", "read outside via os.open", "spawn a program", "native escape"):
        assert "root:" not in results[name].stdout and "TOP-SECRET" not in results[name].stdout, name
    for name in ("read outside", "read outside via os.open", "spawn a program"):
        # neither the host's files nor its programs exist in the box
        assert "FileNotFoundError" in results[name].stderr, (name, results[name].stderr)
    assert "connected" not in results["socket"].stdout
    assert victim.read_text() == "keep me" and secret.exists()
    assert results["background daemon"].stdout == "parent leaves\n"
    flood = results["flood stdout"]
    assert len(flood.stdout) < limits.output_chars + 100 and "truncated" in flood.stdout
    assert not any(r.timed_out for name, r in results.items() if name not in ("endless loop", "fork bomb")), results
    # every call returned within its wall limit plus the sweep, two at a time
    assert elapsed < len(attacks) * (limits.wall_seconds + 1.0) / 2 + 5
    assert _sandbox_processes_once_settled() == []
    # the batch still works afterwards
    assert run_python("print(6 * 7)", LIMITS).stdout == "42\n"


def test_background_process_killed_even_when_it_leaves_the_group():
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    time.sleep(600)\n"
            "print('spawned')")
    r = run_python(code, LIMITS)
    assert r.stdout == "spawned\n"
    assert _sandbox_processes() == []


def test_host_folders_removed():
    def folders() -> set[str]:
        return {e.name for e in os.scandir(tempfile.gettempdir()) if e.name.startswith("trace-sbx-")}

    before = folders()
    r = run_python("import os\nopen('x', 'w').write('x')\nprint(os.getcwd())", LIMITS)
    assert r.stdout == "/tmp\n"  # the box's own scratch folder
    assert folders() <= before


def test_containment_probe_reports_layers():
    box = probe_containment()
    if os.geteuid() == 0:
        assert box.namespaces, f"running as root, the box should build: {box.reason}"
        if platform.machine() == "x86_64":
            assert box.seccomp
    if not box.namespaces:
        pytest.skip(f"no namespaces here: {box.reason}")
    r = run_python("import os\nprint(os.getpid(), sorted(n for _, n in __import__('socket').if_nameindex()))", LIMITS)
    pid, nets = r.stdout.split(" ", 1)
    assert pid == "1"  # first process of its own PID namespace
    assert nets.strip() == "['lo']"  # a fresh network namespace: loopback only, and down


FORK_COUNT = ("import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
              "            __import__('time').sleep(5)\n            os._exit(0)\n        n += 1\n"
              "except OSError:\n    pass\nprint(os.getuid(), os.path.exists('/etc/passwd'), n)")


def test_box_builds_for_an_unprivileged_user():
    """The launcher's other path: run by a user (uid 1000 in a user namespace, so no cgroup),
    the uid map is written unprivileged and the code is 65534 inside, seeing only the box."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root to start a test process as another user")
    probe = ("import os\nfrom trace_rl.sandbox import run_python, probe_containment\n"
             "assert os.geteuid() == 1000\nbox = probe_containment()\n"
             "assert box.namespaces and box.pids_cgroup is None, box\n"
             "r = run_python('import os\\nprint(os.getuid(), os.path.exists(\"/etc/passwd\"))')\n"
             "print(r.stdout, end='')")
    out = subprocess.run(["unshare", "--user", "--map-user=1000", "--map-group=1000",
                          sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(sandbox.__file__).parents[2])})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "65534 False\n"


def test_process_limit_without_a_cgroup(monkeypatch):
    """No pids cgroup: RLIMIT_NPROC, set inside the box for uid 65534, bounds the processes."""
    box = probe_containment()
    if os.geteuid() != 0 or not box.namespaces:
        pytest.skip("as a user in a user namespace mapped to root, RLIMIT_NPROC does not apply")
    monkeypatch.setattr(sandbox, "probe_containment",
                        lambda: sandbox.Containment(True, box.seccomp, None))
    r = run_python(FORK_COUNT, SandboxLimits(max_processes=8))
    uid, passwd, forks = r.stdout.split()
    assert (uid, passwd) == ("65534", "False") and int(forks) < 8


def test_no_namespaces_refuses_unless_opted_out(monkeypatch):
    def broken(*args, **kwargs):
        raise sandbox.SandboxError("unshare the namespaces: Operation not permitted (errno 1)")

    probe_containment.cache_clear()
    monkeypatch.setattr(sandbox, "_run_boxed", broken)
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    try:
        box = probe_containment()
        assert not box.namespaces and "Operation not permitted" in box.reason
        with pytest.raises(SandboxUnavailable, match="TRACE_SANDBOX=unsafe-no-namespaces"):
            run_python("print(1)", LIMITS)
        from trace_rl.envs.base import TaskItem
        from trace_rl.envs.math.env import MathEnv
        env = MathEnv(limits=LIMITS)
        # An item as the math family's loader makes one (built here: no data file needed).
        item = TaskItem(id="gsm8k-0", family="math", question="What is 6 * 7?", gold="42",
                        meta={"source": "gsm8k"})
        assert env.verify(item, item.gold).reward == 1.0  # grading needs no box
        with pytest.raises(SandboxUnavailable):
            env.reset(item)  # an episode would run model code: refused
        # opting out runs the code unconfined (it sees the host's file system)
        r = run_python("import os\nprint(os.path.exists('/etc/passwd'))",
                       SandboxLimits(unsafe_no_namespaces=True))
        assert r.stdout == "True\n"
        monkeypatch.setenv(sandbox.UNSAFE_ENV, sandbox.UNSAFE_VALUE)
        assert run_python("print(6 * 7)", LIMITS).stdout == "42\n"
        assert _sandbox_processes() == []
    finally:
        probe_containment.cache_clear()


def test_limits_validate():
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxLimits(wall_seconds=0)
