"""Progress of long, quiet work (the SFT bootstrap) for the person watching the terminal.

On a terminal a ``rich`` bar shows steps done, elapsed time and the latest figures. Anywhere else
(a CI log, a pipe, a Prefect worker's log) a bar cannot redraw, so a plain line is printed at each
phase and then at least every ``every_s`` seconds by a heartbeat thread, also while one call runs
for minutes without reporting (a held-out measurement): a run that prints nothing for long reads as
a hang.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from typing import Any, TextIO


class Progress:
    """A bar of ``total`` steps named ``label``, with free-form ``fields`` shown beside it
    (``total`` 0: phases only, no bar to fill).

    ``note(text)`` announces a phase; ``advance(n, **fields)`` moves the bar and updates the
    fields (``epoch="2/8"``, ``loss=0.31``); ``close()`` ends it. Usable as a context manager.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None,
                 every_s: float = 10.0, terminal: bool | None = None, quiet: bool = False) -> None:
        if total < 0:
            raise ValueError(f"Progress({label!r}): total={total} must be >= 0")
        if every_s <= 0:
            raise ValueError(f"Progress({label!r}): every_s={every_s} must be > 0")
        self.label, self.total, self.every_s, self.quiet = label, total, every_s, quiet
        self.stream = stream if stream is not None else sys.stderr
        # Quiet: a watchdog, not a bar. Phases are noted silently; a line appears only when one
        # phase has run for every_s with no line from here, and nothing at all when none does.
        self.terminal = False if quiet else (self.stream.isatty() if terminal is None else terminal)
        self.done = 0
        self.phase: str | None = ""
        self.fields: dict[str, Any] = {}
        self._t0 = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bar: Any = None
        if self.terminal:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn)

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.fields[status]}"),
                                     console=Console(file=self.stream), transient=False)
            self._task = self._bar.add_task(label, total=total or None, status="")
            self._bar.start()
            self._beat = None
        else:
            # The caller's context travels with the thread, so a heartbeat inside a Prefect flow
            # run (print patched by log_prints) lands in that run's log like the other lines.
            context = contextvars.copy_context()
            self._beat = threading.Thread(target=context.run, args=(self._heartbeat,),
                                          name=f"progress-{label}", daemon=True)
            self._beat.start()

    # ------------------------------------------------------------------------------ reporting
    def note(self, text: str | None) -> None:
        """Announce a phase (printed at once, and repeated by the heartbeat while it lasts).
        Quiet: only remembered, and its clock restarts; ``None`` pauses the heartbeat (for a
        phase that reports for itself)."""
        with self._lock:
            self.phase = text
            if self.quiet or text is None:
                self._last = time.monotonic()
            elif self._bar is not None:
                self._bar.console.print(f"{self.label}: {text}")
            else:
                self._line()

    def advance(self, n: int = 1, **fields: Any) -> None:
        """``n`` more steps done; ``fields`` replace the shown figures of the same names."""
        with self._lock:
            self.done += n
            self.fields.update(fields)
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done, status=self.status())
            elif time.monotonic() - self._last >= self.every_s:
                self._line()

    def status(self) -> str:
        """The fields as ``name value`` pairs, floats to 3 decimals."""
        return ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in self.fields.items())

    def close(self) -> None:
        """Stop the heartbeat or the bar; print the final state once."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
            elif not self.quiet:
                self.phase = "done"
                self._line()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------ internals
    def _line(self) -> None:
        """One plain line (caller holds the lock)."""
        elapsed = time.monotonic() - self._t0
        parts = [f"{self.done}/{self.total} steps"] if self.total else []
        parts.append(f"{elapsed:.0f} s")
        if self.phase:
            parts.append(self.phase + (" (still running)" if self.quiet else ""))
        if self.fields:
            parts.append(self.status())
        print(f"{self.label}: " + " | ".join(parts), file=self.stream, flush=True)
        self._last = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s)):
            with self._lock:
                if self.phase is not None and time.monotonic() - self._last >= self.every_s:
                    self._line()


class Silent:
    """``Progress``'s interface doing nothing, for callers that asked for no output."""

    def note(self, text: str) -> None:
        pass

    def advance(self, n: int = 1, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "Silent":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass
