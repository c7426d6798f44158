"""A one-line progress bar on stderr, without dependencies."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Progress of ``total`` steps, drawn on ``stream`` (stderr).

    Drawn only when ``enabled`` (default: when the stream is a terminal). On a terminal the
    bar redraws itself in place; otherwise (``enabled=True`` with a redirected stream) each
    update is one line, so logs stay readable. Call :meth:`clear` before printing to
    stdout on the same terminal, and :meth:`close` at the end.
    """

    def __init__(self, total: int, label: str, *, enabled: bool | None = None, stream: TextIO | None = None,
                 width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = self.tty if enabled is None else enabled
        self.total, self.label, self.width = max(total, 1), label, width
        self.start = time.monotonic()
        self._drawn = False

    def update(self, done: int, note: str = "") -> None:
        """Show ``done`` of ``total`` steps finished, with an optional note."""
        if not self.enabled:
            return
        frac = min(done / self.total, 1.0)
        filled = int(round(frac * self.width))
        elapsed = time.monotonic() - self.start
        eta = f", ~{elapsed / done * (self.total - done):.0f} s left" if 0 < done < self.total else ""
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total}"
                f" ({elapsed:.0f} s{eta}){' ' + note if note else ''}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the bar from the terminal line (no-op when nothing is drawn)."""
        if self._drawn:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._drawn = False

    def close(self) -> None:
        self.clear()
