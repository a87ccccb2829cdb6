"""A plain greedy choice, the argmax of each row's logits and whether they are all finite, in one kernel on CUDA.

Outside the captured decode step each token's choice launches its kernels one by one: for plain greedy (no sampling, no
repetition penalty, no kept scores) the finite check (torch's infinity norm, then a compare) and torch.argmax, which on
an H100 took 7.5 + 1.5 and 13.2 us a token over GPT-2's 50,257 logits in bf16 (benchmarks/results-gpu-h100/profile.md).
`argmax_finite` reads them once in one kernel (greedy_pick_triton.py) where `in_kernel` holds: where
gpt2_port/gpu_kernel.py lets a kernel run (CUDA, triton installed, not under torch.compile or autocast), (B, V) logits
of float32, bf16 or fp16 with unit stride along V. The token is torch.argmax's exactly (the first index of the largest,
over values widened to float32 without rounding) and so is the flag; the kernel's first result for a shape is checked
against torch's, which run instead where it disagrees or fails. Elsewhere torch's argmax and devices.all_finite. Its
time on a GPU is still to measure.
"""

from __future__ import annotations

import torch

from ..devices import all_finite
from ..gpu_kernel import KERNEL_DTYPES, GpuKernel


def _agree(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """The kernel's first (ids, flag) against torch's: the same tokens and the same verdict, exactly."""
    if not torch.equal(got[0], want[0]):
        return f"tokens {got[0].tolist()} where torch's argmax gives {want[0].tolist()}"
    if bool(got[1]) != bool(want[1]):
        return f"finite {bool(got[1])} where torch's check gives {bool(want[1])}"
    return None


KERNEL = GpuKernel("the greedy pick kernel", "torch's argmax and finite check", _agree)


def in_kernel(logits: torch.Tensor) -> bool:
    """Whether `argmax_finite(logits)` runs the kernel (see the module docstring)."""
    return KERNEL.may_run(logits) and takes(logits)


def takes(logits: torch.Tensor) -> bool:
    """The kernel's rules for its operand, the device aside: (B, V) of float32, bf16 or fp16, unit stride along V."""
    return logits.dim() == 2 and logits.dtype in KERNEL_DTYPES and logits.stride(1) == 1 and logits.shape[1] > 0


def argmax_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) logits -> ((B,) argmax ids, () whether every logit is finite: a bool, or the kernel's int64 1 or 0),
    on the device, without a wait."""
    if in_kernel(logits):
        return KERNEL.run(logits, (logits.dtype, logits.shape), lambda: _kernel(logits), lambda: _torch_ops(logits))
    return _torch_ops(logits)


def _kernel(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .greedy_pick_triton import launch  # triton's import too: a failing one is the kernel's failure

    return launch(logits)


def _torch_ops(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.argmax(logits, dim=-1), all_finite(logits)
