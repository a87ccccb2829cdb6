"""The CUDA-graph decode step records and replays on its own tensors' GPU, not on whichever one is current.

torch.cuda.graph's default capture stream is made once per process on the device current then; a step whose cache
lives on cuda:1 would record nothing there and replay an empty graph. Needs no GPU: torch.cuda's stream, guard and
graph calls are replaced by recorders that note the device each one runs on, and the step reports the device current
when it ran. On a GPU, tests/test_cuda.py runs the captured step against the eager one."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gpt2_port.generate import cuda_graph
from gpt2_port.generate.steps import StaticSteps


class _Fake:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.current, self.log = 0, []
        self.fail_capture_end = False  # torch.cuda.graph's exit raising from capture_end, as a broken capture does
        fake = self

        class Stream:
            def __init__(self, device=None) -> None:  # noqa: ANN001
                self.device = torch.device(device).index if device is not None else fake.current
                fake.log.append(("stream", self.device))

            def wait_stream(self, other) -> None:  # noqa: ANN001
                pass

            def synchronize(self) -> None:
                pass

        class Graph:
            def replay(self) -> None:
                fake.log.append(("replay", fake.current))

        @contextlib.contextmanager
        def device(d):  # noqa: ANN001, ANN202
            prev, fake.current = fake.current, torch.device(d).index
            try:
                yield
            finally:
                fake.current = prev

        self.stream = Stream("cuda:0")  # the current stream (the caller's)
        self.log.clear()

        @contextlib.contextmanager
        def stream(s):  # noqa: ANN001, ANN202
            prev, fake.stream = fake.stream, s
            try:
                yield
            finally:
                fake.stream = prev

        @contextlib.contextmanager
        def graph(g, stream=None, **kw):  # noqa: ANN001, ANN003, ANN202
            # as torch.cuda.graph: the capture stream is current inside; on exit capture_end runs first, and the
            # caller's stream is put back only when it returns
            fake.log.append(("capture", stream.device if stream is not None else "default"))
            fake.capture_kw = kw
            prev, fake.stream = fake.stream, stream
            yield
            if fake.fail_capture_end:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            fake.stream = prev

        def set_stream(s) -> None:  # noqa: ANN001
            fake.stream = s

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.stream)


def test_the_step_is_captured_and_replayed_on_its_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Fake(monkeypatch)
    ran_on: list[int] = []
    out = torch.zeros(1)

    def step() -> torch.Tensor:
        ran_on.append(fake.current)
        return out

    captured = cuda_graph.CapturedStep(step, torch.device("cuda:1"), warmup=2)
    assert captured() is out and captured() is out
    assert ran_on == [1, 1, 1]  # two warm-ups and the capture, all with cuda:1 current
    assert ("capture", 1) in fake.log and ("capture", "default") not in fake.log
    assert [e for e in fake.log if e[0] == "replay"] == [("replay", 1), ("replay", 1)]
    assert all(d == 1 for kind, d in fake.log if kind == "stream")
    assert fake.current == 0  # the caller's device is current again


def test_a_step_that_cannot_be_captured_runs_eagerly_from_then_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel that refuses capture (e.g. an attention backend's plan) must not fail every later generate call at
    the same shapes: the failure is logged once and the same step runs without the graph."""
    fake = _Fake(monkeypatch)
    calls: list[str] = []

    def step() -> torch.Tensor:
        calls.append("step")
        return torch.full((1,), float(len(calls)))

    @contextlib.contextmanager
    def refusing_graph(g, stream=None, **kw):  # noqa: ANN001, ANN003, ANN202
        raise RuntimeError("operation not permitted when stream is capturing")
        yield

    monkeypatch.setattr(torch.cuda, "graph", refusing_graph)
    captured = cuda_graph.CapturedStep(step, torch.device("cuda:0"), warmup=2)
    with caplog.at_level("WARNING", logger="gpt2_port.generate.cuda_graph"):
        first, second = captured(), captured()
    assert captured.eager and captured.graph is None
    assert calls == ["step"] * 4 and first.item() == 3.0 and second.item() == 4.0  # 2 warm-ups, then eager calls
    assert [r.getMessage() for r in caplog.records] == [
        "the decode step could not be recorded as a CUDA graph (operation not permitted when stream is capturing); "
        "it runs eagerly instead"
    ]
    assert not [e for e in fake.log if e[0] == "replay"]
    steps = object.__new__(StaticSteps)  # what generate reports as its step
    steps.run, steps.compiled = captured, None
    assert steps.name == "static (capture failed)"


