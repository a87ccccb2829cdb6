"""q, k and v as GPT-2's `c_attn` computes them: one (C, 3C) matmul over the three projections side by side.

An official checkpoint stores one c_attn `[C, 3C]` and loads as three `nn.Linear` whose weights are views into it (no
copy). Two ways to run the one matmul from them:

- inference: `fused_qkv` finds the (3C, C) weight the three are views of and hands it to F.linear. One matmul decodes
  faster than three strided ones (measured ~30% less time in that matmul). The view is made with as_strided on
  q's weight, so autograd would send all of c_attn's gradient to q_proj: never used when a gradient is wanted.
- training: `project_qkv(..., grad=True)` concatenates the three into c_attn's `[C, 3C]` layout, so the matmul is the
  reference's and autograd splits its gradient back into q, k and v.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fused_qkv(q: nn.Module, k: nn.Module, v: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (3C, C) weight and (3C,) bias that q/k/v are adjacent views of, or None. Inference only (see above)."""
    if not all(type(m) is nn.Linear and m.bias is not None for m in (q, k, v)):
        return None
    wq, wk, wv, bq, bk, bv = q.weight, k.weight, v.weight, q.bias, k.bias, v.bias
    C = wq.shape[1]
    if not (wq.shape == wk.shape == wv.shape == (C, C) and wq.dtype == wk.dtype == wv.dtype == bq.dtype):
        return None
    ws, bs = wq.untyped_storage().data_ptr(), bq.untyped_storage().data_ptr()
    wo, bo = wq.storage_offset(), bq.storage_offset()
    for i, (w, b) in enumerate(((wk, bk), (wv, bv)), start=1):
        if w.untyped_storage().data_ptr() != ws or w.storage_offset() != wo + i * C:
            return None
        if b.untyped_storage().data_ptr() != bs or b.storage_offset() != bo + i * C:
            return None
    if not wq.stride() == wk.stride() == wv.stride() == (1, 3 * C):
        return None
    if not bq.stride() == bk.stride() == bv.stride() == (1,):
        return None
    return wq.as_strided((3 * C, C), (1, 3 * C)), bq.as_strided((3 * C,), (1,))


def project_qkv(
    x: torch.Tensor, q: nn.Module, k: nn.Module, v: nn.Module, grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, C) -> q, k, v (B, T, C) each. grad: a gradient is wanted (no shared-storage view then)."""
    B, T, C = x.shape
    plain = all(type(m) is nn.Linear and m.bias is not None for m in (q, k, v))
    if grad and plain:  # c_attn as transformers holds it, [in, 3 out], assembled so autograd splits
        w = torch.cat((q.weight.t(), k.weight.t(), v.weight.t()), dim=1)  # (C, 3C)
        b = torch.cat((q.bias, k.bias, v.bias))  # (3C,)
        return torch.addmm(b, x.reshape(-1, C), w).view(B, T, 3 * C).split(C, dim=-1)
    fused = None if grad else fused_qkv(q, k, v)
    if fused is not None:  # the checkpoint's own c_attn storage, viewed: no copy
        return F.linear(x, *fused).split(C, dim=-1)
    return q(x), k(x), v(x)
