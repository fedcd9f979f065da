"""The host's side of one sandboxed call (``trace_rl.sandbox``): the read-only binds of the
box, the rlimits and parent-death signal set in the forked child, a per-call pids cgroup, the wait
for the launcher, the sweep that kills whatever a call left behind, and its output read back
capped. The namespaces themselves are built inside, by ``launcher.py``.
"""

from __future__ import annotations

import ctypes
import os
import resource
import secrets
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from trace_rl.sandbox.limits import SandboxLimits

TOKEN_VAR = "TRACE_SANDBOX_TOKEN"
"""The environment variable marking an unconfined call's processes (``processes_with_token``)."""
_PR_SET_PDEATHSIG = 1
_CGROUP_BASES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))
_MULTIARCH = sysconfig.get_config_var("MULTIARCH") or ""
_SYSTEM_LIBS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache")
"""Where the dynamic loader finds shared libraries; of ``/lib`` and ``/usr/lib`` only the
platform's multiarch folder (e.g. ``x86_64-linux-gnu``) is bound when there is one."""
LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code in it)."""


def probe_cgroup() -> Path | None:
    """A folder under which this process can make per-call pids cgroups, or None."""
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


def mounts(python: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Read-only binds (path inside, real path outside) and symlinks (path, target) of the box:
    the interpreter's installation, the virtual environment, the system libraries."""
    wanted = [(p, os.path.realpath(p)) for p in (sys.base_prefix, sys.prefix)]
    exe_dir = os.path.dirname(os.path.realpath(python))
    if not any(exe_dir.startswith(real + os.sep) for _, real in wanted):
        wanted.append((exe_dir, exe_dir))
    binds, links = [], []
    for path in _SYSTEM_LIBS:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
            continue
        arch = os.path.join(path, _MULTIARCH)
        if path in ("/lib", "/usr/lib") and _MULTIARCH and os.path.isdir(arch):
            path = arch
        if os.path.exists(path):
            wanted.append((path, path))
    for dst, src in sorted(set(wanted), key=lambda b: len(b[0])):
        if not any(dst == d or dst.startswith(d.rstrip("/") + "/") for d, _ in binds):
            binds.append((dst, src))
    return binds, links


def child_setup(limits: SandboxLimits, cgroup: Path | None, nproc: int | None) -> None:
    """Runs in the forked child before exec: join the cgroup, set limits, die with the parent."""
    if cgroup is not None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    cpu = limits.cpu_seconds
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def processes_with_token(token: str) -> list[int]:
    """Pids whose environment carries ``token`` (the unconfined mode's marker)."""
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


def sweep(cgroup: Path | None, token: str | None) -> None:
    """Kill what is left in the call's cgroup (and, unconfined, what carries its token)."""
    deadline = time.monotonic() + 5.0
    while True:
        pids = set(processes_with_token(token)) if token else set()
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
            raise SandboxError(f"sandbox: processes {sorted(pids)} survived SIGKILL for 5 s")
        time.sleep(0.01)
    if cgroup is not None:
        for _ in range(500):  # the kernel frees a killed cgroup's pids asynchronously
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.01)


def read_capped(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(4 * limit + 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or path.stat().st_size > len(data):
        return text[:limit] + f"\n...[output truncated at {limit} characters]"
    return text


def new_cgroup(base: Path, token: str, pids_max: int) -> Path:
    """A child cgroup of ``base`` for one call, with its process cap."""
    cgroup = base / f"trace-sbx-{token}"
    cgroup.mkdir()
    (cgroup / "pids.max").write_text(str(pids_max))
    return cgroup


def drop_cgroup(cgroup: Path | None) -> None:
    """Remove a call's cgroup once empty (a busy one is left for the kernel to report)."""
    if cgroup is not None and cgroup.exists():
        try:
            cgroup.rmdir()
        except OSError:
            pass


def wait_launcher(proc: subprocess.Popen, wall_seconds: float) -> bool:
    """Wait for the launcher; past the wall limit ask it to stop (it kills the namespace's pid 1
    and waits for it), and kill its process group if it does not within 5 s. True if timed out."""
    try:
        proc.wait(timeout=wall_seconds)
        return False
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return True


def owner(path: str) -> int | None:
    try:
        return os.stat(path).st_uid
    except OSError:
        return None
