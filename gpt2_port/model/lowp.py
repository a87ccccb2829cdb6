"""bf16 and fp16 matmuls on a CPU whose low-precision GEMM is slower than a float32 product of the same operands.

Without bf16/fp16 instructions torch's low-precision GEMM runs slow code: on an AVX2 CPU a (128, 768) @ (768, 3072)
bf16 matmul takes 35 ms, the same product from float32 copies 6.4 ms, and a 1 x 128 bf16 prefill of 124M spends
1.16 s of its 1.73 s in those matmuls. For inference over at least `upcast_min_rows(dtype)` rows, `linear` computes
the product from float32 copies of x, the weight and the bias (exact: bf16 and fp16 widen to float32 without
rounding), accumulates in float32 as the low-precision GEMM does, and rounds the result once to x's dtype: what that
GEMM returns, up to the order of the float32 sums. Fewer rows (decoding) keep the low-precision kernel, which reads
half the bytes and is as fast or faster there. Float32 and other devices are untouched.

Autocast on such a CPU (`train --dtype bf16` there, its evaluations, any forward under `torch.autocast("cpu")`): the
matmuls autocast runs in bf16/fp16, backward's included, are slower still. On the AMD AVX2 CPU one (512, 768) @ (768,
3072) linear's forward and backward took 5.4 s in bf16 against 60 ms in float32, and a 124M training step ran at 2.7
tokens/s against float32's 100. There, over `upcast_min_rows` rows, `autocast_linear` (the Linears, the reference
head), `addmm_upcast` (c_attn.py's CAttn) and the fused head (fused.py) compute each product autocast would make in
bf16/fp16 as a float32 product of its operands cast to that dtype, rounded once to it: the forward product, the input's
and the weight's gradients, with the roundings autocast makes (operands cast, each product's result in autocast's
dtype, gradients cast back to each input's dtype) and the cast operands saved for backward, as autocast saves them.
What differs from autocast's own kernels is the order of the float32 sums. Not under torch.compile (the compiler
makes its own kernels). Attention there (`attention`): SDPA's bf16 backward is slow code too (4 x 12 heads x 256
tokens: forward and backward 171 ms in bf16, 33 ms from float32 copies; 22% of a 4 x 256 training step of 124M), so
when autograd records through it, SDPA runs on float32 copies of the bf16/fp16 q, k and v and its output is rounded
once to their dtype; the gradients reaching q, k and v are rounded once to it too. That is not autocast's arithmetic
(its kernel rounds the probabilities to bf16 before multiplying them with v): it is closer to float32's, and the
bf16 step's distance to float32 stays inside transformers' own (tests/test_backward_parity.py). Autograd keeps the
float32 copies (10 more bytes a token per n_embd in each block, measured: train.memory counts them). Its forward
alone is as fast in bf16 as in float32 there, so inference keeps SDPA's own kernel.

Prepacked weights: oneDNN's bf16/fp16 matmul on a plain [out, in] weight reorders that weight into its blocked layout
on every call, a pass over the weight that a decode step pays 49 times per token (4 matmuls a block, and the head).
`set_packed` marks weights (the model does it for the contiguous layout, `GPT2.set_packed_weights`: c_attn's one
(3C, C) weight, c_proj, c_fc, the MLP's c_proj and the head); the first inference matmul on a marked weight
keeps oneDNN's reordered copy (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing uses) and
later ones run on it (`_linear_pointwise`), until the weight changes (its data pointer or version). It costs one more
copy of each packed weight. `packs` says where: where oneDNN has bf16 (AVX512-BF16, AMX) or fp16 kernels. Measured on
the Xeon below (`python -m benchmarks.lowp_gemm`, packed time / plain kernel time, the blocks' three shapes summed;
the head apart): bf16 with AMX 0.52 at 1 and 8 rows, 0.59 at 32, 0.68 at 128, 0.96 at 512 (head 0.40 .. 0.92), the
same products bit for bit up to 32 rows there; bf16 with AVX512-BF16 alone 0.46 .. 0.67 at 1 and 8 rows. fp16 timed
one shape at a time is mixed (1.38 at 1 row, 0.86 .. 1.00 from 8; head 0.73 .. 1.02), but a whole greedy decode of
124M, every weight read once per token, runs 44.0 tok/s packed against 40.2 unpacked, so fp16 weights are packed too.
AVX2 has no packed bf16 or fp16 kernel (the reorder refuses; nothing is packed). Every call on a marked weight takes
the same route for the same shape, so a decode step (decode.py) and the forward it stands for stay bit-identical by
construction.

The threshold depends on the CPU's instructions as oneDNN, torch's low-precision GEMM, may use them. Measured on an
Intel Xeon with AMX, 2 threads, oneDNN held lower with ONEDNN_MAX_CPU_ISA to approximate older CPUs, and on real ones
where one was at hand, which decide (`python -m benchmarks.lowp_gemm`, the three 124M shapes summed; kernel time /
float32 copies' time at 8 .. 512 rows):
- bf16 with AMX: 0.22 .. 0.14 (2.8x .. 6.4x faster than float32 itself): never;
- bf16 with AVX512-BF16 and no AMX: never. On a real such CPU (an AMD EPYC with AVX-512 and AVX512-BF16, 2 threads)
  0.07 at 1 row, 0.09 at 8, 0.24 at 128, 0.37 at 512 (the bf16 kernel 2.3x faster than float32 itself at 512 rows),
  and a 124M bf16 autocast training step took 4.14 s with the float32 products against transformers' 2.02 s. The
  Xeon held to AVX512_CORE_BF16 had stood in for such a CPU and said the opposite (0.38 at 8 rows, 1.23 at 128, 1.45
  at 512: "from 128 rows", the rule before); the real CPU decides;
- fp16 where oneDNN has fp16 kernels (AVX512-FP16 or AMX-FP16): 0.41 .. 0.91 (as fast as float32 from 64 rows):
  never; without them (AVX512_CORE_BF16) 1.28 at 8 rows, 2.22 at 16, 7.4 at 128, and on the real AVX512-BF16 CPU
  above 0.94 at 8, 1.47 at 16, 3.49 at 128: from 16 rows;
- neither (AVX2): 1.34 at 8 rows, 2.10 at 16, 6.6 at 128 (on an AMD AVX2 CPU: about the same time at 8 rows, 1.7x-2.2x
  at 16, 5x at 128): from 16 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..cpu import cpu_features, on_packed, pack, packs
from ..devices import autocast_dtype, compiling

UPCAST_MIN_ROWS = 16  # no low-precision instructions (AVX2)
_LOWP = (torch.bfloat16, torch.float16)


def upcast_min_rows(dtype: torch.dtype, features: frozenset[str] | None = None) -> int | None:
    """Rows from which a `dtype` inference matmul on a CPU with `features` (this CPU's by default) is computed from
    float32 copies; None: never. Never where oneDNN has kernels for `dtype` (bf16: AVX512-BF16 or AMX; fp16: its fp16
    kernels), the instructions that make packing pay too (`packs`); from UPCAST_MIN_ROWS elsewhere (see the module's
    docstring for the measurements)."""
    f = cpu_features() if features is None else features
    return None if packs(dtype, f) else UPCAST_MIN_ROWS


def upcasts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` computes x @ weight^T from float32 copies (see the module's docstring)."""
    if not (
        x.dtype in _LOWP
        and x.device.type == "cpu"
        and weight.dtype == x.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return False
    rows = upcast_min_rows(x.dtype)
    return rows is not None and x.numel() >= rows * x.shape[-1]


def _from_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


# ---------------------------------------------------------------------------------------------- prepacked weights
# A marked weight -> [key, packed]: key (data pointer, version) of the weight `packed` was made from (None: not
# yet), packed the oneDNN copy or None where this torch or CPU has no packed kernel. Keyed by identity, held weakly.
_marks: WeakIdKeyDictionary = WeakIdKeyDictionary()


def set_packed(weight: torch.Tensor, enabled: bool) -> None:
    """Mark (or unmark) a 2-D weight for packing; it is packed on first use, where `packs` says it pays then."""
    if not enabled:
        _marks.pop(weight, None)
    elif weight not in _marks:
        _marks[weight] = [None, None]


def is_packed(weight: torch.Tensor) -> bool:
    """Whether `weight` is marked and its packed copy was made (and is current)."""
    mark = _marks.get(weight)
    return mark is not None and mark[1] is not None and mark[0] == (weight.data_ptr(), weight._version)


def _packed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy to multiply x by, or None: the weight is not marked, or the call is not a CPU inference
    matmul of x's low-precision dtype where `packs` says packing pays."""
    if not (x.dtype in _LOWP and x.device.type == "cpu" and weight.dtype == x.dtype):
        return None
    mark = _marks.get(weight)
    if mark is None or weight.device.type != "cpu" or not packs(weight.dtype):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    key = (weight.data_ptr(), weight._version)
    if mark[0] != key:
        mark[1], mark[0] = pack(weight), key
    return mark[1]


def _shortcut(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ weight^T + bias as autocast's float32-product stand-in under CPU autocast where it applies
    (`autocast_linear`), from float32 copies where `upcasts` says so, else on the packed weight where there is one;
    None where F.linear is the call (see the module's docstring). None under torch.compile: these are eager kernels'
    stand-ins, and the compiler picks its own (tracing them would read CPU capabilities dynamo will not trace)."""
    if compiling():
        return None
    y = autocast_linear(x, weight, bias)
    if y is not None:
        return y
    if upcasts(x, weight):
        return _from_float32(x, weight, bias)
    packed = _packed(x, weight)
    return None if packed is None else on_packed(x, packed, bias)


def linear_wb(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through `_shortcut` where one applies."""
    y = _shortcut(x, weight, bias)
    return F.linear(x, weight, bias) if y is None else y


def linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """m(x) for a Linear module: a plain nn.Linear as `linear_wb` computes it where that differs from F.linear;
    otherwise (and for another module, e.g. int8) the module is called."""
    y = _shortcut(x, m.weight, m.bias) if type(m) is nn.Linear else None
    return m(x) if y is None else y


# ---------------------------------------------------------------------------------------------- autocast on the CPU
_autocast_upcast = [True]  # False: autocast's own low-precision kernels everywhere (for comparisons)


def set_autocast_upcast(enabled: bool) -> None:
    """Turn the float32 products under CPU autocast on (the default) or off (autocast's kernels)."""
    _autocast_upcast[0] = enabled


def upcasts_autocast_dtype(dtype: torch.dtype) -> bool:
    """Whether CPU autocast to `dtype` runs its matmuls as float32 products on this CPU (from `upcast_min_rows` rows;
    a training batch has more)."""
    return _autocast_upcast[0] and dtype in _LOWP and upcast_min_rows(dtype) is not None


def autocast_upcast(x: torch.Tensor) -> torch.dtype | None:
    """autocast's dtype when its matmuls over x's rows run as float32 products here (see the module's docstring):
    CPU autocast to bf16 or fp16 on a CPU whose kernels for it are slower (`upcast_min_rows`), over at least that many
    rows, outside torch.compile; else None."""
    if x.device.type != "cpu" or not _autocast_upcast[0] or compiling():
        return None
    dt = autocast_dtype("cpu")
    if dt is None or not upcasts_autocast_dtype(dt):
        return None
    return dt if x.numel() >= upcast_min_rows(dt) * x.shape[-1] else None  # type: ignore[operator]


def mm_upcast(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """a @ b as a `dt` GEMM with float32 sums gives it (a and b already in `dt`): a float32 product rounded once."""
    with torch.autocast("cpu", enabled=False):
        return torch.mm(a.float(), b.float()).to(dt)


def addmm_upcast(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """bias + a @ b as `mm_upcast` computes the product (all three already in `dt`)."""
    with torch.autocast("cpu", enabled=False):
        return torch.addmm(bias.float(), a.float(), b.float()).to(dt)


class _AutocastLinear(torch.autograd.Function):
    """F.linear(x, w, b) as autocast runs it in `dt` (x, w and b cast to `dt`, the product and both gradient products
    in `dt`, each gradient cast back to its input's dtype), every product computed by `mm_upcast`. Saves the cast x
    and w, as autocast's linear does."""

    @staticmethod
    def forward(ctx, x, w, b, dt):  # noqa: ANN001, ANN205 (autograd's signature)
        xc, wc = x.to(dt), w.to(dt)  # (..., in), (out, in)
        ctx.save_for_backward(xc, wc)
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        x2 = xc.reshape(-1, xc.shape[-1])  # (N, in)
        y = mm_upcast(x2, wc.t(), dt) if b is None else addmm_upcast(b.to(dt), x2, wc.t(), dt)  # (N, out)
        return y.view(*xc.shape[:-1], wc.shape[0])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        xc, wc = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dt = wc.dtype
        g = grad.to(dt).reshape(-1, wc.shape[0])  # (N, out)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = mm_upcast(g, wc, dt).view(xc.shape).to(x_dtype)  # (N, out) @ (out, in)
        if ctx.needs_input_grad[1]:
            gw = mm_upcast(g.t(), xc.reshape(-1, xc.shape[-1]), dt).to(w_dtype)  # (out, N) @ (N, in)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            gb = g.sum(0).to(b_dtype)  # a `dt` sum, as the bias gradient autocast makes
        return gx, gw, gb, None


def autocast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """F.linear(x, weight, bias) through `_AutocastLinear` where `autocast_upcast` says so, else None."""
    dt = autocast_upcast(x)
    return None if dt is None else _AutocastLinear.apply(x, weight, bias, dt)


def upcasts_attention(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether `attention` runs SDPA on float32 copies: autograd records through q, which is in the dtype
    `autocast_upcast(x)` names (x: the attention's (B, T, C) input)."""
    return torch.is_grad_enabled() and q.requires_grad and autocast_upcast(x) == q.dtype


def attention(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:  # noqa: ANN003
    """F.scaled_dot_product_attention(q, k, v, **kw), from float32 copies rounded once to q's dtype where
    `upcasts_attention` says so (see the module's docstring). q: (B, nh, T, hs); k, v: (B, nh, S, hs)."""
    if not upcasts_attention(x, q):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    mask = kw.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        kw["attn_mask"] = mask.float()
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
