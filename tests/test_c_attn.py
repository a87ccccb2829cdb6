"""c_attn's training projection (model/c_attn.py CAttn): correct gradients, Conv1D's arithmetic bit for bit, and no
copy of the fused weight kept for backward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpt2_port.model import from_pretrained
from gpt2_port.model.c_attn import CAttn, c_attn_view

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration


def _fused(C: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A [C, 3C] weight and (3C,) bias, and q/k/v's [out, in] weights and biases as views of them (a loaded model)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(C, 3 * C, generator=g, dtype=dtype)
    b = torch.randn(3 * C, generator=g, dtype=dtype)
    ws = [t.t().requires_grad_(True) for t in w.detach().split(C, dim=1)]  # views of w's storage
    bs = [t.requires_grad_(True) for t in b.detach().split(C)]
    return w, b, ws + bs


def _rows(C: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The same as row blocks of one contiguous [3C, C] (the contiguous layout of a bf16/fp16 load on the CPU)."""
    w, b, _ = _fused(C, dtype, seed)
    rows = w.t().contiguous()  # (3C, C)
    ws = [t.requires_grad_(True) for t in rows.split(C)]  # (C, C) [out, in] each, views of rows' storage
    bs = [t.requires_grad_(True) for t in b.detach().clone().split(C)]
    return w, b, ws + bs


def _separate(C: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """q/k/v's weights and biases in their own storages (a model built from scratch)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype, requires_grad=True) for s in [(C, C)] * 3 + [(C,)] * 3]


def _params(layout: str, C: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    if layout == "separate":
        return _separate(C, dtype, seed)
    return (_fused if layout == "views" else _rows)(C, dtype, seed)[2]


@pytest.mark.parametrize("layout", ["views", "rows", "separate"])
def test_gradcheck_float64(layout: str) -> None:
    C, N = 4, 5
    params = _params(layout, C, torch.float64, 0)
    assert (c_attn_view(*params) is not None) == (layout != "separate")
    x = torch.randn(N, C, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(CAttn.apply, (x, *params))
    xt = torch.randn(C, N, dtype=torch.float64).t().requires_grad_(True)  # a column-major x
    assert torch.autograd.gradcheck(CAttn.apply, (xt, *params))


@pytest.mark.parametrize("layout", ["views", "rows", "separate"])
def test_gradients_equal_conv1d_addmm_bit_for_bit(layout: str) -> None:
    """transformers' Conv1D runs addmm(b, x, W) on a [C, 3C] parameter; autograd's gradients of that are the
    reference: CAttn's (split into q, k, v) must be the same floats, not merely close, whatever q/k/v's layout."""
    C, N = 48, 37
    params = _params(layout, C, torch.float32, 1)
    w = torch.cat([p.detach().t() for p in params[:3]], dim=1)  # (C, 3C), row-major as Conv1D's
    b = torch.cat([p.detach() for p in params[3:]])
    w, b = w.clone().requires_grad_(True), b.clone().requires_grad_(True)  # Conv1D's own parameters
    x = torch.randn(N, C, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    g = torch.randn(N, 3 * C, generator=torch.Generator().manual_seed(3))
    xr = x.detach().clone().requires_grad_(True)
    y_ref = torch.addmm(b, xr, w)
    y = CAttn.apply(x, *params)
    assert torch.equal(y, y_ref)
    y_ref.backward(g)
    y.backward(g)
    assert torch.equal(x.grad, xr.grad)
    for i, p in enumerate(params[:3]):
        assert torch.equal(p.grad, w.grad[:, i * C : (i + 1) * C].t()), i
    for i, p in enumerate(params[3:]):
        assert torch.equal(p.grad, b.grad[i * C : (i + 1) * C]), i


def test_no_copy_of_the_fused_weight_is_saved_for_backward(tiny_official: Path) -> None:
    """Autograd keeps only parameters and activations in train mode: no [C, 3C] tensor outside the parameters."""
    m, _ = from_pretrained(tiny_official)
    m.train().requires_grad_(True)
    C = m.config.n_embd
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            shapes.append(tuple(t.shape))
        return t

    ids = torch.randint(0, m.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = m(ids, labels=ids).loss
    loss.backward()
    assert shapes, "nothing was saved: the hook saw no forward"
    assert (C, 3 * C) not in shapes and (3 * C, C) not in shapes, shapes


def test_the_two_c_attn_layouts_are_found_kept_through_a_cast_and_fused_once() -> None:
    """q/k/v as transposed column blocks of a [C, 3C] ("columns", the checkpoint layout) or row blocks of one
    contiguous [3C, C] ("rows", the contiguous layout) are one c_attn: `fused_qkv` hands back the (3C, C) weight
    they view (the same tensor object on every call, so oneDNN's packed copy keyed by it holds), `tie_qkv` rebuilds
    either layout after a cast, and anything else (separate storages, a gap, another order) is not fused."""
    from torch import nn

    from gpt2_port.model.c_attn import fused_qkv, qkv_tied, tie_qkv

    C = 8

    def linears(params: list[torch.Tensor]) -> list[nn.Linear]:
        out = []
        for w, b in zip(params[:3], params[3:]):
            m = nn.Linear(C, C)
            m.weight, m.bias = nn.Parameter(w.detach(), False), nn.Parameter(b.detach(), False)
            out.append(m)
        return out

    for layout, make in (("columns", _fused), ("rows", _rows)):
        w, b, params = make(C, torch.float32, 4)
        q, k, v = linears(params)
        assert qkv_tied(q, k, v) == layout
        fused = fused_qkv(q, k, v)
        assert fused is not None and torch.equal(fused[0], w.t()) and torch.equal(fused[1], b)
        again = fused_qkv(q, k, v)
        assert again[0] is fused[0] and again[1] is fused[1]
        for m in (q, k, v):  # a cast converts each parameter on its own: three storages
            m.to(torch.float64)
        assert qkv_tied(q, k, v) is None and fused_qkv(q, k, v) is None
        tie_qkv(q, k, v, layout)
        assert qkv_tied(q, k, v) == layout
        refused = fused_qkv(q, k, v)
        assert refused[0] is not fused[0] and refused[0].dtype == torch.float64
        torch.testing.assert_close(refused[0], w.t().double(), rtol=0, atol=0)
    q, k, v = linears(_separate(C, torch.float32, 5))
    assert qkv_tied(q, k, v) is None
    _, _, params = _rows(C, torch.float32, 6)
    q, k, v = linears([params[1], params[0], *params[2:]])  # k's rows before q's: not c_attn's order
    assert qkv_tied(q, k, v) is None and fused_qkv(q, k, v) is None
