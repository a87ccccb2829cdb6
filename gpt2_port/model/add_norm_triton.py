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


def _add_layer_norm(x_ptr, d_ptr, w_ptr, b_ptr, s_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    at = row * n + cols
    x = tl.load(x_ptr + at, mask=inside, other=0.0)
    s = (x.to(tl.float32) + tl.load(d_ptr + at, mask=inside, other=0.0).to(tl.float32)).to(x.dtype)
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
    through `add_layer_norm_kernel` (looked up here at each call: a test puts triton's interpreter of
    `_add_layer_norm` there to run it on the CPU)."""
    C = x.shape[-1]
    s, y = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(C)
    add_layer_norm_kernel[(x.numel() // C,)](
        x, d, weight, bias, s, y, C, eps, BLOCK=block, num_warps=4 if block <= 1024 else 8
    )
    return s, y
