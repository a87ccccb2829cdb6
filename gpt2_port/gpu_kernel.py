"""What the hand-written GPU kernels of decoding share (model/add_norm.py's, model/norm_linear.py's,
model/decode_attention.py's, generate/greedy_pick.py's): where one may run at all, and what happens when it fails.

A kernel runs on CUDA only, with triton installed (torch's CUDA wheels bring it on Linux; its CPU wheels do not), not
under torch.compile (which makes its own kernels from torch's ops) nor autocast (whose casts the kernels do not make).
Its first call compiles it; a kernel that fails to compile or launch (a triton too old or too new, a GPU it has no
code for) is logged once, naming its error, and torch's ops run in its place from then on, in this process. Running
out of memory is not the kernel's failure: raised, as torch's ops would meet it too. And its first result for each
shape is compared with torch's ops' on the same inputs: a kernel compiled wrong for this GPU, which the tests on
another would not show, is found there, logged, and never used again (the values are torch's).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from .devices import autocast_dtype, compiling, out_of_memory

log = logging.getLogger(__name__)
T = TypeVar("T")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes the kernels are written for
# How triton compiles each kernel: products and sums contracted into fused multiply-adds, what triton up to 3.9 does
# when not told (3.9 warns at each compile that 3.10 will not). Given at each launch, so a kernel's arithmetic does not
# change with triton's default and nothing is printed.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


@functools.cache
def triton_installed() -> bool:
    """Whether triton can be imported (asked once a process: the eager step asks at every call)."""
    return importlib.util.find_spec("triton") is not None


class GpuKernel:
    """One hand-written kernel's state in this process: `may_run(t)` for a tensor of its call, `run(...)` to call it.
    `what` and `instead` name it and torch's ops in the warning; `agree(got, want)` -> None, or what differs, holds
    the kernel's first result for each `key` (the dtypes and shapes of a call: one compiled kernel each) to torch's
    ops' on the same inputs."""

    def __init__(self, what: str, instead: str, agree: Callable[[T, T], str | None]) -> None:
        self.what, self.instead, self.agree = what, instead, agree
        self.broken: str | None = None  # why it is not used any more, once it has failed or disagreed
        self.checked: set[tuple] = set()  # the keys whose first result agreed

    def may_run(self, t: torch.Tensor) -> bool:
        if t.device.type != "cuda" or self.broken is not None or compiling():
            return False
        return autocast_dtype("cuda") is None and triton_installed()

    def checking(self, t: torch.Tensor, key: tuple) -> bool:
        """Whether `run` with this tensor and key compares the kernel's result with torch's ops' (its first call for
        the key on the device, outside a graph's capture)."""
        return (str(t.device), *key) not in self.checked and not _capturing()

    def run(self, t: torch.Tensor, key: tuple, launch: Callable[[], T], fallback: Callable[[], T]) -> T:
        """launch() (the kernel), or fallback() (torch's ops) where it fails; `t`: a tensor of the call, on its device.
        launch() runs with that device current (triton launches on the current device: a model on another GPU than
        the current one would fail there). The first call for a `key` on a device runs both and compares them (one
        wait for the device, once: not while a CUDA graph records, whose warm-up runs made it before): a kernel
        compiled wrong for this GPU is found there and never used again, where tests on other GPUs would not show
        it. fallback() must be safe to run after launch() (it writes what the kernel wrote)."""
        try:
            with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
                got = launch()
        except Exception as e:  # noqa: BLE001 - any compiler or launch failure leaves torch's ops, the same function
            if out_of_memory(e):
                raise
            return self._give_up(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}", fallback)
        if not self.checking(t, key):
            return got
        want = fallback()
        why = self.agree(got, want)
        if why is not None:
            return self._give_up(f"its first result differs from theirs: {why}", lambda: want)
        self.checked.add((str(t.device), *key))
        return got

    def _give_up(self, why: str, fallback: Callable[[], T]) -> T:
        self.broken = why
        log.warning("%s failed (%s); %s run instead", self.what, why, self.instead)
        return fallback()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def within(got: torch.Tensor, want: torch.Tensor, eps: float) -> str | None:
    """None where every value of `got` is within `eps` times the dtype's epsilon times the largest |want| of `want`,
    else the largest distance in those units (a kernel's agreement with torch's ops rounded otherwise)."""
    unit = torch.finfo(want.dtype).eps * max(want.abs().max().item(), 1e-30)
    far = (got.double() - want.double()).abs().max().item() / unit  # nan where got is not finite
    return None if far <= eps else f"{far:.3g} x eps x the largest value apart, where up to {eps:g} was expected"
