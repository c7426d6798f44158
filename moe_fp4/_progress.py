"""A progress bar on stderr: tqdm on a terminal where tqdm is installed, plain text lines otherwise.

tqdm is optional (not a dependency of moe_fp4).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


def _tqdm():
    """tqdm's bar class, or None where tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """Progress over ``total`` steps, drawn on ``stream`` (default: stderr).

    Drawn only when ``enabled`` (default: when the stream is a terminal). On a terminal with
    tqdm installed it is a tqdm bar, erased at :meth:`close`; otherwise each :meth:`update`
    writes one line, ``label [####......] done/total (elapsed s, ~N s left) note``, so logs
    stay readable. Print other output through :meth:`write`, which keeps it clear of the bar.
    """

    def __init__(self, total: int, label: str, *, enabled: bool | None = None, stream: TextIO | None = None,
                 unit: str = "step", width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = tty if enabled is None else enabled
        self.total, self.label, self.width = max(total, 1), label, width
        self.done = 0
        self.start = time.monotonic()
        tqdm = _tqdm() if self.enabled and tty else None
        self._bar = None if tqdm is None else tqdm(total=self.total, desc=label, unit=unit, file=self.stream,
                                                   leave=False, dynamic_ncols=True)

    def update(self, n: int = 1, note: str = "") -> None:
        """``n`` more steps are done (``0``: draw without advancing), with an optional note."""
        self.done = min(self.done + n, self.total)
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
        elif self.enabled:
            frac = self.done / self.total
            filled = round(frac * self.width)
            elapsed = time.monotonic() - self.start
            eta = f", ~{elapsed / self.done * (self.total - self.done):.0f} s left" if 0 < frac < 1 else ""
            self.stream.write(f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}"
                              f" ({elapsed:.0f} s{eta}){' ' + note if note else ''}\n")
            self.stream.flush()

    def write(self, text: str, file: TextIO | None = None) -> None:
        """Print ``text`` on ``file`` (default: stdout) without breaking the bar."""
        file = file if file is not None else sys.stdout
        if self._bar is not None:
            self._bar.write(text, file=file)
        else:
            print(text, file=file)
        file.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
