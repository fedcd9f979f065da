"""A sandbox for model-written Python: one separate, limited process per call.

The math family's ``python(code)`` tool runs untrusted code written by the policy. Each call runs
``<this python> -I`` (isolated mode: no user site, no PYTHON* variables, no cwd on ``sys.path``) in
its own temporary folder, which is deleted afterwards, with these layers of containment:

* resource limits set by ``resource.setrlimit`` in the child before ``exec`` (CPU seconds, address
  space, file size, open files, process count, no core dumps) and a wall-clock timeout;
* a new session and process group, killed as a whole when the call ends; ``PR_SET_PDEATHSIG`` so
  the child dies with its parent;
* where the kernel allows (root, or unprivileged user namespaces): new network and PID namespaces
  (``unshare --net --pid --fork --kill-child``). No network interface is up, and when the
  namespace's first process exits the kernel kills every process left inside it, including
  daemonised grandchildren that left the process group;
* where a pids cgroup can be created (cgroup v1 ``pids`` or v2 with the pids controller): a
  per-call cgroup with ``pids.max``, which also bounds a fork bomb run as root (``RLIMIT_NPROC``
  does not apply to root), and whose members are killed at the end;
* an audit hook (``sys.addaudithook``) installed by a start-up shim before the model's code runs:
  it denies file opens outside the temporary folder (reads of the Python installation excepted),
  deletions/renames/permission changes outside it, socket creation, starting new programs
  (a new program would run without the hook), and ``ctypes`` library loading;
* a final sweep that kills any process still carrying this call's token in its environment.

Threat model, honestly: the audit hook is not a security boundary (CPython documents this; native
code can bypass it). The containment is the namespaces, the cgroup and the rlimits. Without a
mount namespace, file confidentiality and integrity outside the temporary folder rest on the
audit hook plus the user's own file permissions: run training as an unprivileged user or inside a
container when the policy is not trusted. ``probe_containment()`` reports which layers this
machine provides; docs/families.md lists them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TOKEN_VAR = "TRACE_SANDBOX_TOKEN"
_PR_SET_PDEATHSIG = 1
_CGROUP_BASES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one sandboxed call."""

    cpu_seconds: int = 5
    """RLIMIT_CPU: CPU seconds per process before SIGXCPU/SIGKILL."""
    wall_seconds: float = 8.0
    """Wall-clock timeout for the whole call (sleeping or blocked code included); below the ReAct
    loop's default ``tool_timeout_s`` (10 s), so the sandbox, not the loop, ends a slow call."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS: address space per process."""
    max_processes: int = 32
    """Processes the call may hold at once (pids cgroup, else RLIMIT_NPROC above the user's count)."""
    file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: largest file a process may write (stdout and stderr files included)."""
    open_files: int = 64
    """RLIMIT_NOFILE: open file descriptors per process."""
    output_chars: int = 4000
    """Characters of stdout and of stderr kept; the rest is cut with a marker."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "max_processes", "file_bytes",
                     "open_files", "output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    """What one call produced."""

    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass(frozen=True)
class Containment:
    """Which containment layers this machine provides (probed once per process)."""

    namespaces: bool
    """``unshare --net --pid`` works (as root, or through an unprivileged user namespace)."""
    map_root_user: bool
    """Namespaces need ``--map-root-user`` (not root)."""
    pids_cgroup: Path | None
    """A folder under which per-call pids cgroups can be made, or None."""


def _try(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _probe_cgroup() -> Path | None:
    for base in _CGROUP_BASES:
        probe = base / f"trace-probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            probe.mkdir()
        except OSError:
            continue
        try:
            if (probe / "pids.max").exists() and (probe / "cgroup.procs").exists():
                return base
        finally:
            probe.rmdir()
    return None


@functools.lru_cache(maxsize=1)
def probe_containment() -> Containment:
    base = ["unshare", "--net", "--pid", "--fork", "--kill-child"]
    if shutil.which("unshare") and _try(base + ["true"]):
        ns, map_root = True, False
    elif shutil.which("unshare") and _try(base + ["--map-root-user", "true"]):
        ns, map_root = True, True
    else:
        ns, map_root = False, False
    return Containment(namespaces=ns, map_root_user=map_root, pids_cgroup=_probe_cgroup())


# The shim runs first in the sandboxed interpreter: it reads the code, installs the audit hook,
# then executes the code as __main__. ctypes is imported before the hook because its import loads
# the interpreter's own symbols (numpy imports ctypes); later library loads are denied.
_SHIM = r'''
import os, sys
work = os.path.realpath(sys.argv[1]) + os.sep
with open(work + "main.py", encoding="utf-8") as f:
    src = f.read()
try:
    import ctypes
except ImportError:
    pass
roots = tuple({os.path.realpath(p) + os.sep for p in
               (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path) if p})
devs = ("/dev/null", "/dev/urandom", "/dev/random", "/dev/zero")
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "shutil.rmtree": 1, "os.truncate": 1, "os.chmod": 1,
               "os.chown": 1, "os.mkdir": 1, "os.utime": 1, "os.rename": 2, "os.link": 2,
               "os.symlink": 2, "shutil.move": 2, "shutil.copyfile": 2}
DENY = ("socket.__new__", "socket.socketpair", "subprocess.Popen", "os.system", "os.exec",
        "os.posix_spawn", "os.spawn", "os.startfile", "ctypes.dlopen", "ctypes.dlsym",
        "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.addressof", "ctypes.call_function")

def inside(path):
    return (os.path.realpath(path) + os.sep).startswith(work)

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if path is None or isinstance(path, int) or inside(path):
            return
        writing = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & WRITE)
        real = os.path.realpath(path)
        if not writing and (real in devs or (real + os.sep).startswith(roots)):
            return
        raise PermissionError(f"sandbox: access to {path!r} is denied")
    if event in PATH_EVENTS:
        for p in args[:PATH_EVENTS[event]]:
            if isinstance(p, int) or p is None or not inside(os.fsdecode(p)):
                raise PermissionError(f"sandbox: {event} outside the sandbox folder is denied")
        return
    if event in DENY:
        raise PermissionError(f"sandbox: {event} is denied")

sys.addaudithook(hook)
del f
sys.argv = ["main.py"]
code = compile(src, "main.py", "exec")
del src
exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
'''


def _child_setup(limits: SandboxLimits, cgroup: Path | None, nproc: int | None) -> None:
    """Runs in the forked child before exec: join the cgroup, set limits, die with the parent."""
    if cgroup is not None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    cpu = limits.cpu_seconds
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    if nproc is not None:  # None: the pids cgroup bounds the process count instead
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _processes_with_token(token: str) -> list[int]:
    """Pids whose environment carries ``token`` (the sandbox's own marker)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:  # gone, a zombie, or not ours to read
            continue
    return found


def _user_process_count() -> int:
    uid = os.getuid()
    return sum(1 for e in os.scandir("/proc") if e.name.isdigit() and _owner(e.path) == uid)


def _owner(path: str) -> int | None:
    try:
        return os.stat(path).st_uid
    except OSError:
        return None


def _kill_all(proc: subprocess.Popen, cgroup: Path | None, token: str) -> None:
    """Kill the call's process group, its cgroup members and anything carrying its token."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    deadline = time.monotonic() + 5.0
    while True:
        pids = set(_processes_with_token(token))
        if cgroup is not None:
            try:
                pids |= {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"sandbox: processes {sorted(pids)} survived SIGKILL for 5 s")
        time.sleep(0.01)
    if cgroup is not None:
        for _ in range(500):  # the kernel frees a killed cgroup's pids asynchronously
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.01)


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(4 * limit + 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or path.stat().st_size > len(data):
        return text[:limit] + f"\n...[output truncated at {limit} characters]"
    return text


def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
               python: str = sys.executable) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandboxed interpreter; always returns, never leaves
    a process behind (it raises only if a process survives SIGKILL)."""
    box = probe_containment()
    token = secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="trace-sbx-"))
    out = Path(tempfile.mkdtemp(prefix="trace-sbx-out-"))
    cgroup = None
    try:
        (work / "main.py").write_text(code, encoding="utf-8")
        if box.pids_cgroup is not None:
            cgroup = box.pids_cgroup / f"trace-sbx-{token}"
            cgroup.mkdir()
            # +2: the unshare process and the namespace's first process are not the model's
            (cgroup / "pids.max").write_text(str(limits.max_processes + 2))
            nproc = None
        else:
            nproc = _user_process_count() + limits.max_processes + 2
        argv = [python, "-I", "-c", _SHIM, str(work)]
        if box.namespaces:
            argv = ["unshare", "--net", "--pid", "--fork", "--kill-child",
                    *(["--map-root-user"] if box.map_root_user else []), *argv]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work),
               "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", TOKEN_VAR: token}
        t0 = time.monotonic()
        with open(out / "stdout", "wb") as fo, open(out / "stderr", "wb") as fe:
            proc = subprocess.Popen(
                argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                start_new_session=True, close_fds=True,
                preexec_fn=functools.partial(_child_setup, limits, cgroup, nproc))
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_all(proc, cgroup, token)
        wall = time.monotonic() - t0
        stdout = _read(out / "stdout", limits.output_chars)
        stderr = _read(out / "stderr", limits.output_chars)
        rc = None if timed_out else proc.returncode
        return SandboxResult(stdout=stdout, stderr=stderr, returncode=rc, timed_out=timed_out,
                             wall_seconds=wall)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        if cgroup is not None and cgroup.exists():
            try:
                cgroup.rmdir()
            except OSError:
                pass
