"""The sandbox's launcher: builds one call's namespaces and file system, then runs the model's code.

Run by ``trace_rl.sandbox`` as ``<python> -I -S launcher.py <spec json>``, never imported
by the package (it imports only the standard library). The steps, in order:

1. L (this process) reads the model's code from the host folder while it still can.
2. L forks a helper H that stays behind in the host's user namespace, then calls
   ``unshare(CLONE_NEWUSER | NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS | NEWCGROUP)`` (the
   cgroup namespace's root is the call's own pids cgroup, joined before). H writes L's uid and
   gid maps from outside (a process cannot write a multi-line map for itself): as root,
   ``0 -> 0`` for the set-up and ``65534 -> 65534`` for the code; as a user U, only ``65534 -> U``.
3. L forks I, the new PID namespace's first process (pid 1). I dies with L (parent-death signal,
   and a pipe that shows whether L died before that was set). I builds the root: a tmpfs holding
   read-only binds of the interpreter, the virtual environment and the system libraries, the device
   nodes null/zero/full/random/urandom, a fresh ``/proc`` (``/proc/sys`` and friends read-only), an
   empty tmpfs ``/tmp`` as scratch; ``pivot_root`` into it drops the host's file system, and the
   root is then remounted read-only.
4. I drops to uid/gid 65534 with no supplementary groups (so no capabilities survive), sets
   ``no_new_privs``, installs the seccomp filter (x86-64), and ``exec``s ``python -I main.py`` in
   ``/tmp``. From here on the code is pid 1 of its namespace: when it exits, the kernel kills
   everything it left running there.
5. L waits for I and ends the way I ended (same exit status or the same signal). On SIGTERM (the
   host's timeout) it kills I, which takes the whole namespace with it, and waits for that.

Errors before the ``exec`` go to the report pipe (fd ``spec["report_fd"]``, closed at ``exec``), so
the host can tell a broken sandbox from code that fails.
"""

import ctypes
import json
import os
import re
import select
import signal
import struct
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_NEWCGROUP = 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
ST_NOATIME, ST_NODIRATIME, ST_RELATIME = 1024, 2048, 4096
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 4, 38, 22
SECCOMP_MODE_FILTER = 2
SANDBOX_ID = 65534
DEVICES = ("null", "zero", "full", "random", "urandom")
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")

# seccomp (x86-64): system calls the code has no use for and that widen the kernel's attack
# surface or reach outside the namespaces; each fails with EPERM.
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
DENIED_X86_64 = {
    "ptrace": 101, "syslog": 103, "acct": 163, "mount": 165, "umount2": 166, "swapon": 167,
    "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "init_module": 175,
    "delete_module": 176, "quotactl": 179, "pivot_root": 155, "chroot": 161, "kexec_load": 246,
    "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442,
}
CLONE_X86_64, CLONE3_X86_64 = 56, 435
NEW_NAMESPACES = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
                  | CLONE_NEWNET | CLONE_NEWCGROUP)
EPERM, ENOSYS = 1, 38

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                       ctypes.c_ulong]
libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    pass


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def mount(src, dst, fstype, flags, data=None):
    enc = (lambda s: s.encode() if s is not None else None)
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)),
          f"mount {src or fstype} on {dst}")


def lock_flags(path):
    """Mount flags that a remount inside a user namespace must keep (the kernel locks them)."""
    f = os.statvfs(path).f_flag
    flags = (f & (MS_NOSUID | MS_NODEV | MS_NOEXEC)) | (MS_NOATIME if f & ST_NOATIME else 0)
    flags |= (MS_NODIRATIME if f & ST_NODIRATIME else 0) | (MS_RELATIME if f & ST_RELATIME else 0)
    return flags


def submounts(path):
    """Mount points at or below ``path`` (a recursive bind copies them; each needs its own ro)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point == path or point.startswith(path.rstrip("/") + "/"):
                found.append(point)
    return found


def bind_read_only(src, dst):
    mount(src, dst, None, MS_BIND | MS_REC)
    for point in submounts(dst):
        mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
              | lock_flags(point))


def place(root, path, like):
    """Create ``root + path`` as an empty directory or file (a mount point shaped like ``like``)."""
    target = root + path
    if os.path.isdir(like):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        open(target, "a").close()
    return target


def build_root(spec):
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    # The scratch /tmp first: an interpreter or virtual environment that lives under the host's
    # /tmp (a clone in /tmp/x, its .venv bound at /tmp/x/.venv) is then bound inside it, not
    # hidden by it (or refused: "File exists: .../root/tmp").
    os.makedirs(root + "/tmp", mode=0o755)
    scratch_uid = spec["inside_uid"]
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={spec['scratch_bytes']},mode=0700,uid={scratch_uid},gid={scratch_uid}")
    for dst, src in spec["binds"]:
        bind_read_only(src, place(root, dst, src))
    for link, target in spec["symlinks"]:
        os.makedirs(os.path.dirname(root + link), mode=0o755, exist_ok=True)
        os.symlink(target, root + link)
    for dev in DEVICES:
        target = place(root, "/dev/" + dev, "/dev/" + dev)
        mount("/dev/" + dev, target, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc", mode=0o555)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_READ_ONLY:
        path = f"{root}/proc/{name}"
        if os.path.exists(path):
            bind_read_only(path, path)
    os.chdir(root)
    check(libc.syscall(155 if spec["arch"] == "x86_64" else 41, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    libc.sethostname(b"sandbox", 7)


def seccomp_filter():
    """A classic BPF program: x86-64 only (anything else is killed), the deny list gets EPERM,
    clone with a namespace flag gets EPERM, clone3 gets ENOSYS (its flags sit in memory that BPF
    cannot read, and libc falls back to clone). Instructions are (code, jt, jf, k)."""
    ld = lambda offset: (0x20, 0, 0, offset)  # noqa: E731  BPF_LD|BPF_W|BPF_ABS: seccomp_data
    ret = lambda k: (0x06, 0, 0, k)  # noqa: E731
    errno = lambda e: ret(0x00050000 | e)  # noqa: E731  SECCOMP_RET_ERRNO
    jeq_else_skip1 = lambda k: (0x15, 0, 1, k)  # noqa: E731
    prog = [ld(4), (0x15, 1, 0, AUDIT_ARCH_X86_64), ret(0x80000000),  # other ABI: kill
            ld(0), (0x35, 0, 1, X32_SYSCALL_BIT), errno(EPERM)]  # x32 calls: EPERM
    for nr in sorted(DENIED_X86_64.values()):
        prog += [jeq_else_skip1(nr), errno(EPERM)]
    prog += [jeq_else_skip1(CLONE3_X86_64), errno(ENOSYS),
             (0x15, 0, 3, CLONE_X86_64), ld(16), (0x45, 0, 1, NEW_NAMESPACES), errno(EPERM),
             ret(0x7FFF0000)]  # SECCOMP_RET_ALLOW
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog), len(prog)


def install_seccomp():
    code, n = seccomp_filter()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = struct.pack("=HxxxxxxQ", n, ctypes.addressof(buf))
    pbuf = ctypes.create_string_buffer(prog, len(prog))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(pbuf), 0, 0),
          "install the seccomp filter")


def drop_privileges(spec):
    if spec["as_root"]:  # root's groups and uid 0 must not follow the code in
        os.setgroups([])
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    if spec["seccomp"]:
        install_seccomp()


def die_with_launcher(alive):
    """Set the parent-death signal, then make sure L did not die before it was set: its end of
    the ``alive`` pipe (never written) reads as end-of-file once L is gone."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "set the parent-death signal")
    ready, _, _ = select.select([alive], [], [], 0)
    if ready:
        os._exit(1)


def run_init(spec, code, report, alive):
    """pid 1 of the new PID namespace: build the root, drop privileges, exec the code."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_launcher(alive)
    build_root(spec)
    with open("/tmp/main.py", "wb") as f:
        f.write(code)
    os.chdir("/tmp")
    if spec["nproc"]:
        import resource
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    drop_privileges(spec)
    die_with_launcher(alive)  # the uid change cleared the parent-death signal
    os.set_inheritable(report, False)  # closed by the exec: the code cannot fake a set-up error
    os.closerange(3, report)
    os.closerange(report + 1, 1 << 16)  # the alive pipe too
    os.execve(spec["python"], [spec["python"], "-I", "main.py"], spec["env"])


def write_maps(pid, spec):
    """Helper H, still in the host's user namespace: the new namespace's uid and gid maps."""
    if spec["as_root"]:
        uid_map = gid_map = f"0 0 1\n{SANDBOX_ID} {SANDBOX_ID} 1\n"
    else:  # an unprivileged writer may map only its own ids, and must give up setgroups
        with open(f"/proc/{pid}/setgroups", "w") as f:
            f.write("deny")
        uid_map, gid_map = f"{SANDBOX_ID} {os.getuid()} 1\n", f"{SANDBOX_ID} {os.getgid()} 1\n"
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(uid_map)
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(gid_map)


def fail(report, exc):
    os.write(report, f"{type(exc).__name__}: {exc}".encode())
    os._exit(125)


def main():
    spec = json.loads(sys.argv[1])
    report = spec["report_fd"]
    init = []

    def on_term(*_):  # the host's timeout: kill pid 1, which takes the namespace with it
        if init:
            os.kill(init[0], signal.SIGKILL)
        else:
            os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    with open(spec["code"], "rb") as f:
        code = f.read()
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:  # H
        try:
            os.close(go_w)
            if os.read(go_r, 1) != b"1":
                os._exit(1)
            write_maps(os.getppid(), spec)
            os._exit(0)
        except BaseException as exc:  # noqa: BLE001 - reported to the host, never raised there
            fail(report, exc)
    os.close(go_r)
    try:
        check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET
                           | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP),
              "unshare the namespaces")
    except SetupError as exc:
        os.close(go_w)
        os.waitpid(helper, 0)
        fail(report, exc)
    os.write(go_w, b"1")
    os.close(go_w)
    _, status = os.waitpid(helper, 0)
    if status != 0:
        os._exit(125)
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # I
        try:
            os.close(alive_w)
            run_init(spec, code, report, alive_r)
        except BaseException as exc:  # noqa: BLE001
            fail(report, exc)
    init.append(pid)
    os.close(alive_r)
    os.close(report)
    check(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "clear dumpable")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):  # end by the same signal, so the host sees what killed the code
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
