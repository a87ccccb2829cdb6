"""bf16/fp16 inference on oneDNN's packed weights (model/lowp.py): where the CPU has the kernels, a load in the
contiguous layout packs every block Linear and the head on first use; the packed products are as close to the truth as
the plain kernel's; a weight that changes is packed again; gradients, float32, the checkpoint layout and a model built
in memory never take the route; and the decode step stays bit-identical to the forward, by construction (both call
lowp.linear_wb with the same shapes)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, decode_steps, lowp_operands

from gpt2_port.model import GPT2, lowp
from gpt2_port.model.c_attn import fused_qkv
from gpt2_port.model.gpt2 import from_pretrained

pytestmark = pytest.mark.exactness


def _packs_here(dtype: torch.dtype) -> bool:
    """Whether this CPU (under any ONEDNN_MAX_CPU_ISA cap) packs `dtype` weights and this torch can."""
    if not lowp.packs(dtype):
        return False
    w = torch.zeros(8, 8, dtype=dtype)
    lowp.set_packed(w, True)
    lowp.linear_wb(torch.zeros(1, 8, dtype=dtype), w, None)
    return lowp.is_packed(w)


def _needs_packing(dtype: torch.dtype):  # noqa: ANN202
    return pytest.mark.skipif(
        not _packs_here(dtype),
        reason=f"NOT RUN: this CPU has no oneDNN packed {dtype} kernel (bf16: AVX512-BF16 or AMX; fp16: AVX512-FP16 "
        "or AMX-FP16; or ONEDNN_MAX_CPU_ISA holds oneDNN below them), so nothing is packed here",
    )


LOWP = [
    pytest.param(torch.bfloat16, marks=_needs_packing(torch.bfloat16), id="bf16"),
    pytest.param(torch.float16, marks=_needs_packing(torch.float16), id="fp16"),
]


def _weights(m: GPT2) -> list[torch.Tensor]:
    """Every weight an inference matmul runs on: the head, and per block c_attn's (3C, C) where q/k/v are views of
    one (else q, k and v), c_proj, c_fc and the MLP's c_proj."""
    out = [m.head_weight]
    for b in m.h:
        a = b.attn
        fused = fused_qkv(a.q_proj, a.k_proj, a.v_proj)
        out += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight] if fused is None else [fused[0]]
        out += [a.c_proj.weight, b.mlp.c_fc.weight, b.mlp.c_proj.weight]
    return out


def test_the_rule_follows_the_instructions() -> None:
    none, avx512, amx, fp16 = frozenset(), frozenset({"avx512_bf16"}), frozenset({"amx_bf16"}), frozenset({"fp16_gemm"})
    assert [lowp.packs(torch.bfloat16, f) for f in (none, avx512, amx, fp16)] == [False, True, True, False]
    assert [lowp.packs(torch.float16, f) for f in (none, avx512, amx, fp16)] == [False, False, False, True]
    assert not lowp.packs(torch.float32, avx512 | amx | fp16)


@pytest.mark.parametrize("dtype", LOWP)
def test_a_contiguous_load_packs_every_matmul_weight_on_first_use(tiny_official: Path, dtype: torch.dtype) -> None:
    m, _ = from_pretrained(tiny_official, dtype=dtype)
    ws = _weights(m)
    assert not any(lowp.is_packed(w) for w in ws)  # made on first use, not at load
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]))
    assert all(lowp.is_packed(w) for w in ws)
    m.set_packed_weights(False)
    assert not any(lowp.is_packed(w) for w in ws)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_checkpoint_layout_float32_and_a_model_built_in_memory_are_not_packed(
    tiny_official: Path, dtype: torch.dtype
) -> None:
    views, _ = from_pretrained(tiny_official, dtype=dtype, layout="checkpoint")  # the parity checker's calls
    f32, _ = from_pretrained(tiny_official, layout="contiguous")
    built = GPT2(TINY).init_weights(0).to(dtype).eval().requires_grad_(False)
    with torch.no_grad():
        for m in (views, f32, built):
            m(torch.tensor([[1, 2, 3]]))
            assert not any(lowp.is_packed(w) for w in _weights(m))


