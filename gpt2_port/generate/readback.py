"""A step's few values on their way to the host without holding the device back: a decode step's new ids (and its
finite flag), a training step's loss and gradient norm.

On CUDA, `send` queues an asynchronous copy into one of two pinned host buffers and records an event after it (on
the stream the copy runs on: the current stream of the tensor's device);
`read` waits for that event alone, so the step queued after the copy (the loop launches the next step before it
reads this one) runs on while the host waits, and the host's work on the ids (EOS, streaming, progress) overlaps the
device's on the next token. Reading a device tensor with `tolist` would instead wait for everything queued. Two
buffers: the loop reads step k before it sends step k + 2, the next use of step k's buffer. Elsewhere (the CPU) the
work is done when it is queued: `read` is the tensor's `tolist`. The training loop (train.loop) queues the next
step before it reads a step's loss the same way.
"""

from __future__ import annotations

import torch


class Readback:
    """send(t) -> a handle for (n,) `t` of `dtype` on `device`; read(handle) -> its values as a list, waiting for
    them."""

    def __init__(self, n: int, device: torch.device, dtype: torch.dtype = torch.long) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.buffers = [torch.empty(n, dtype=dtype, pin_memory=True) for _ in range(2)]
            self.events = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0

    def send(self, t: torch.Tensor) -> object:
        if not self.cuda:
            return t
        buf, event = self.buffers[self.turn], self.events[self.turn]
        self.turn ^= 1
        buf.copy_(t, non_blocking=True)  # queued on the current stream of t's device
        event.record(torch.cuda.current_stream(t.device))  # that stream: not the current device's, where they differ
        return buf, event

    def read(self, handle: object) -> list:
        if not self.cuda:
            return handle.tolist()  # type: ignore[attr-defined]
        buf, event = handle  # type: ignore[misc]
        event.synchronize()  # the step's one wait: for this copy, not for the step queued after it
        return buf.tolist()
