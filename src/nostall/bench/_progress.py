"""The benchmark's progress line on standard error."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress report on standard error."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        """Count one unit of work, described by ``what``."""
        self.done += 1
        if not self.enabled:
            return
        width = 24
        filled = width * self.done // max(1, self.total)
        bar = "#" * filled + "-" * (width - filled)
        line = f"[{bar}] {self.done}/{self.total} {time.monotonic() - self.start:5.0f}s {what}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line[:120])
            if self.done >= self.total:
                sys.stderr.write("\n")
        elif 10 * self.done // self.total > 10 * (self.done - 1) // self.total:
            sys.stderr.write(line + "\n")  # a log file gets a line per tenth, not per step
        sys.stderr.flush()
