"""Sandbox processes this test process started, found machine-wide (independently of the
sandbox's own sweep), so that two pytest workers, or two people's test runs on one machine, never
read each other's live sandboxes as leaks.

Each test process has its own temporary root (tests/conftest.py points ``TMPDIR`` at it), and every
sandbox call makes its scratch folder there: a launcher names that folder in its argv, and the code
it runs (uid 65534 when the tests run as root) has that launcher as an ancestor, or, unconfined,
the folder as its working directory. A sandbox process that cannot be traced to any launcher or
folder counts as ours: it would be an escape."""

from __future__ import annotations

import os
import tempfile

import psutil

LAUNCHER_MARK = "trace-sbx-"


def _text(p: psutil.Process) -> str:
    return " ".join(p.cmdline())


def _is_ours(p: psutil.Process, root: str) -> bool:
    cmd = _text(p)
    if LAUNCHER_MARK in cmd:
        return root in cmd
    try:
        if p.cwd().startswith(root):
            return True
    except psutil.Error:
        pass
    for parent in p.parents():
        try:
            text = _text(parent)
        except psutil.Error:
            continue
        if LAUNCHER_MARK in text:
            return root in text
    return True


def sandbox_processes() -> list[psutil.Process]:
    """Live processes of this test process's sandbox calls."""
    root = tempfile.gettempdir()
    found = []
    for p in psutil.process_iter(["cmdline", "uids"]):
        try:
            cmd = p.info["cmdline"] or []
            if not (any(LAUNCHER_MARK in a for a in cmd)
                    or (os.geteuid() == 0 and p.info["uids"].real == 65534)):
                continue
            if _is_ours(p, root):
                found.append(p)
        except psutil.Error:
            continue
    return found
