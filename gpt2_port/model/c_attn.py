"""q, k and v as GPT-2's `c_attn` computes them: one (C, 3C) matmul over the three projections side by side.

An official checkpoint stores one c_attn `[C, 3C]` and loads as three `nn.Linear` whose weights are views into it (no
copy). Two ways to run the one matmul from them:

- inference: `fused_qkv` finds the (3C, C) weight the three are views of and hands it to F.linear. One matmul decodes
  faster than three strided ones (measured ~30% less time in that matmul). The contiguous layout (io/load.py) keeps
  the one matmul too: q, k and v are row blocks of one contiguous `[3C, C]` there (a bf16/fp16 decode on the CPU
  spends ~30% less time in one (3C, C) product than in three (C, C) ones). The view is made with as_strided on
  q's weight, so autograd would send all of c_attn's gradient to q_proj: never used when a gradient is wanted.
- training: `CAttn`, a custom autograd Function with transformers' Conv1D arithmetic. Forward: addmm(b, x, W), W the
  `[C, 3C]` c_attn matrix (the checkpoint's storage viewed when q/k/v are adjacent views of it, else assembled).
  It saves x and the three weight parameters themselves (no copy of W is kept for backward: 85 MB at 124M when
  autograd kept a torch.cat). Backward runs the ops autograd runs for Conv1D's addmm (grad @ W^T, x^T @ grad,
  grad.sum(0)) and splits the `[C, 3C]` weight gradient into q, k and v's `[out, in]` ones (transposes, views), so
  the gradients equal transformers' bit for bit. Under autocast it does what autocast does to Conv1D's addmm: x, W
  and b cast to the autocast dtype for the matmul (the cast x is what is saved), the gradients computed in that dtype
  and cast back to each input's own (float32 for the parameters), so a bf16 training step runs and matches
  transformers' under the same autocast. On a CPU whose bf16/fp16 GEMM is slow those products are float32 products
  of the same cast operands, rounded once (lowp.autocast_upcast).

Under torch.compile the view test (storage pointers) is not traced: the weight is assembled with torch.cat, which
the compiler folds into the matmul's input; the arithmetic is the same.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..devices import autocast_dtype, compiling
from .lowp import addmm_upcast, autocast_upcast, linear, linear_wb, mm_upcast


def c_attn_view(
    wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The `[C, 3C]` weight and (3C,) bias that q/k/v's (C, C) [out, in] weights and biases are adjacent views of,
    as views of that storage (no copy), or None when they are not laid out so (or under torch.compile, which does
    not trace storage pointers). Two layouts are views of one c_attn: `qkv_layout`'s "columns" (the checkpoint's
    `[C, 3C]`, each weight a transposed column block) and "rows" (one contiguous `[3C, C]`, each weight a row
    block: the contiguous layout's)."""
    if compiling():
        return None
    layout = qkv_layout(wq, wk, wv, bq, bk, bv)
    if layout is None:
        return None
    C = wq.shape[1]
    w = wq.as_strided((C, 3 * C), (3 * C, 1) if layout == "columns" else (1, C))
    return w, bq.as_strided((3 * C,), (1,))


QkvLayout = Literal["columns", "rows"]


def qkv_layout(
    wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor
) -> QkvLayout | None:
    """How q/k/v's (C, C) [out, in] weights are adjacent views of one c_attn, or None (they are not; their biases
    must be adjacent views of one (3C,) too): "columns", transposed column blocks of a `[C, 3C]` (strides (1, 3C), a
    checkpoint's c_attn), or "rows", row blocks of a contiguous `[3C, C]` (strides (C, 1))."""
    C = wq.shape[1]
    if not (wq.shape == wk.shape == wv.shape == (C, C) and wq.dtype == wk.dtype == wv.dtype == bq.dtype):
        return None
    if not (bq.shape == bk.shape == bv.shape == (C,) and bq.dtype == bk.dtype == bv.dtype):
        return None
    if not bq.stride() == bk.stride() == bv.stride() == (1,):
        return None
    if wq.stride() == wk.stride() == wv.stride() == (1, 3 * C):
        layout: QkvLayout = "columns"
    elif wq.stride() == wk.stride() == wv.stride() == (C, 1):
        layout = "rows"
    else:
        return None
    step = C if layout == "columns" else C * C  # elements from one weight's start to the next's
    ws, bs = wq.untyped_storage().data_ptr(), bq.untyped_storage().data_ptr()
    wo, bo = wq.storage_offset(), bq.storage_offset()
    for i, (w, b) in enumerate(((wk, bk), (wv, bv)), start=1):
        if w.untyped_storage().data_ptr() != ws or w.storage_offset() != wo + i * step:
            return None
        if b.untyped_storage().data_ptr() != bs or b.storage_offset() != bo + i * C:
            return None
    return layout


