"""Model-written Python run in a box of its own, contained by the operating system (one call, one
box): ``run_python(code, limits)``. The math family's ``python`` tool uses it; nothing here knows
about families.

``box`` is the call (namespaces or the explicit opt-out, the result), ``host`` the host's side
of it (binds, rlimits, cgroup, sweep), ``launcher`` the script that builds the namespaces inside
(run by path, never imported), and ``limits`` what a call may use. docs/families.md, "The
sandbox", says what the walls are and how they were tested.
"""

from trace_rl.sandbox.box import (Containment, SandboxResult, SandboxUnavailable, probe_containment,
                                  require_sandbox, run_python)
from trace_rl.sandbox.host import SandboxError
from trace_rl.sandbox.limits import UNSAFE_ENV, UNSAFE_VALUE, SandboxLimits

__all__ = ["UNSAFE_ENV", "UNSAFE_VALUE", "Containment", "SandboxError", "SandboxLimits",
           "SandboxResult", "SandboxUnavailable", "probe_containment", "require_sandbox",
           "run_python"]
