"""A one-line progress bar on stderr (done/total, rate, ETA), redrawn at most 10 times a second; no dependencies."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class ByteBar:
    """`update(label, done, total)` redraws "label [#####.....] 41% 12.3 MB/30.0 MB 4.1 MB/s ETA 0:04"."""

    def __init__(self, stream: TextIO | None = None, width: int = 30, interval: float = 0.1) -> None:
        self.stream = stream or sys.stderr
        self.width, self.interval = width, interval
        self.label = ""
        self.t0 = self.last = 0.0
        self.drawn = False

    def update(self, label: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if label != self.label:  # a new phase: its own clock and line
            if self.drawn:
                self.stream.write("\n")
            self.label, self.t0, self.last = label, now, 0.0
        if now - self.last < self.interval and done < total:
            return
        self.last = now
        frac = done / total if total else 1.0
        fill = int(self.width * frac)
        elapsed = now - self.t0
        rate = f"{_size(done / elapsed)}/s" if elapsed > 0 else "-"
        if done >= total:
            eta = f"in {_clock(elapsed)}"
        else:
            eta = f"ETA {_clock((total - done) * elapsed / done)}" if done and elapsed > 0 else "ETA ?"
        self.stream.write(
            f"\r{label:<7}[{'#' * fill}{'.' * (self.width - fill)}] {frac:4.0%} {_size(done)}/{_size(total)} "
            f"{rate} {eta}   "
        )
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False