def c_attn_weight(
    wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq: torch.Tensor, bk: torch.Tensor, bv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """c_attn's `[C, 3C]` weight and (3C,) bias, row-major as Conv1D's parameter is (so that the matmuls and their
    gradients run as transformers' do): the shared storage viewed in the checkpoint layout ("columns"), else
    assembled (a copy)."""
    fused = c_attn_view(wq, wk, wv, bq, bk, bv)
    if fused is not None and fused[0].is_contiguous():
        return fused
    return torch.cat((wq.t(), wk.t(), wv.t()), dim=1), torch.cat((bq, bk, bv))  # (C, 3C), (3C,)


def _plain(q: nn.Module, k: nn.Module, v: nn.Module) -> bool:
    """Whether q, k and v are plain biased nn.Linear (not, e.g., int8 modules): what one c_attn can stand for."""
    return all(type(m) is nn.Linear and m.bias is not None for m in (q, k, v))


def fused_qkv(q: nn.Module, k: nn.Module, v: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (3C, C) weight and (3C,) bias that q/k/v are adjacent views of, or None. Inference only (see above).

    The same two tensor objects while the views stand (kept in q's `__dict__`, keyed by where they point), so that
    what is keyed by the tensor (oneDNN's packed copy, lowp.set_packed) holds across calls. The kept views hold
    the storage they point to until the next call finds q/k/v elsewhere. None under torch.compile (see above)."""
    if compiling() or not _plain(q, k, v):
        return None
    fused = c_attn_view(q.weight, k.weight, v.weight, q.bias, k.bias, v.bias)
    if fused is None:
        q.__dict__.pop("_fused_qkv", None)
        return None
    w, b = fused[0].t(), fused[1]  # (3C, C) [out, in], (3C,)
    key = (w.data_ptr(), w.stride(), w.dtype, w.device, b.data_ptr())
    kept = q.__dict__.get("_fused_qkv")
    if kept is None or kept[0] != key:
        kept = q.__dict__["_fused_qkv"] = (key, (w, b))
    return kept[1]


def qkv_tied(q: nn.Module, k: nn.Module, v: nn.Module) -> QkvLayout | None:
    """How q/k/v's weights and biases are adjacent views of one c_attn weight and bias (`qkv_layout`), or None."""
    if not _plain(q, k, v):
        return None
    return qkv_layout(q.weight, k.weight, v.weight, q.bias, k.bias, v.bias)


@torch.no_grad()
def tie_qkv(q: nn.Linear, k: nn.Linear, v: nn.Linear, layout: QkvLayout = "columns") -> None:
    """Make q/k/v's weights and biases adjacent views of one new c_attn weight and (3C,) bias holding their values
    (on their device, in their dtype), laid out as `layout` says: "columns" (a `[C, 3C]`, what a load of the
    checkpoint layout gives) or "rows" (a contiguous `[3C, C]`, the contiguous layout's). The parameters stay the
    same objects (an optimizer's references hold)."""
    C = q.weight.shape[1]
    if layout == "columns":
        w = torch.cat((q.weight.t(), k.weight.t(), v.weight.t()), dim=1)  # (C, 3C), contiguous
        blocks = [w[:, i * C : (i + 1) * C].t() for i in range(3)]  # (C, C) [out, in], strides (1, 3C)
    else:
        w = torch.cat((q.weight, k.weight, v.weight), dim=0)  # (3C, C), contiguous
        blocks = [w[i * C : (i + 1) * C] for i in range(3)]  # (C, C) [out, in], strides (C, 1)
    b = torch.cat((q.bias, k.bias, v.bias))  # (3C,)
    for i, m in enumerate((q, k, v)):
        m.weight.data = blocks[i]
        m.bias.data = b[i * C : (i + 1) * C]


class CAttn(torch.autograd.Function):
    """(N, C) x -> (N, 3C) = addmm(b, x, W) with gradients for x and q/k/v's weights and biases (see above)."""

    @staticmethod
    def forward(ctx, x2d, wq, wk, wv, bq, bk, bv):  # noqa: ANN001, ANN205 (autograd's signature)
        w, b = c_attn_weight(wq, wk, wv, bq, bk, bv)
        dt = autocast_dtype(x2d.device.type)
        ctx.dt, ctx.in_dtype, ctx.upcast = dt, x2d.dtype, dt is not None and autocast_upcast(x2d) == dt
        if dt is not None:  # autocast's addmm: every input in its dtype
            x2d, w, b = x2d.to(dt), w.to(dt), b.to(dt)
        ctx.save_for_backward(x2d, wq, wk, wv, bq, bk, bv)  # the (cast) input and the parameters: nothing copied
        if ctx.upcast:  # a CPU whose `dt` GEMM is slow: the same product from float32 copies (lowp.py)
            return addmm_upcast(b, x2d, w, dt)
        return torch.addmm(b, x2d, w)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        x2d, wq, wk, wv, bq, bk, bv = ctx.saved_tensors
        C, dt = wq.shape[1], ctx.dt
        need = ctx.needs_input_grad
        gx = gq = gk = gv = gbq = gbk = gbv = None
        if dt is not None:
            grad = grad.to(dt)
        mm = (lambda a, b: mm_upcast(a, b, dt)) if ctx.upcast else torch.mm
        if need[0]:  # as autograd's mm_mat1_backward: a column-major x gets its gradient column-major
            w, _ = c_attn_weight(wq, wk, wv, bq, bk, bv)
            w = w if dt is None else w.to(dt)
            N = x2d.shape[0]
            if x2d.stride(0) == 1 and x2d.stride(1) == N:
                gx = mm(w, grad.t()).t()
            else:
                gx = mm(grad, w.t())  # (N, 3C) @ (3C, C)
        if any(need[1:4]):  # as mm_mat2_backward for Conv1D's row-major [C, 3C] weight
            gq, gk, gv = (g.t() for g in mm(x2d.t(), grad).split(C, dim=1))  # (C, 3C) -> 3 x (C, C) [out, in]
        if any(need[4:7]):  # as autograd's sum_to for addmm's broadcast bias
            gbq, gbk, gbv = grad.sum(0).split(C)
        if dt is not None:  # autocast's casts, undone: each gradient in its input's dtype
            gx = None if gx is None else gx.to(ctx.in_dtype)
            gq, gk, gv = (None if g is None else g.to(wq.dtype) for g in (gq, gk, gv))
            gbq, gbk, gbv = (None if g is None else g.to(bq.dtype) for g in (gbq, gbk, gbv))
        return gx, gq, gk, gv, gbq, gbk, gbv


def project_qkv(
    x: torch.Tensor, q: nn.Module, k: nn.Module, v: nn.Module, grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, C) -> q, k, v (B, T, C) each. grad: a gradient is wanted (no shared-storage view then)."""
    B, T, C = x.shape
    plain = _plain(q, k, v)
    if grad and plain:  # c_attn as transformers runs it, [in, 3 out], gradients split back into q, k and v
        y = CAttn.apply(x.reshape(-1, C), q.weight, k.weight, v.weight, q.bias, k.bias, v.bias)  # (B*T, 3C)
        return y.view(B, T, 3 * C).split(C, dim=-1)
    fused = None if grad else fused_qkv(q, k, v)
    if fused is not None:  # the checkpoint's own c_attn storage, viewed: no copy
        return linear_wb(x, *fused).split(C, dim=-1)
    return linear(q, x), linear(k, x), linear(v, x)
