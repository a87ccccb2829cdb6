"""A residual add and the layer norm after it, `(x + d, layer_norm(x + d))`: torch's two ops, or one kernel on CUDA.

A decode step of GPT-2 adds into the residual stream twice a block and normalises the sum right after (ln_2 after the
attention's projection, the next block's ln_1 or ln_f after the MLP's), and the step's tokens start with the same
pattern (the token's and the position's embeddings, then ln_1). On a GPU a batch-1 step's time goes mostly to launching
its kernels one after another, and these are two kernels where one would do: in an H100's profile of 124M in bf16
(benchmarks/results-gpu-h100/profile.md, torch 2.11) the step's 25 layer norms took 74 us of a 566 us token and its adds
24 more kernels, where inductor's fused add and layer norm ran at 1.5 us each in the compiled step.

`add_norm(..., kernel=True)` runs them as one Triton kernel (add_norm_triton.py) where `in_kernel` holds: where
gpu_kernel.py lets a kernel run (CUDA, triton installed, not under torch.compile, which fuses the two itself, nor
autocast, whose layer norm runs in float32 on inputs of other dtypes), x, d, weight and bias of one dtype (float32, bf16
or fp16), x and d of one shape and contiguous. The residual sum is torch's bit for bit (the float32 sum rounded once to
the dtype, as torch's add stores it); the layer norm is the same function rounded otherwise (its mean and variance
summed in another order: no farther from float64's than torch's by more than an ulp in bf16 and fp16, 8 in float32, in
the tests). `embed_norm` does the same for the step's first norm, its kernel reading the token's and the position's
embedding rows itself (two lookup kernels fewer). A kernel that fails is logged once and torch's ops run from then on
(gpu_kernel.py). Elsewhere, and with kernel=False, torch's two ops: the forward's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gpu_kernel import KERNEL_DTYPES, GpuKernel, within

Norm = tuple[torch.Tensor, torch.Tensor]  # a LayerNorm's weight and bias, (C,) each
MAX_WIDTH = 16384  # one program holds a row in registers: wider rows take torch's ops


def agree(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """The kernel's first (sum, norm) against torch's, as GpuKernel checks it: each within a few of the dtype's
    epsilons of the largest value (the tests hold the sum to bit equality and the norm to an ulp or 8 in float32;
    this catches a kernel compiled wrong, whose values are far off)."""
    (s, y), (s0, y0) = got, want
    eps = 8.0 if s0.dtype == torch.float32 else 2.0
    return within(s, s0, 1.0) or within(y, y0, eps)


KERNEL = GpuKernel("the add-and-layer-norm kernel", "torch's add and layer norm", agree)


def in_kernel(x: torch.Tensor, d: torch.Tensor, norm: Norm) -> bool:
    """Whether `add_norm(x, d, norm, eps, kernel=True)` runs the one Triton kernel (see the module docstring)."""
    return KERNEL.may_run(x) and takes(x, d, norm)


def takes(x: torch.Tensor, d: torch.Tensor, norm: Norm) -> bool:
    """The kernel's rules for its operands, the device aside: x, d, weight and bias of one dtype (float32, bf16 or
    fp16), x and d of one shape, all contiguous, (C,) weight and bias, C at most MAX_WIDTH."""
    w, b = norm
    if x.dtype not in KERNEL_DTYPES or not (x.dtype == d.dtype == w.dtype == b.dtype) or x.shape != d.shape:
        return False
    if not (x.is_contiguous() and d.is_contiguous() and w.is_contiguous() and b.is_contiguous()):
        return False
    return x.shape[-1] <= MAX_WIDTH and w.shape == b.shape == x.shape[-1:]


def add_norm(
    x: torch.Tensor, d: torch.Tensor, norm: Norm, eps: float, kernel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., C) x and d -> (x + d, layer_norm(x + d) with `norm`'s weight and bias): in one kernel where `kernel`
    and `in_kernel` hold, else as torch's add then torch's layer norm."""
    if kernel and in_kernel(x, d, norm):
        return KERNEL.run(x, (x.dtype, x.shape), lambda: _kernel(x, d, norm, eps), lambda: _torch_ops(x, d, norm, eps))
    return _torch_ops(x, d, norm, eps)


def embed_norm(
    ids: torch.Tensor,
    pos: torch.Tensor,
    wte: torch.Tensor,
    wpe: torch.Tensor,
    norm: Norm,
    eps: float,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1) token ids and positions -> (wte[ids] + wpe[pos], its layer norm with `norm`), (B, 1, C) each: the
    embeddings looked up, added and normed in one kernel where `kernel` and `gathers` hold (the kernel reads the two
    tables' rows itself: two lookup kernels a token fewer), else `add_norm` of torch's two lookups (pos may then be
    (1, 1) or (1,), broadcast as the forward adds it)."""
    if kernel and gathers(ids, pos, wte, wpe, norm):
        return KERNEL.run(
            wte,
            ("embed", wte.dtype, ids.shape),
            lambda: _gather_kernel(ids, pos, wte, wpe, norm, eps),
            lambda: _torch_ops(F.embedding(ids, wte), F.embedding(pos, wpe), norm, eps),
        )
    return add_norm(F.embedding(ids, wte), F.embedding(pos, wpe), norm, eps, kernel)


def gathers(ids: torch.Tensor, pos: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor, norm: Norm) -> bool:
    """Whether `embed_norm` runs the one kernel: where a kernel may run (gpu_kernel.py) and `takes` holds for a
    row of each table, ids and pos of one shape, int64 and contiguous, the tables 2-D and contiguous."""
    if not KERNEL.may_run(wte) or ids.shape != pos.shape or ids.dtype != torch.long or pos.dtype != torch.long:
        return False
    if not (ids.is_contiguous() and pos.is_contiguous() and wte.dim() == wpe.dim() == 2):
        return False
    return takes(wte[0], wpe[0], norm) and wte.is_contiguous() and wpe.is_contiguous()


def _gather_kernel(
    ids: torch.Tensor, pos: torch.Tensor, wte: torch.Tensor, wpe: torch.Tensor, norm: Norm, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from .add_norm_triton import launch_gather  # triton's import too: a failing one is the kernel's failure

    return launch_gather(ids, pos, wte, wpe, *norm, eps)


def _kernel(x: torch.Tensor, d: torch.Tensor, norm: Norm, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from .add_norm_triton import launch  # triton's import too: a failing one is the kernel's failure

    return launch(x, d, *norm, eps)


def _torch_ops(x: torch.Tensor, d: torch.Tensor, norm: Norm, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + d
    return s, F.layer_norm(s, s.shape[-1:], *norm, eps)
