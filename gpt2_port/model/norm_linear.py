"""A decode step's matmuls with the residual add and the layer norm before them: torch's ops, or on CUDA one Triton
kernel a matmul (norm_linear_triton.py).

With add_norm.py's and decode_attention.py's kernels a batch-1 decode block still launches eight kernels: c_attn's
matmul, the attention, c_proj's matmul, an add and layer norm, c_fc's matmul (with its GELU), the MLP's c_proj, another
add and norm, and the split-K reduction cuBLAS adds to one of the projections (an H100's profile of 124M in bf16:
61 matmul kernels a token for 49 matmuls, 264 us of a 566 us token; benchmarks/results-gpu-h100/profile.md). A
one-token matmul reads each weight once and multiplies it by a few rows: a matrix-vector product, which a hand-written
kernel makes as well as a library's, and which can take the add and norm before it into its first steps. Here:

- `norm_linear(stream, norm, ...)`: the residual stream's pending sum (x + d: `Sum`, `PartsSum`, or the embeddings'
  `Lookup`), its layer norm, and the matmul after it (c_attn; c_fc with its GELU) in one kernel; the sum is stored as
  the new residual stream;
- `project(y, ...)`: a projection into the residual stream (c_proj, the MLP's c_proj) as float32 partial sums over
  slices of its input (`Parts`), many programs a matmul where its few outputs would give few, summed in a fixed order
  by the kernel that reads them next (no atomics, no reduction kernel: the same bits every run);
- `add_norm_of(stream, norm, ...)`: the last sum and its norm, ln_f, before the head.

So a block is five kernels: c_attn with ln_1 and the add before it, the attention, c_proj, c_fc with ln_2 and its add
and the GELU, the MLP's c_proj. The values: each residual sum is torch's add of the projection's output, rounded as
torch's matmul stores it (the partials summed, the bias added, rounded once to the dtype), bit for bit; the layer
norm's mean and variance are summed in another order (as add_norm.py's kernel); the matmuls' float32 sums too (any
order is a matmul's: cuBLAS's depends on its kernel); the GELU is the tanh GELU as x * sigmoid(2 inner) (the same
function) on the float32 sum with the bias, rounded once, as cuBLASLt's epilogue does. The same function rounded
otherwise: a `cuda` test and tests/test_gpu_kernels.py (triton's interpreter, on the CPU) hold each output to float64's
as torch's ops are held, and a whole step's tokens to the forward's.

Where it runs: where gpu_kernel.py lets a kernel run (CUDA, triton installed, not under torch.compile or autocast),
for at most MAX_ROWS rows (a decode step of more rows is a matrix product, cuBLAS's work), plain Linears with a bias
(not int8's layers), every operand of one dtype (float32, bf16 or fp16) and contiguous but the weight (any strides:
the checkpoint's transposed Conv1D views too), widths up to MAX_WIDTH. Elsewhere, and when a kernel fails (logged once,
then torch's ops), add_norm.py's add and norm and the Linear: the forward's ops on the CPU, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..gpu_kernel import KERNEL_DTYPES, GpuKernel, within
from .add_norm import Norm, add_norm, embed_norm, gathers
from .add_norm import agree as agree_add_norm

Weights = tuple[torch.Tensor, torch.Tensor | None]  # a Linear's (out, in) weight and its bias
MAX_ROWS = 4  # rows a kernel multiplies at once (B of a decode step)
MAX_WIDTH = 4096  # a program holds a row whole for its norm's mean and variance


@dataclass(frozen=True)
class Parts:
    """A projection's output as `project`'s kernel leaves it: (P, B, 1, N) float32 partial sums over P slices of its
    input, the bias not added. `total()`: what the Linear gives, (B, 1, N) in `dtype` (torch's ops)."""

    sums: torch.Tensor
    bias: torch.Tensor
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        return (self.sums.sum(0) + self.bias).to(self.dtype)


@dataclass(frozen=True)
class Lookup:
    """The step's first residual stream: the token's and the position's embedding rows, (B, 1) ids into each table."""

    ids: torch.Tensor
    pos: torch.Tensor
    wte: torch.Tensor
    wpe: torch.Tensor


# The residual stream with a projection not yet added: (x, d), x + d with d a tensor or Parts, or a Lookup
Stream = tuple[torch.Tensor, torch.Tensor | Parts] | Lookup


def _apart(dtype: torch.dtype) -> float:
    """How far a kernel's first matmul output may be from torch's, in the dtype's epsilons times the largest value:
    both are a float32 sum in some order, each up to a few epsilons times sqrt(K) from float64's in float32 (torch's
    CPU matmul 12.6 at K = 1600 in the tests), and within an epsilon in 16 bits, where the rounding to the dtype
    dominates. A kernel compiled wrong is far off: a slice of K left out moves the outputs by their own size."""
    return 256.0 if dtype == torch.float32 else 4.0


def _agree_norm_linear(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """The kernel's first (sum, output) against add_norm's and the Linear's: the sum within an ulp of the largest (it
    is torch's bit for bit on a GPU), the output within `_apart`."""
    return within(got[0], want[0], 1.0) or within(got[1], want[1], _apart(want[1].dtype))


def _agree_parts(got: Parts, want: torch.Tensor) -> str | None:
    return within(got.total(), want, _apart(want.dtype))


KERNEL = GpuKernel("the norm-and-matmul kernel", "add_norm's kernel and torch's matmul", _agree_norm_linear)
PROJECT = GpuKernel("the projection kernel", "torch's matmul", _agree_parts)
ADD_NORM = GpuKernel("the partials' add-and-norm kernel", "torch's sum, add and layer norm", agree_add_norm)
KERNELS = (KERNEL, PROJECT, ADD_NORM)


def _plain(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return t.dtype == dtype and t.shape == shape and t.is_contiguous()


def _rows_ok(x: torch.Tensor) -> bool:
    """(B, 1, C) rows of a kernel's dtype, contiguous, B at most MAX_ROWS, C at most MAX_WIDTH."""
    return (
        x.dim() == 3
        and x.shape[1] == 1
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[2] <= MAX_WIDTH
        and x.dtype in KERNEL_DTYPES
        and x.is_contiguous()
    )


def _weights_ok(wb: Weights | None, dtype: torch.dtype, k: int) -> bool:
    if wb is None or wb[1] is None:
        return False
    w, b = wb
    return w.dim() == 2 and w.shape[1] == k and w.dtype == dtype and _plain(b, dtype, (w.shape[0],))


def _stream_ok(stream: Stream, norm: Norm) -> bool:
    """Whether a kernel can read `stream` and norm it with `norm` (their dtypes, shapes and layouts)."""
    if isinstance(stream, Lookup):
        B = stream.ids.shape[0]
        if not (gathers(stream.ids, stream.pos, stream.wte, stream.wpe, norm) and stream.ids.shape == (B, 1)):
            return False
        return 0 < B <= MAX_ROWS and stream.wte.shape[1] <= MAX_WIDTH  # gathers: the dtypes and layouts
    x, d = stream
    if not _rows_ok(x):
        return False
    if isinstance(d, Parts):
        P = d.sums.shape[0]
        if not (_plain(d.sums, torch.float32, (P, *x.shape)) and _plain(d.bias, x.dtype, x.shape[2:])):
            return False
    elif not _plain(d, x.dtype, x.shape):
        return False
    return all(_plain(t, x.dtype, x.shape[2:]) for t in norm)


def _first(stream: Stream) -> torch.Tensor:
    return stream.wte if isinstance(stream, Lookup) else stream[0]


def _terms(stream: Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """x and d of the stream as torch's ops make them (the embeddings looked up, partials summed)."""
    if isinstance(stream, Lookup):
        return F.embedding(stream.ids, stream.wte), F.embedding(stream.pos, stream.wpe)
    x, d = stream
    return x, d.total() if isinstance(d, Parts) else d


def add_norm_of(stream: Stream, norm: Norm, eps: float, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stream's sum, its layer norm), (B, 1, C) each: add_norm.py's (and embed_norm's) for a sum of tensors and
    a lookup, this file's `_add_norm` kernel for partials where `kernel` and its rules hold, else torch's ops."""
    if isinstance(stream, Lookup):
        return embed_norm(stream.ids, stream.pos, stream.wte, stream.wpe, norm, eps, kernel)
    x, d = stream
    if not isinstance(d, Parts):
        return add_norm(x, d, norm, eps, kernel)
    if kernel and ADD_NORM.may_run(x) and _stream_ok(stream, norm):

        def launch() -> tuple[torch.Tensor, torch.Tensor]:
            from .norm_linear_triton import launch_add_norm

            B, _, C = x.shape
            s, y = launch_add_norm(x.view(B, C), d.sums.view(-1, B, C), d.bias, norm, eps)
            return s.view(x.shape), y.view(x.shape)

        key = (x.dtype, x.shape, d.sums.shape[0])
        return ADD_NORM.run(x, key, launch, lambda: add_norm(x, d.total(), norm, eps, kernel))
    return add_norm(x, d.total(), norm, eps, kernel)


def norm_linear(
    stream: Stream,
    norm: Norm,
    eps: float,
    wb: Weights | None,
    then: Callable[[torch.Tensor], torch.Tensor],
    gelu: bool = False,
    fused: bool = False,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stream's sum, `then` of its layer norm): `then` is the Linear over `wb` (and, with `gelu`, the tanh GELU
    after it). In one kernel where `kernel` and `in_kernel` hold; else `add_norm_of` (with add_norm.py's kernel where
    `fused`) and `then`: the forward's ops on the CPU."""

    def others() -> tuple[torch.Tensor, torch.Tensor]:
        s, h = add_norm_of(stream, norm, eps, fused)
        return s, then(h)

    if not (kernel and in_kernel(stream, norm, wb)):
        return others()
    first = _first(stream)
    mode = 3 if isinstance(stream, Lookup) else 2 if isinstance(stream[1], Parts) else 1
    P = stream[1].sums.shape[0] if mode == 2 else 0  # type: ignore[index,union-attr]
    key = (mode, first.dtype, tuple(first.shape), P, tuple(wb[0].shape), wb[0].stride(), gelu)  # type: ignore[index]
    return KERNEL.run(first, key, lambda: _launch_norm_linear(stream, norm, eps, wb, gelu, mode), others)  # type: ignore[arg-type]


def in_kernel(stream: Stream, norm: Norm, wb: Weights | None) -> bool:
    """Whether `norm_linear(stream, norm, eps, wb, ..., kernel=True)` runs the one kernel (the module docstring)."""
    first = _first(stream)
    if not (KERNEL.may_run(first) and _stream_ok(stream, norm)):
        return False
    return _weights_ok(wb, first.dtype, first.shape[-1])


def _launch_norm_linear(
    stream: Stream, norm: Norm, eps: float, wb: Weights, gelu: bool, mode: int
) -> tuple[torch.Tensor, torch.Tensor]:
    from .norm_linear_triton import launch

    w, b = wb
    if isinstance(stream, Lookup):
        B = stream.ids.shape[0]
        rows = (stream.ids.view(B), stream.pos.view(B))
        s, out = launch(mode, stream.wte, stream.wpe, None, None, rows, norm, eps, w, b, gelu, False)
    else:
        x, d = stream
        B, _, C = x.shape
        if isinstance(d, Parts):
            s, out = launch(mode, x.view(B, C), None, d.sums.view(-1, B, C), d.bias, None, norm, eps, w, b, gelu, False)
        else:
            s, out = launch(mode, x.view(B, C), d.view(B, C), None, None, None, norm, eps, w, b, gelu, False)
    return s.view(B, 1, -1), out.view(B, 1, -1)  # type: ignore[union-attr]


def project(y: torch.Tensor, linear: Callable[[torch.Tensor], torch.Tensor], wb: Weights | None, kernel: bool = False):  # noqa: ANN201
    """(B, 1, K) -> the projection `linear(y)`: as `Parts` where `kernel` and the kernel's rules hold (its partial
    sums, for the next kernel to add), else the Linear's (B, 1, N) output."""
    if not (kernel and PROJECT.may_run(y) and _rows_ok(y) and _weights_ok(wb, y.dtype, y.shape[-1])):
        return linear(y)
    w, b = wb  # type: ignore[misc]

    def launch() -> Parts:
        from .norm_linear_triton import launch

        B, _, K = y.shape
        _, sums = launch(0, y.view(B, K), None, None, None, None, None, 0.0, w, None, False, True)
        return Parts(sums.view(-1, B, 1, w.shape[0]), b, y.dtype)

    return PROJECT.run(y, (y.dtype, tuple(y.shape), tuple(w.shape), w.stride()), launch, lambda: linear(y))
