"""The static decode step's attention on CUDA as one kernel: the token's key and value stored in their slot of the
layer's cache, and its query attended over every slot with the cache's additive mask (decode_attention_triton.py).

The static step otherwise runs two kernels a block for this: the cache write (`index_copy_`) and SDPA, which on an
H100 ran its memory-efficient kernel at 9.7 us a layer for a one-token query (bf16, 124M, batch 1: 116 us of a 566
us token; index_copy_ 2.8 us more; benchmarks/results-gpu-h100/profile.md). That kernel tiles for many queries; a
decode step has one a head, so here a program a (row, head) reads its keys and values once, in blocks of 64 slots,
with the online softmax (a running maximum, as flash attention keeps it), in float32: the same function as SDPA's,
rounded otherwise (SDPA's bf16 kernel rounds the probabilities to bf16 before multiplying them with the values; this
keeps them in float32). A long cache (8 blocks or more) with few (row, head)s is split into spans of whole blocks, a
program each, and a second kernel combines the spans' sums (flash-decoding: one program a head at 124M batch 1 is 12
programs on a GPU of 132 SMs, each reading its head's 16 blocks of a full cache in turn). Its time on a GPU is still
to measure (`python -m benchmarks.gpu decode`: the rows `ours` and `ours, SDPA attention`).

`attend` runs it where `in_kernel` holds: where gpu_kernel.py lets a kernel run (CUDA, triton installed, not under
torch.compile or autocast), q, the token's key and value, the cache and its mask of one dtype (float32, bf16 or
fp16), the head size a power of two from 16 to 256, the cache contiguous; else, and when it fails (logged once,
gpu_kernel.py), `fallback`: the cache write and SDPA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..gpu_kernel import KERNEL_DTYPES, GpuKernel, within


def _agree(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """The kernel's first output against the cache write and SDPA's, as GpuKernel checks it: within a few of the
    dtype's epsilons of the largest value (the tests hold it to 4 in float32 and 1 in bf16/fp16 of float64's; this
    catches a kernel compiled wrong)."""
    return within(got, want, 16.0 if want.dtype == torch.float32 else 4.0)


KERNEL = GpuKernel("the decode attention kernel", "the cache write and SDPA", _agree)


def in_kernel(q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether `attend(q, kv, layer, bias, ...)` runs the kernel (see the module docstring)."""
    return KERNEL.may_run(q) and takes(q, kv, layer, bias)


def takes(q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor) -> bool:
    """The kernel's rules for its operands, the device aside: q (B, nh, 1, hs), kv (2, B, nh, 1, hs), the layer's
    cache (2, B, nh, L, hs) contiguous and its mask (B, L) contiguous, all of one dtype (float32, bf16 or fp16), hs a
    power of two from 16 to 256."""
    if q.dim() != 4 or q.shape[2] != 1 or q.dtype not in KERNEL_DTYPES:
        return False
    B, nh, _, hs = q.shape
    if not (q.dtype == kv.dtype == layer.dtype == bias.dtype) or kv.shape != (2, B, nh, 1, hs):
        return False
    if layer.dim() != 5 or layer.shape[:3] != (2, B, nh) or layer.shape[4] != hs or not layer.is_contiguous():
        return False
    if bias.shape != (B, layer.shape[3]) or not bias.is_contiguous():
        return False
    return 16 <= hs <= 256 and hs & (hs - 1) == 0


def attend(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: torch.Tensor,
    bias: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    fallback: Callable[[], torch.Tensor],
    split: bool = True,
) -> torch.Tensor:
    """Store kv (2, B, nh, 1, hs) at `slot` ((1,) on the device) of `layer` (2, B, nh, L, hs) and attend q (B, nh, 1,
    hs) over its L slots with the additive mask `bias` (B, L) -> (B, nh, 1, hs), in one kernel; `fallback()` (the
    same, as the cache write and SDPA) where the kernel fails. The slots after `slot` must be masked (-inf in `bias`,
    as StaticKVCache keeps them): the kernel does not read them. `split`: a long cache may be split over several
    programs a head (decode_attention_triton.splits; False: one a head)."""

    def launch() -> torch.Tensor:
        from .decode_attention_triton import launch  # triton's import too: a failing one is the kernel's failure

        return launch(q, kv, layer, bias, slot, scale, split)

    return KERNEL.run(q, (q.dtype, q.shape, layer.shape, split), launch, fallback)
