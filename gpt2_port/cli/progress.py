"""Progress of long work on stderr, counting what takes the time (steps, scored tokens, new tokens, bytes encoded),
with its rate and an ETA from that count; no dependencies.

On a terminal the line is redrawn in place at most 10 times a second. When stderr is a file or a pipe, long work
writes a plain newline-terminated line every `every` seconds (10 by default; GPT2_PORT_PROGRESS_SECONDS sets it) and
one at the end, so a log shows the work moving without a wall of carriage returns; work done within the first
interval writes nothing there (its result line says it all).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

FILE_SECONDS = 10.0  # seconds between lines when stderr is not a terminal


def file_seconds() -> float:
    try:
        return float(os.environ.get("GPT2_PORT_PROGRESS_SECONDS", FILE_SECONDS))
    except ValueError:
        return FILE_SECONDS


def size_text(n: float) -> str:
    """Bytes as people read them: 950 B, 12.3 kB, 1.1 MB, 6.4 GB."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _count(n: float) -> str:
    return f"{n:,.0f}"


def clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """`update(done, note)` of `total` (a count of `unit`; "B" counts bytes), drawn as
    "label [#####.....] 41% 1,234/3,000 steps 12.3 steps/s ETA 0:04 note"."""

    def __init__(
        self,
        label: str,
        total: int,
        unit: str = "",
        stream: TextIO | None = None,
        tty: bool | None = None,
        every: float | None = None,
        width: int = 24,
        start: int = 0,
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.label, self.total, self.unit = label, total, unit
        self.every, self.width = (0.1 if self.tty else every if every is not None else file_seconds()), width
        self.t0 = time.perf_counter()
        self.last = -1.0e9 if self.tty else self.t0  # in a file: the first line after `every` seconds of work
        self.start = start  # work done before this run (a resumed training run): not counted in the rate
        self.done, self.note = start, ""
        self.drawn = False
        self.written: tuple[int, str] | None = None  # (done, note) of the last line written

    def _amount(self, n: float) -> str:
        return size_text(n) if self.unit == "B" else _count(n)

    def _line(self, now: float) -> str:
        done, total = self.done, self.total
        frac = min(1.0, done / total) if total else 1.0
        fill = int(self.width * frac)
        elapsed = now - self.t0
        unit = "" if self.unit == "B" else f" {self.unit}"
        rate = "-"
        new = done - self.start
        if elapsed > 0 and new > 0:
            r = new / elapsed
            rate = f"{size_text(r)}/s" if self.unit == "B" else f"{_count(r) if r >= 10 else f'{r:.2f}'}{unit}/s"
        if done >= total:
            eta = f"in {clock(elapsed)}"
        else:
            eta = f"ETA {clock((total - done) * elapsed / new)}" if new > 0 and elapsed > 0 else "ETA ?"
        note = f" {self.note}" if self.note else ""
        return (
            f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {frac:4.0%} "
            f"{self._amount(done)}/{self._amount(total)}{unit} {rate} {eta}{note}"
        )

    def update(self, done: int, note: str = "") -> None:
        self.done, self.note = done, note
        now = time.perf_counter()
        finished = done >= self.total and self.tty  # a terminal shows the finished frame at once; a file at close
        if now - self.last < self.every and not finished:
            return
        self.last = now
        self._write(self._line(now))
        self.written = (done, note)

    def _write(self, line: str) -> None:
        if self.tty:
            self.stream.write(f"\r{line}   ")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.drawn = True

    def close(self, note: str | None = None) -> None:
        """End the line: on a terminal a newline after the last frame; in a file a last line when the last one
        written is out of date (the work moved on since, or a closing note is given)."""
        if note is not None:
            self.note = note
        now = time.perf_counter()
        if self.tty:
            if self.drawn:
                self._write(self._line(now))
                self.stream.write("\n")
                self.stream.flush()
        elif self.written is not None and self.written != (self.done, self.note):
            self._write(self._line(now))  # long work's last line (short work wrote none)
        self.drawn = False

    def abandon(self) -> None:
        """The work failed: end a terminal's line so the error starts on its own; in a file, nothing more."""
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
        self.drawn = False


class Phases:
    """One Progress per phase of a job that reports `(phase, done, total)` (prepare's scan and encode)."""

    def __init__(self, unit: str = "B", stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.unit, self.stream, self.tty = unit, stream, tty
        self.current: Progress | None = None
        self.phase = ""

    def update(self, phase: str, done: int, total: int) -> None:
        if phase != self.phase:
            self.close()
            self.phase = phase
            self.current = Progress(phase, total, self.unit, self.stream, self.tty)
        assert self.current is not None
        self.current.update(done)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None
