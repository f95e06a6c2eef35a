"""A one-line progress bar on stderr, redrawn at most twice a second (no dependency)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, name: str, enabled: bool = True, width: int = 24) -> None:
        self.name = name
        self.enabled = enabled
        self.width = width
        self._last_draw = 0.0

    def update(self, fraction: float, message: str = "", force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last_draw < 0.5):
            return
        self._last_draw = now
        fraction = min(max(fraction, 0.0), 1.0)
        filled = round(fraction * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        sys.stderr.write(f"\r[{self.name:>6}] |{bar}| {fraction * 100:5.1f}% {message}\033[K")
        sys.stderr.flush()

    def done(self, message: str = "") -> None:
        self.update(1.0, message, force=True)
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def note(self, message: str) -> None:
        if self.enabled:
            sys.stderr.write(f"[{self.name:>6}] {message}\n")
            sys.stderr.flush()
