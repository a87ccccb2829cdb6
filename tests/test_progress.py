"""Progress of long work: counts what takes the time, with rate and ETA; redrawn on a terminal, plain lines in a log."""

from __future__ import annotations

import io

import pytest

from gpt2_port.cli import progress
from gpt2_port.cli.progress import Phases, Progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(progress.time, "perf_counter", c)
    return c


def test_on_a_terminal_the_line_is_redrawn_with_rate_and_eta(clock: Clock) -> None:
    s = io.StringIO()
    bar = Progress("encode", 3_000_000, "B", stream=s, tty=True)
    bar.update(0)
    clock.t += 1.0
    bar.update(1_500_000)
    clock.t += 1.0
    bar.update(3_000_000)
    bar.close()
    frames = s.getvalue().split("\r")
    assert "50%" in frames[2] and "1.5 MB/3.0 MB" in frames[2] and "1.5 MB/s ETA 0:01" in frames[2]
    assert "100%" in frames[3] and " in 0:02" in frames[3] and s.getvalue().endswith("\n")
    assert s.getvalue().count("\n") == 1


def test_in_a_file_a_plain_line_every_few_seconds_and_one_at_the_end(clock: Clock) -> None:
    s = io.StringIO()
    bar = Progress("train", 100, "steps", stream=s, tty=False, every=10.0, start=20)  # a run resumed at step 20
    for step in range(21, 81):
        clock.t += 1.0  # one step a second
        bar.update(step, f"loss {step}")
    bar.close()
    lines = s.getvalue().splitlines()
    assert "\r" not in s.getvalue() and s.getvalue().endswith("\n")
    assert len(lines) == 6  # 60 s of work: a line every 10 s; the last is up to date, so closing adds none
    assert lines[-1].startswith("train [") and "80/100 steps" in lines[-1] and "loss 80" in lines[-1]
    assert "1.00 steps/s" in lines[-1] and "ETA 0:20" in lines[-1]  # the rate counts this run's 60 steps only


def test_short_work_writes_no_line_to_a_file_and_an_abandoned_one_writes_nothing_more(clock: Clock) -> None:
    s = io.StringIO()
    bar = Progress("eval", 10, "tokens", stream=s, tty=False)
    bar.update(10)
    bar.close()
    assert s.getvalue() == ""  # done within the first interval: the command's result line says it all
    s2 = io.StringIO()
    bar2 = Progress("eval", 10, "tokens", stream=s2, tty=False)
    bar2.update(3)
    clock.t += 11
    bar2.update(4)
    bar2.abandon()
    assert len(s2.getvalue().splitlines()) == 1  # the line after 10 s, nothing after the failure
    s3 = io.StringIO()
    bar3 = Progress("eval", 10, "tokens", stream=s3, tty=False)
    bar3.update(3)
    bar3.abandon()
    assert s3.getvalue() == ""  # work that fails within its first seconds leaves the log to the error


def test_phases_get_a_line_each(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPT2_PORT_PROGRESS_SECONDS", "0")  # a line at every update
    s = io.StringIO()
    p = Phases("B", stream=s, tty=False)
    p.update("scan", 10, 10)
    p.update("encode", 5, 10)
    clock.t += 1
    p.update("encode", 10, 10)
    p.close()
    lines = s.getvalue().splitlines()
    assert [ln.split()[0] for ln in lines] == ["scan", "encode", "encode"]
