"""bf16 and fp16 matmuls on a CPU without bf16/fp16 matrix instructions (no AVX512-BF16, AMX or AVX512-FP16).

There torch's low-precision GEMM runs slow code: on this AVX2 CPU a (128, 768) @ (768, 3072) bf16 matmul takes 35 ms,
the same product from float32 copies 6.4 ms, and a 1 x 128 bf16 prefill of 124M spends 1.16 s of its 1.73 s in
those matmuls. For inference over at least UPCAST_MIN_ROWS rows, `linear` computes the product from float32 copies of
x, the weight and the bias (exact: bf16 and fp16 widen to float32 without rounding), accumulates in float32 as the
low-precision GEMM does, and rounds the result once to x's dtype: what that GEMM returns, up to the order of the
float32 sums. Fewer rows (decoding) keep the low-precision kernel, which reads half the bytes and is as fast or
faster there. Training (gradients wanted), float32, other devices and CPUs with those instructions are untouched.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# rows (x.numel() / in_features) from which the float32 product is used: measured on this AVX2 CPU over the 124M
# shapes (768->768, 768->3072, 3072->768): at 8 rows the two take about the same time, at 16 the float32 product is
# 1.7x-2.2x faster, at 128 5x
UPCAST_MIN_ROWS = 16
_LOWP = (torch.bfloat16, torch.float16)


@functools.cache
def cpu_lacks_matrix_units(dtype: torch.dtype) -> bool:
    """True where this CPU has no matrix instructions for `dtype` (torch's own probes)."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    else:
        probes = ("_is_avx512_fp16_supported", "_is_amx_fp16_supported")
    return not any(getattr(cpu, p, lambda: False)() for p in probes)


def upcasts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` computes x @ weight^T from float32 copies (see the module's docstring)."""
    return (
        x.dtype in _LOWP
        and x.device.type == "cpu"
        and weight.dtype == x.dtype
        and x.numel() >= UPCAST_MIN_ROWS * x.shape[-1]
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and cpu_lacks_matrix_units(x.dtype)
    )


def _from_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


def linear_wb(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), from float32 copies where `upcasts` says so."""
    return _from_float32(x, weight, bias) if upcasts(x, weight) else F.linear(x, weight, bias)


def linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """m(x) for a Linear module: a plain nn.Linear from float32 copies where `upcasts` says so; otherwise (and for
    another module, e.g. int8) the module is called."""
    if type(m) is nn.Linear and upcasts(x, m.weight):
        return _from_float32(x, m.weight, m.bias)
    return m(x)
