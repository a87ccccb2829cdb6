"""What the hand-written GPU kernels of the decode step share (add_norm.py's, decode_attention.py's): where one may run
at all, and what happens when it fails.

A kernel runs on CUDA only, with triton installed (torch's CUDA wheels bring it on Linux; its CPU wheels do not), not
under torch.compile (which makes its own kernels from torch's ops) nor autocast (whose casts the kernels do not make).
Its first call compiles it; a kernel that fails to compile or launch (a triton too old or too new, a GPU it has no
code for) is logged once, naming its error, and torch's ops run in its place from then on, in this process. Running
out of memory is not the kernel's failure: raised, as torch's ops would meet it too.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from ..devices import autocast_dtype, compiling, out_of_memory

log = logging.getLogger(__name__)
T = TypeVar("T")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class GpuKernel:
    """One hand-written kernel's state in this process: `may_run(t)` for a tensor of its call, `run(launch,
    fallback)` to call it. `what` and `instead` name it and torch's ops in the warning."""

    def __init__(self, what: str, instead: str) -> None:
        self.what, self.instead = what, instead
        self.broken: str | None = None  # the error it failed with, once it has

    def may_run(self, t: torch.Tensor) -> bool:
        if t.device.type != "cuda" or self.broken is not None or compiling():
            return False
        return autocast_dtype("cuda") is None and triton_installed()

    def run(self, launch: Callable[[], T], fallback: Callable[[], T]) -> T:
        try:
            return launch()
        except Exception as e:  # noqa: BLE001 - any compiler or launch failure leaves torch's ops, the same function
            if out_of_memory(e):
                raise
            self.broken = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            log.warning("%s failed (%s); %s run instead", self.what, self.broken, self.instead)
        return fallback()
