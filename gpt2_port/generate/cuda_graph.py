"""A decode step recorded once as a CUDA graph and replayed for every token: one launch instead of the hundreds of
kernel launches a GPT-2 step makes, which on a GPU cost more host time than the step's arithmetic (124M float32 on
an H100: ~0.7 ms of GPU work inside ~7 ms of wall time per token, measured with the eager step).

The step must read only device tensors that keep their addresses (the static cache's buffers and inputs, the
weights): generate/cache.py's StaticKVCache and model/decode.py's `static_step` are written for it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from ..devices import autocast_dtype

log = logging.getLogger(__name__)


def uncached_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """The caller's autocast, if on, with its cache of cast weights off: a graph captured under autocast would
    otherwise read the cached bf16/fp16 copies of weights that require grad, which autocast frees when its outermost
    block ends, and replay over freed memory (torch's make_graphed_callables refuses such a cache for this reason).
    Uncached, the casts are recorded in the graph and rerun at each replay."""
    dtype = autocast_dtype(device_type)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


class CapturedStep:
    """`fn()` -> a tensor, recorded as a CUDA graph on the first `__call__` (after warm-up runs on a side stream, as
    torch.cuda.graph asks) and replayed after; the returned tensor is the graph's own output buffer, overwritten by
    each replay. The warm-up runs write into the step's buffers as a real step would: capture before the first real
    step, whose own writes replace them. `capture_s`: the time the warm-up and the capture took (waited for once, so
    it is not counted in the steps after). A capture that fails (RuntimeError, out of memory aside) is logged once
    and the step runs eagerly from then on, the same arithmetic without the graph, on the caller's stream; an error
    in a warm-up run is the step's own (a device-side assert, say), which the eager step would meet too, and is
    raised as it is. The capture is thread-local: other threads' CUDA calls (a data loader's, a profiler's) go on
    while it records, where the global mode would fail them. Warm-up,
    capture and replay run on `device` (its streams, under its guard): torch.cuda.graph's default capture stream is
    made once, on whichever device was current then, and a step whose tensors live on another GPU would record
    nothing there."""

    def __init__(self, fn: Callable[[], torch.Tensor], device: torch.device, warmup: int = 2) -> None:
        self.fn, self.device, self.warmup = fn, device, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.capture_s = 0.0
        self.eager = False  # the capture failed: every call runs fn(), the same step without the graph

    def warm_up(self) -> None:
        """The warm-up runs, on a side stream of the step's device (errors are the step's own: raised)."""
        with torch.cuda.device(self.device):
            caller = torch.cuda.current_stream(self.device)
            s = torch.cuda.Stream(self.device)
            s.wait_stream(caller)
            try:
                with torch.cuda.stream(s), uncached_autocast("cuda"):
                    for _ in range(self.warmup):
                        self.fn()
            finally:
                caller.wait_stream(s)

    def capture(self) -> None:
        """Record fn() as the graph (errors are the capture's: `__call__` falls back to the eager step)."""
        with torch.cuda.device(self.device):
            caller = torch.cuda.current_stream(self.device)
            try:
                g = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream(self.device)
                with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"), uncached_autocast("cuda"):
                    self.out = self.fn()
            finally:
                # torch.cuda.graph ends the capture before it puts the caller's stream back: when ending it raises
                # (a kernel broke the capture), the capture stream would stay current for everything after
                torch.cuda.set_stream(caller)
            self.graph = g
            caller.synchronize()  # once per capture: the warm-up's work ends here

    def __call__(self) -> torch.Tensor:
        if self.eager:
            return self.fn()
        if self.graph is None:
            t0 = time.perf_counter()
            self.warm_up()
            try:
                self.capture()
                self.capture_s = time.perf_counter() - t0
            except torch.cuda.OutOfMemoryError:
                raise  # not a capture problem: the eager step would need the same memory
            except RuntimeError as e:  # a kernel that cannot be captured here (e.g. an attention backend's plan)
                log.warning("the decode step could not be recorded as a CUDA graph (%s); it runs eagerly instead", e)
                self.graph, self.out, self.eager = None, None, True
                return self.fn()
        with torch.cuda.device(self.device):
            self.graph.replay()  # type: ignore[union-attr]
        return self.out  # type: ignore[return-value]
