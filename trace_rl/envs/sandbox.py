"""A sandbox for model-written Python, contained by the operating system: one call, one box.

The math family's ``python(code)`` tool runs untrusted code written by the policy. Each call gets
its own user, mount, PID, network, IPC and UTS namespaces, built by ``sandbox_init.py`` (read its
docstring for the steps):

* **File system.** A new root (tmpfs, then read-only) holding read-only binds of only the
  interpreter, the virtual environment and the shared libraries (``/usr/lib/<multiarch>``,
  ``/usr/lib64``, ``/usr/local/lib``, ``/etc/ld.so.cache``); five device nodes; a fresh ``/proc``
  of the new PID namespace (its ``sys``, ``sysrq-trigger``, ``irq`` and ``bus`` read-only); an
  empty, size-limited tmpfs ``/tmp`` as the working folder. No work dir, no host ``/proc``,
  ``/tmp``, ``/run``, ``/home``, ``/etc``, no shell (``/bin`` and ``/usr/bin`` are not there), no
  databases, no host Unix sockets.
* **Identity.** uid/gid 65534 with no supplementary groups, mapped to the host's 65534 (nobody)
  when TRACE runs as root, so even a file system escape lands as nobody; no capabilities;
  ``no_new_privs``.
* **Kernel surface.** On x86-64 a seccomp filter refuses (EPERM) ptrace, process_vm_*, mount and
  friends, unshare/setns and namespace flags to clone, keyrings, bpf, perf_event_open,
  userfaultfd, io_uring, kernel modules, kexec, reboot and swap calls; other ABIs are killed.
* **Network and IPC.** A new network namespace with only a loopback that is down (abstract Unix
  sockets are per network namespace, so the host's are gone too); a new IPC namespace.
* **Processes.** The code is pid 1 of its PID namespace: when it exits or is killed, the kernel
  kills everything it left behind. A per-call pids cgroup (``pids.max``) where one can be made,
  else RLIMIT_NPROC; rlimits for CPU seconds, address space, file size, open files, no core
  dumps; a wall-clock timeout; the output cut at ``output_chars``.

Why our own launcher and not bubblewrap or nsjail: neither ships on a fresh machine of this kind
(CI would need apt and a network at set-up), and run as root bubblewrap maps the sandbox's uid
onto the caller's, i.e. host root; ours maps it onto host nobody. ``unshare`` and
``pivot_root`` come from the kernel through ``ctypes``; nothing else is needed.

There is no in-process audit hook any more: code can rewrite a hook that lives in its own
interpreter (the old one was turned off through ``sys.modules['__main__']``, ``gc`` and
``subprocess.sys``), and native code never meets it. The tests run the hostile programs against
these walls alone (tests/test_sandbox_hostile.py).

Where the machine cannot build the namespaces (``probe_containment()`` says why), ``run_python``
raises ``SandboxUnavailable`` instead of running model code. Opting out is explicit:
``SandboxLimits(unsafe_no_namespaces=True)`` or ``TRACE_SANDBOX=unsafe-no-namespaces``; the code
then runs as a plain child process with the same rlimits, cgroup and timeout, and can read and
write whatever the user running TRACE can.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import os
import platform
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

UNSAFE_ENV = "TRACE_SANDBOX"
UNSAFE_VALUE = "unsafe-no-namespaces"
TOKEN_VAR = "TRACE_SANDBOX_TOKEN"
_INIT = Path(__file__).with_name("sandbox_init.py")
_PR_SET_PDEATHSIG = 1
_CGROUP_BASES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))
_MULTIARCH = sysconfig.get_config_var("MULTIARCH") or ""
_SYSTEM_LIBS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache")
"""Where the dynamic loader finds shared libraries; of ``/lib`` and ``/usr/lib`` only the
platform's multiarch folder (e.g. ``x86_64-linux-gnu``) is bound when there is one."""
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child
_SETUP_FAILED = 125