def test_a_capture_that_breaks_at_its_end_leaves_the_callers_stream_current(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torch.cuda.graph ends the capture before it restores the caller's stream: when ending raises (a kernel broke
    the capture), the eager step and everything after it must still run on the caller's stream, not on the capture
    stream the graph left current."""
    fake = _Fake(monkeypatch)
    caller = fake.stream
    fake.fail_capture_end = True
    streams: list[object] = []

    def step() -> torch.Tensor:
        streams.append(fake.stream)
        return torch.zeros(1)

    captured = cuda_graph.CapturedStep(step, torch.device("cuda:0"), warmup=1)
    with caplog.at_level("WARNING", logger="gpt2_port.generate.cuda_graph"):
        captured()
        captured()
    assert captured.eager and len(streams) == 4  # a warm-up, the broken capture, two eager steps
    assert streams[0] is not caller and streams[1] is not caller  # the side stream, the capture stream
    assert streams[2:] == [caller, caller]
    assert fake.stream is caller


def test_an_error_in_a_warm_up_run_is_the_steps_own_and_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up run is the eager step on a side stream: its error (a device-side assert from a bad id, say) would
    end the eager step too, so it is raised, not logged as a capture failure and met again eagerly; the caller's
    stream is current again and nothing was recorded."""
    fake = _Fake(monkeypatch)
    caller = fake.stream
    calls = []

    def step() -> torch.Tensor:
        calls.append(fake.stream)
        raise RuntimeError("CUDA error: device-side assert triggered")

    captured = cuda_graph.CapturedStep(step, torch.device("cuda:0"), warmup=2)
    with pytest.raises(RuntimeError, match="device-side assert"):
        captured()
    assert len(calls) == 1 and calls[0] is not caller  # the first warm-up run, on the side stream; no capture
    assert not captured.eager and captured.graph is None and fake.stream is caller
    assert not any(kind == "capture" for kind, _ in fake.log)


def test_the_capture_is_thread_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other threads' CUDA calls (a data loader's pinned copies, a profiler) may go on while the step records."""
    fake = _Fake(monkeypatch)
    cuda_graph.CapturedStep(lambda: torch.zeros(1), torch.device("cuda:0"), warmup=1)()
    assert fake.capture_kw == {"capture_error_mode": "thread_local"}


def test_running_out_of_memory_while_capturing_is_raised_not_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory is no capture problem (the eager step needs the same memory): it reaches the caller, and the
    caller's stream is current again."""
    fake = _Fake(monkeypatch)
    caller = fake.stream

    calls = []

    def step() -> torch.Tensor:  # the warm-up runs; the run inside the capture runs out of memory
        calls.append(fake.stream)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return torch.zeros(1)

    captured = cuda_graph.CapturedStep(step, torch.device("cuda:0"), warmup=1)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        captured()
    assert len(calls) == 2 and calls[1] is not caller  # it ran out inside the capture, on the capture stream
    assert not captured.eager and fake.stream is caller


def test_a_steps_ids_are_awaited_on_the_stream_of_their_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode loop's read of a step's ids (generate/readback.py) waits for an event recorded after their copy:
    on the current stream of the ids' GPU, which runs the copy, not of the current device's (on another GPU the
    event would not follow the copy, and the read would take the buffer before the ids are in it). torch.cuda's
    event and stream calls are stood in for; tests/test_cuda.py reads real ids on a GPU."""
    from gpt2_port.generate import readback

    recorded: list[object] = []

    class Event:
        def record(self, stream=None) -> None:  # noqa: ANN001
            recorded.append(stream)

    class Buffer:
        def copy_(self, t, non_blocking: bool = False) -> None:  # noqa: ANN001
            assert non_blocking

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    r = readback.Readback(3, torch.device("cpu"))
    r.cuda, r.buffers, r.events = True, [Buffer(), Buffer()], [Event(), Event()]  # as on a GPU
    ids = type("Ids", (), {"device": torch.device("cuda", 1)})()
    r.send(ids)
    assert recorded == [("stream of", torch.device("cuda", 1))]
