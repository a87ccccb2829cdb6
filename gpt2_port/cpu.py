"""What oneDNN, torch's CPU matmul library, can run on this CPU, and its packed weights.

`cpu_features` names the low-precision kernels it has here (as ONEDNN_MAX_CPU_ISA lets it use them), `packs` says
where a bf16 or fp16 weight is worth keeping in oneDNN's blocked layout, `pack` makes that copy and `on_packed`
multiplies by it (torch.ops.mkldnn's private ops, what inductor's CPU freezing uses). model/lowp.py decides with
them how bf16/fp16 inference matmuls run (its docstring has the measurements); generate/greedy_head.py screens the
vocabulary with a packed bf16 head. `float32_matmuls_exact` and `float16_sums_in_float32` say whether the process's
settings leave float32 matmuls and float16 sums as the fast greedy heads' proofs assume them.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

# ONEDNN_MAX_CPU_ISA (DNNL_MAX_CPU_ISA, its older name) caps the instructions oneDNN's kernels use, and so what
# torch's bf16 matmul runs; torch.cpu's probes read the CPU and ignore it. Levels below AVX512_CORE_BF16, and those
# from it below AMX:
_ISA_BELOW_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
_ISA_BELOW_AMX = {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512"}


def _probe(name: str) -> bool:
    """One of torch's CPU feature probes (torch.cpu._is_*_supported); False where this torch has none by that name."""
    return bool(getattr(torch.cpu, name, lambda: False)())


def _onednn_fp16() -> bool:
    """Whether torch's fp16 matmul on this CPU goes to oneDNN's fp16 kernels (AVX512-FP16 or AMX-FP16; it heeds
    ONEDNN_MAX_CPU_ISA, as the matmul's own dispatch does)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def cpu_features() -> frozenset[str]:
    """What decides the thresholds: "amx_bf16" (AMX tiles), "avx512_bf16", "fp16_gemm" (oneDNN's fp16 kernels), as
    oneDNN may use them under ONEDNN_MAX_CPU_ISA."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    found = {
        "amx_bf16": _probe("_is_amx_tile_supported") and cap not in _ISA_BELOW_BF16 | _ISA_BELOW_AMX,
        "avx512_bf16": _probe("_is_avx512_bf16_supported") and cap not in _ISA_BELOW_BF16,
        "fp16_gemm": _onednn_fp16(),
    }
    return frozenset(k for k, v in found.items() if v)


def float32_matmuls_exact() -> bool:
    """Whether torch's CPU float32 matmuls run in float32: not in bf16 or tf32 under
    `torch.set_float32_matmul_precision("medium"/"high")` or `torch.backends.(mkldnn.matmul.)fp32_precision`. Every
    one of those settings shows in `torch.backends.mkldnn.matmul.fp32_precision` ("none" or "ieee": float32); a torch
    without that attribute is asked `torch.get_float32_matmul_precision()`."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    precision = getattr(matmul, "fp32_precision", None)
    if precision is not None:
        return precision in ("none", "ieee")
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:  # the legacy and the new API mixed: some setting is not the default
        return False


def float16_sums_in_float32() -> bool:
    """Whether torch's own CPU float16 GEMM accumulates in float32: not where a process allowed it float16 sums
    (`torch._C._set_cpu_allow_fp16_reduced_precision_reduction(True)`, which only CPUs with float16 arithmetic
    accept; off by default). oneDNN's fp16 kernels sum in float32 either way (their "strict" default)."""
    allowed = getattr(torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", lambda: False)
    return not allowed()


def packs(dtype: torch.dtype, features: frozenset[str] | None = None) -> bool:
    """Whether a `dtype` weight is worth packing on a CPU with `features` (this CPU's by default): where oneDNN has
    bf16 (AVX512-BF16, AMX) or fp16 kernels (model/lowp.py's docstring has the measurements)."""
    f = cpu_features() if features is None else features
    if dtype == torch.bfloat16:
        return bool(f & {"amx_bf16", "avx512_bf16"})
    return dtype == torch.float16 and "fp16_gemm" in f


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a 2-D (out, in) bf16/fp16 weight, laid out for the batch-size hint 1 (decoding); None
    where this torch or this CPU's instructions have no packed kernel for it."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
    except (AttributeError, RuntimeError) as e:
        log.debug("no packed %s weight: %s", weight.dtype, e)
        return None


def on_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias in x's dtype, on `pack(weight)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
