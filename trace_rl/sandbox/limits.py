"""What one sandboxed call may use (``SandboxLimits``), and the explicit opt-out of the
namespaces. Read by both sides of a call: ``box`` (the call) and ``host`` (the rlimits set in the
forked child)."""

from __future__ import annotations

import os
from dataclasses import dataclass

UNSAFE_ENV = "TRACE_SANDBOX"
UNSAFE_VALUE = "unsafe-no-namespaces"


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