@pytest.mark.parametrize("rows", [1, 8, 64, 200])
@pytest.mark.parametrize("dtype", LOWP)
def test_a_packed_product_is_as_close_to_the_truth_as_the_kernels(dtype: torch.dtype, rows: int) -> None:
    x, w, b = lowp_operands(rows, dtype)
    lowp.set_packed(w, True)
    got = lowp.linear_wb(x, w, b)
    assert lowp.is_packed(w) and got.dtype == dtype and got.shape == (rows, 512)
    truth = F.linear(x.double(), w.double(), b.double())
    ours = (got.double() - truth).norm() / truth.norm()
    kernel = (F.linear(x, w, b).double() - truth).norm() / truth.norm()
    # Measured on the Xeon (AMX, AVX512-FP16): bf16 equal to the kernel bit for bit at 1-64 rows, fp16 within 1.0x
    assert ours <= 1.05 * kernel, (ours, kernel)


@pytest.mark.parametrize("dtype", LOWP)
def test_a_weight_changed_in_place_or_replaced_is_packed_again(dtype: torch.dtype) -> None:
    x, w, _ = lowp_operands(4, dtype)
    lowp.set_packed(w, True)
    before = lowp.linear_wb(x, w, None)
    w.mul_(2)  # exact in any dtype: every product and sum doubles
    assert torch.equal(lowp.linear_wb(x, w, None), 2 * before)
    w.data = w.data / 4  # another tensor under the same parameter
    assert torch.equal(lowp.linear_wb(x, w, None), before / 2)
    assert lowp.is_packed(w)


@pytest.mark.parametrize("dtype", LOWP)
def test_a_gradient_never_runs_on_the_packed_copy(dtype: torch.dtype) -> None:
    x, w, b = lowp_operands(4, dtype)
    w = torch.nn.Parameter(w)
    lowp.set_packed(w, True)
    y = lowp.linear_wb(x, w, b)
    assert y.requires_grad and not lowp.is_packed(w)
    assert torch.equal(y, F.linear(x, w, b))
    y.float().sum().backward()
    assert w.grad is not None and torch.equal(w.grad, (torch.ones(4, 512, dtype=dtype).t() @ x))


def test_the_packed_copy_goes_with_its_weight() -> None:
    x, w, _ = lowp_operands(2, torch.bfloat16)
    lowp.set_packed(w, True)
    lowp.linear_wb(x, w, None)
    ref = weakref.ref(w)
    gc.collect()  # marked weights of earlier tests that only a collection frees (a model's reference cycles)
    n = len(lowp._marks)
    del w
    gc.collect()
    assert ref() is None and len(lowp._marks) == n - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_steps_on_packed_weights_are_bit_identical_to_the_forward(
    tiny_official: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same route by construction: the plan's steps make as many packed calls as the forward's (here the packed
    and plain kernels happen to agree on these shapes, so the count is what shows a plan calling F.linear)."""
    m, _ = from_pretrained(tiny_official, dtype=dtype)
    ids = torch.tensor([[5, 6, 7, 8, 9], [50, 40, 30, 20, 10]]) % m.config.vocab_size
    calls: list[bool] = []
    real = lowp.on_packed
    monkeypatch.setattr(lowp, "on_packed", lambda *a: calls.append(True) or real(*a))
    fast = decode_steps(m, ids, None, 8, plan=True)
    n_fast, calls[:] = len(calls), []
    slow = decode_steps(m, ids, None, 8, plan=False)
    # c_attn (one matmul: q/k/v are row blocks of one weight), c_proj, c_fc, mlp c_proj; prefill + 8 steps
    assert n_fast == len(calls) == (4 * TINY.n_layer * 9 if _packs_here(dtype) else 0)
    assert all(lowp.is_packed(w) for w in _weights(m)[1:]) is _packs_here(dtype)  # the blocks (no head here)
    assert len({tuple(h[0, 0, :4].tolist()) for h in slow}) == 8  # the steps do differ
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("dtype", LOWP)
def test_a_packed_model_made_trainable_keeps_no_packed_copy_nor_the_loads_c_attn(
    tiny_official: Path, dtype: torch.dtype
) -> None:
    """`train`'s prepare_model gives every parameter its own memory: the packed copies and the fused c_attn view
    of the load's weights go with the old parameters (nothing packed, the old c_attn freed), and an inference
    forward afterwards packs nothing (the model is in train mode with gradients on)."""
    from gpt2_port.train import TrainArgs, prepare_model

    m, _ = from_pretrained(tiny_official, dtype=dtype)
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]))
    old = [weakref.ref(w) for w in _weights(m)]
    assert all(lowp.is_packed(r()) for r in old)
    prepare_model(m, TrainArgs(steps=1, batch_size=1, block_size=8, dropout=0.0), torch.device("cpu"))
    gc.collect()
    assert all(r() is None for r in old)
    assert not any(lowp.is_packed(w) for w in _weights(m))
    assert all("_fused_qkv" not in b.attn.q_proj.__dict__ for b in m.h)