class SandboxUnavailable(RuntimeError):
    """The machine cannot build the sandbox's namespaces, and no one opted out."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code in it)."""


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
    """Processes the call may hold at once (pids cgroup, else RLIMIT_NPROC inside the box)."""
    file_bytes: int = 16 << 20
    """RLIMIT_FSIZE: largest file a process may write (stdout and stderr files included)."""
    scratch_bytes: int = 64 << 20
    """Size of the writable scratch folder ``/tmp`` (a tmpfs: it counts as memory)."""
    open_files: int = 64
    """RLIMIT_NOFILE: open file descriptors per process."""
    output_chars: int = 4000
    """Characters of stdout and of stderr kept; the rest is cut with a marker."""
    unsafe_no_namespaces: bool = False
    """Opt out of the namespaces where the machine has none: the code then runs as a plain
    limited child process that can read and write anything the user running TRACE can. Off by
    default; ``TRACE_SANDBOX=unsafe-no-namespaces`` in the environment opts out too."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "max_processes", "file_bytes",
                     "scratch_bytes", "open_files", "output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")

    @property
    def opted_out(self) -> bool:
        return self.unsafe_no_namespaces or os.environ.get(UNSAFE_ENV) == UNSAFE_VALUE


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
    """The full box builds: user, mount, PID, network, IPC and UTS namespaces, the new root."""
    seccomp: bool
    """The seccomp filter is installed (x86-64 only)."""
    pids_cgroup: Path | None
    """A folder under which per-call pids cgroups can be made, or None."""
    reason: str = ""
    """Why ``namespaces`` is False (the launcher's error), else empty."""


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
def probe_containment(python: str = sys.executable) -> Containment:
    """Build one box with and, if that fails, without seccomp; report what worked."""
    cgroup = _probe_cgroup()
    limits = SandboxLimits(wall_seconds=30)
    reason = ""
    for seccomp in ((True, False) if platform.machine() == "x86_64" else (False,)):
        try:
            r = _run_boxed("print('ok')", limits, python, cgroup, seccomp)
        except SandboxError as exc:
            reason = str(exc)
            continue
        if r.stdout == "ok\n":
            return Containment(namespaces=True, seccomp=seccomp, pids_cgroup=cgroup)
        reason = f"the probe printed {r.stdout!r}, stderr {r.stderr[-500:]!r}"
    return Containment(namespaces=False, seccomp=False, pids_cgroup=cgroup, reason=reason)


def require_sandbox(limits: SandboxLimits = SandboxLimits()) -> Containment:
    """The machine's containment; raises ``SandboxUnavailable`` when the box cannot be built and
    ``limits`` does not opt out."""
    box = probe_containment()
    if not box.namespaces and not limits.opted_out:
        raise SandboxUnavailable(
            "refusing to run model-written code: this machine cannot build the sandbox's "
            f"namespaces ({box.reason or 'unknown reason'}). Run as root or enable unprivileged "
            "user namespaces (sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone), "
            f"or opt out explicitly with {UNSAFE_ENV}={UNSAFE_VALUE} or "
            "SandboxLimits(unsafe_no_namespaces=True) to run it unconfined.")
    return box


def _mounts(python: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
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
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _processes_with_token(token: str) -> list[int]:
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


def _sweep(cgroup: Path | None, token: str | None) -> None:
    """Kill what is left in the call's cgroup (and, unconfined, what carries its token)."""
    deadline = time.monotonic() + 5.0
    while True:
        pids = set(_processes_with_token(token)) if token else set()
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


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(4 * limit + 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or path.stat().st_size > len(data):
        return text[:limit] + f"\n...[output truncated at {limit} characters]"
    return text


_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _new_cgroup(base: Path, token: str, pids_max: int) -> Path:
    """A child cgroup of ``base`` for one call, with its process cap."""
    cgroup = base / f"trace-sbx-{token}"
    cgroup.mkdir()
    (cgroup / "pids.max").write_text(str(pids_max))
    return cgroup


def _drop_cgroup(cgroup: Path | None) -> None:
    """Remove a call's cgroup once empty (a busy one is left for the kernel to report)."""
    if cgroup is not None and cgroup.exists():
        try:
            cgroup.rmdir()
        except OSError:
            pass


def _wait_launcher(proc: subprocess.Popen, wall_seconds: float) -> bool:
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


def _run_boxed(code: str, limits: SandboxLimits, python: str, cgroup_base: Path | None,
               seccomp: bool) -> SandboxResult:
    """One call in its own namespaces (``sandbox_init.py``); raises ``SandboxError`` when the
    box could not be built."""
    binds, links = _mounts(python)
    host = Path(tempfile.mkdtemp(prefix="trace-sbx-"))
    report_r, report_w = os.pipe()
    cgroup = None
    try:
        (host / "main.py").write_text(code, encoding="utf-8")
        (host / "root").mkdir()
        if cgroup_base is not None:
            # +2: the launcher and its helper are not the model's
            cgroup = _new_cgroup(cgroup_base, secrets.token_hex(16), limits.max_processes + 2)
        spec = {"code": str(host / "main.py"), "root": str(host / "root"), "binds": binds,
                "symlinks": links, "python": python, "env": _ENV, "report_fd": report_w,
                "as_root": os.geteuid() == 0, "inside_uid": 65534, "seccomp": seccomp,
                "arch": platform.machine(), "scratch_bytes": limits.scratch_bytes,
                "nproc": None if cgroup is not None else limits.max_processes}
        argv = [python, "-I", "-S", str(_INIT), json.dumps(spec)]
        t0 = time.monotonic()
        with open(host / "stdout", "wb") as fo, open(host / "stderr", "wb") as fe:
            proc = subprocess.Popen(
                argv, cwd="/", env={}, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                start_new_session=True, close_fds=True, pass_fds=(report_w,),
                preexec_fn=functools.partial(_child_setup, limits, cgroup, None))
            os.close(report_w)
            report_w = -1
            timed_out = _wait_launcher(proc, limits.wall_seconds)
            _sweep(cgroup, None)
        wall = time.monotonic() - t0
        fcntl.fcntl(report_r, fcntl.F_SETFL, os.O_NONBLOCK)
        try:
            failure = os.read(report_r, 1 << 16).decode(errors="replace")
        except BlockingIOError:
            failure = ""
        if failure:
            raise SandboxError(f"sandbox set-up failed: {failure}")
        return SandboxResult(stdout=_read(host / "stdout", limits.output_chars),
                             stderr=_read(host / "stderr", limits.output_chars),
                             returncode=None if timed_out else proc.returncode,
                             timed_out=timed_out, wall_seconds=wall)
    finally:
        os.close(report_r)
        if report_w >= 0:
            os.close(report_w)
        shutil.rmtree(host, ignore_errors=True)
        _drop_cgroup(cgroup)


def _run_unconfined(code: str, limits: SandboxLimits, python: str,
                    cgroup_base: Path | None) -> SandboxResult:
    """The explicit opt-out: a plain ``python -I`` child in a temporary folder, with the rlimits,
    cgroup and timeout, killed by process group, cgroup and an environment token at the end."""
    token = secrets.token_hex(16)
    work = Path(tempfile.mkdtemp(prefix="trace-sbx-"))
    out = Path(tempfile.mkdtemp(prefix="trace-sbx-out-"))
    cgroup = None
    try:
        (work / "main.py").write_text(code, encoding="utf-8")
        if cgroup_base is not None:
            cgroup = _new_cgroup(cgroup_base, token, limits.max_processes)
            nproc = None
        else:
            uid = os.getuid()
            mine = sum(1 for e in os.scandir("/proc") if e.name.isdigit()
                       and _owner(e.path) == uid)
            nproc = mine + limits.max_processes
        env = {**_ENV, "HOME": str(work), "TMPDIR": str(work), TOKEN_VAR: token}
        t0 = time.monotonic()
        with open(out / "stdout", "wb") as fo, open(out / "stderr", "wb") as fe:
            proc = subprocess.Popen(
                [python, "-I", "main.py"], cwd=work, env=env, stdin=subprocess.DEVNULL,
                stdout=fo, stderr=fe, start_new_session=True, close_fds=True,
                preexec_fn=functools.partial(_child_setup, limits, cgroup, nproc))
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                _sweep(cgroup, token)
        return SandboxResult(stdout=_read(out / "stdout", limits.output_chars),
                             stderr=_read(out / "stderr", limits.output_chars),
                             returncode=None if timed_out else proc.returncode,
                             timed_out=timed_out, wall_seconds=time.monotonic() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        _drop_cgroup(cgroup)


def _owner(path: str) -> int | None:
    try:
        return os.stat(path).st_uid
    except OSError:
        return None


def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
               python: str = sys.executable) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandbox; always returns, never leaves a process
    behind. Raises ``SandboxUnavailable`` when the box cannot be built and ``limits`` does not
    opt out, ``SandboxError`` when the sandbox itself breaks."""
    box = require_sandbox(limits)
    if not box.namespaces:
        return _run_unconfined(code, limits, python, box.pids_cgroup)
    return _run_boxed(code, limits, python, box.pids_cgroup, box.seccomp)
