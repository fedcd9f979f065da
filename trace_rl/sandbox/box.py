"""A sandbox for model-written Python, contained by the operating system: one call, one box.

The math family's ``python(code)`` tool runs untrusted code written by the policy. Each call gets
its own user, mount, PID, network, IPC and UTS namespaces, built by ``launcher.py`` (read its
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

import fcntl
import functools
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import trace_rl.sandbox.host as host
from trace_rl.sandbox.host import TOKEN_VAR, SandboxError
from trace_rl.sandbox.limits import UNSAFE_ENV, UNSAFE_VALUE, SandboxLimits

_INIT = Path(__file__).with_name("launcher.py")
_SETUP_FAILED = 125
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class SandboxUnavailable(RuntimeError):
    """The machine cannot build the sandbox's namespaces, and no one opted out."""


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


@functools.lru_cache(maxsize=1)
def probe_containment(python: str = sys.executable) -> Containment:
    """Build one box with and, if that fails, without seccomp; report what worked."""
    cgroup = host.probe_cgroup()
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


def _run_boxed(code: str, limits: SandboxLimits, python: str, cgroup_base: Path | None,
               seccomp: bool) -> SandboxResult:
    """One call in its own namespaces (``launcher.py``); raises ``SandboxError`` when the
    box could not be built."""
    binds, links = host.mounts(python)
    scratch = Path(tempfile.mkdtemp(prefix="trace-sbx-"))
    report_r, report_w = os.pipe()
    cgroup = None
    try:
        (scratch / "main.py").write_text(code, encoding="utf-8")
        (scratch / "root").mkdir()
        if cgroup_base is not None:
            # +2: the launcher and its helper are not the model's
            cgroup = host.new_cgroup(cgroup_base, secrets.token_hex(16), limits.max_processes + 2)
        spec = {"code": str(scratch / "main.py"), "root": str(scratch / "root"), "binds": binds,
                "symlinks": links, "python": python, "env": _ENV, "report_fd": report_w,
                "as_root": os.geteuid() == 0, "inside_uid": 65534, "seccomp": seccomp,
                "arch": platform.machine(), "scratch_bytes": limits.scratch_bytes,
                "nproc": None if cgroup is not None else limits.max_processes}
        argv = [python, "-I", "-S", str(_INIT), json.dumps(spec)]
        t0 = time.monotonic()
        with open(scratch / "stdout", "wb") as fo, open(scratch / "stderr", "wb") as fe:
            proc = subprocess.Popen(
                argv, cwd="/", env={}, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                start_new_session=True, close_fds=True, pass_fds=(report_w,),
                preexec_fn=functools.partial(host.child_setup, limits, cgroup, None))
            os.close(report_w)
            report_w = -1
            timed_out = host.wait_launcher(proc, limits.wall_seconds)
            host.sweep(cgroup, None)
        wall = time.monotonic() - t0
        fcntl.fcntl(report_r, fcntl.F_SETFL, os.O_NONBLOCK)
        try:
            failure = os.read(report_r, 1 << 16).decode(errors="replace")
        except BlockingIOError:
            failure = ""
        if failure:
            raise SandboxError(f"sandbox set-up failed: {failure}")
        return SandboxResult(stdout=host.read_capped(scratch / "stdout", limits.output_chars),
                             stderr=host.read_capped(scratch / "stderr", limits.output_chars),
                             returncode=None if timed_out else proc.returncode,
                             timed_out=timed_out, wall_seconds=wall)
    finally:
        os.close(report_r)
        if report_w >= 0:
            os.close(report_w)
        shutil.rmtree(scratch, ignore_errors=True)
        host.drop_cgroup(cgroup)


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
            cgroup = host.new_cgroup(cgroup_base, token, limits.max_processes)
            nproc = None
        else:
            uid = os.getuid()
            mine = sum(1 for e in os.scandir("/proc") if e.name.isdigit()
                       and host.owner(e.path) == uid)
            nproc = mine + limits.max_processes
        env = {**_ENV, "HOME": str(work), "TMPDIR": str(work), TOKEN_VAR: token}
        t0 = time.monotonic()
        with open(out / "stdout", "wb") as fo, open(out / "stderr", "wb") as fe:
            proc = subprocess.Popen(
                [python, "-I", "main.py"], cwd=work, env=env, stdin=subprocess.DEVNULL,
                stdout=fo, stderr=fe, start_new_session=True, close_fds=True,
                preexec_fn=functools.partial(host.child_setup, limits, cgroup, nproc))
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
                host.sweep(cgroup, token)
        return SandboxResult(stdout=host.read_capped(out / "stdout", limits.output_chars),
                             stderr=host.read_capped(out / "stderr", limits.output_chars),
                             returncode=None if timed_out else proc.returncode,
                             timed_out=timed_out, wall_seconds=time.monotonic() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        host.drop_cgroup(cgroup)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
               python: str = sys.executable) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandbox; always returns, never leaves a process
    behind. Raises ``SandboxUnavailable`` when the box cannot be built and ``limits`` does not
    opt out, ``SandboxError`` when the sandbox itself breaks."""
    box = require_sandbox(limits)
    if not box.namespaces:
        return _run_unconfined(code, limits, python, box.pids_cgroup)
    return _run_boxed(code, limits, python, box.pids_cgroup, box.seccomp)
