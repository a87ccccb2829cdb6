"""Which kernel `F.scaled_dot_product_attention` dispatched to: flash, memory-efficient, cuDNN, math, or torch's CPU
flash kernel. SDPA picks one per call from the device, dtype, shapes, mask and dropout; the name says whether a run
got the kernel it was tuned for. Found by watching one forward on any device: its SDPA calls (a TorchFunctionMode)
and the aten ops each dispatches (a TorchDispatchMode). The math kernel is composite, decomposed into matmuls and a
softmax before any dispatch mode sees it: a call that dispatched none of the kernels' ops ran it (on the CPU it
does whenever dropout is on).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# aten op -> the kernel's name
SDPA_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_attention_math_for_mps": "math (MPS)",
    "_scaled_dot_product_fused_attention_overrideable": "fused (device override)",
}


MATH = SDPA_OPS["_scaled_dot_product_attention_math"]


class _Watch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.kernel_ops = 0  # SDPA kernel ops dispatched so far

    def note(self, kernel: str) -> None:
        if kernel not in self.seen:
            self.seen.append(kernel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        name = func._schema.name.removeprefix("aten::")
        if name in SDPA_OPS:
            self.kernel_ops += 1
            self.note(SDPA_OPS[name])
        return func(*args, **(kwargs or {}))


class _Calls(TorchFunctionMode):
    """Each SDPA call: when it dispatched none of the kernels' ops, it ran the (composite) math kernel."""

    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        if func is not torch._C._nn.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        before = self.watch.kernel_ops
        out = func(*args, **(kwargs or {}))
        if self.watch.kernel_ops == before:
            self.watch.note(MATH)
        return out


def attention_kernels(run: Callable[[], object], device: torch.device, grad: bool = False) -> list[str]:
    """The SDPA kernels `run()` dispatched to, in order of first use ([] when no SDPA call ran: the hand-written
    attention). The random generators are left as they were, so a probe inside a run does not change it. `grad`:
    run with gradients on, as a training step does (SDPA may take another kernel for inputs that require grad)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(grad), _Watch() as watch, _Calls(watch):
        run()
    return watch.seen
