"""The residual add and the layer norm after it as one Triton kernel: model/add_norm.py's kernel on CUDA.

Imported only where triton is (add_norm.py asks first): torch's CPU wheels come without it.

One program a row: the row of x and of d are read once, their sum is rounded to the inputs' dtype (what torch's add
stores: the float32 sum of the two, rounded once) and stored as the new residual stream, then normalised from that
rounded sum in float32 (mean, then the mean of the squared deviations, as torch's layer norm computes them, in
another order) and scaled, shifted and rounded once into y. No `from __future__ import annotations`: triton reads the
kernel's annotations (`tl.constexpr`) as objects.
"""

import torch
import triton
import triton.language as tl

from ..gpu_kernel import COMPILE_OPTIONS


def _add_layer_norm(
    x_ptr, d_ptr, xi_ptr, di_ptr, w_ptr, b_ptr, s_ptr, y_ptr, n, eps, GATHER: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    if GATHER:  # x's and d's rows are the ones xi and di name (embedding tables' rows: a token's and a position's)
        x_row = tl.load(xi_ptr + row)
        d_row = tl.load(di_ptr + row)
    else:
        x_row = row
        d_row = row
    x = tl.load(x_ptr + x_row * n + cols, mask=inside, other=0.0)
    s = (x.to(tl.float32) + tl.load(d_ptr + d_row * n + cols, mask=inside, other=0.0).to(tl.float32)).to(x.dtype)
    at = row * n + cols
    tl.store(s_ptr + at, s, mask=inside)
    v = s.to(tl.float32)
    mean = tl.sum(v, axis=0) / n
    dev = tl.where(inside, v - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(dev * dev, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + at, (dev * rstd * w + b).to(x.dtype), mask=inside)


add_layer_norm_kernel = triton.jit(_add_layer_norm)


def launch(
    x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., C) contiguous x and d, (C,) weight and bias, all of one dtype -> (x + d, its layer norm), new tensors,
    through `add_layer_norm_kernel` (looked up here at each call: a test may put triton's interpreter there)."""
    return _launch(x, d, None, weight, bias, eps)


def launch_gather(
    x_rows: torch.Tensor,
    d_rows: torch.Tensor,
    x: torch.Tensor,
    d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x_rows and d_rows (...) int64 row indices of the contiguous (N, C) tables x and d -> (x[x_rows] + d[d_rows],
    its layer norm), (..., C) each: F.embedding of each, added and normed, in one kernel."""
    return _launch(x, d, (x_rows, d_rows), weight, bias, eps)


def _launch(
    x: torch.Tensor,
    d: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor] | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    C = x.shape[-1]
    shape = x.shape if rows is None else (*rows[0].shape, C)
    s = torch.empty(shape, dtype=x.dtype, device=x.device)
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    xi, di = rows if rows is not None else (x, d)  # not read without GATHER
    block = triton.next_power_of_2(C)
    add_layer_norm_kernel[(s.numel() // C,)](
        x,
        d,
        xi,
        di,
        weight,
        bias,
        s,
        y,
        C,
        eps,
        GATHER=rows is not None,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
        **COMPILE_OPTIONS,
    )
    return s, y
