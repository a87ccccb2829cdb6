"""bf16/fp16 inference on a CPU whose low-precision GEMM is slower than float32 copies: from a row threshold that
depends on the CPU's instructions the matmuls run from float32 copies and round once (model/lowp.py); fewer rows,
training and float32 keep their kernels. The rule is pinned here; the arithmetic is checked with the threshold
forced either way, so it runs on any CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, LowPrecisionProducts, lowp_operands

from gpt2_port.model import GPT2, lowp

pytestmark = pytest.mark.exactness


@pytest.fixture
def no_bf16_units(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lowp, "cpu_features", lambda: frozenset())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_float32_product_rounds_once_and_is_as_close_as_the_low_precision_kernel(dtype, no_bf16_units) -> None:  # noqa: ANN001
    x, w, b = lowp_operands(64, dtype)
    got = lowp.linear_wb(x, w, b)
    assert got.dtype == dtype
    assert torch.equal(got, F.linear(x.float(), w.float(), b.float()).to(dtype))  # widened exactly, rounded once
    truth = F.linear(x.double(), w.double(), b.double())
    ours = (got.double() - truth).norm() / truth.norm()
    kernel = (F.linear(x, w, b).double() - truth).norm() / truth.norm()
    assert ours <= 1.05 * kernel, (ours, kernel)  # measured: equal to 3 digits (one rounding of a float32 sum each)


def test_the_choice_rows_training_float32_and_the_cpu(no_bf16_units) -> None:  # noqa: ANN001
    few, many = (
        lowp_operands(lowp.UPCAST_MIN_ROWS - 1, torch.bfloat16),
        lowp_operands(lowp.UPCAST_MIN_ROWS, torch.bfloat16),
    )
    assert not lowp.upcasts(few[0], few[1]) and lowp.upcasts(many[0], many[1])  # decoding rows keep bf16
    assert not lowp.upcasts(many[0].float(), many[1].float())
    w = many[1].clone().requires_grad_(True)
    assert not lowp.upcasts(many[0], w)  # training: autocast's arithmetic, untouched
    with torch.no_grad():
        assert lowp.upcasts(many[0], w)


def test_the_probe_decides_on_a_cpu_with_bf16_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lowp, "cpu_features", lambda: frozenset({"amx_bf16"}))
    x, w, b = lowp_operands(64, torch.bfloat16)
    assert not lowp.upcasts(x, w) and torch.equal(lowp.linear_wb(x, w, b), F.linear(x, w, b))


def test_the_threshold_follows_the_instructions() -> None:
    """Measured with benchmarks.lowp_gemm: AMX's and AVX512-BF16's bf16 kernels (the latter on a real such CPU, an AMD
    EPYC) and oneDNN's fp16 kernels beat float32 copies at every row count; without them the kernels lose from 16."""
    bf16, fp16 = torch.bfloat16, torch.float16
    assert lowp.upcast_min_rows(bf16, frozenset({"amx_bf16", "avx512_bf16"})) is None
    assert lowp.upcast_min_rows(bf16, frozenset({"avx512_bf16"})) is None
    assert lowp.upcast_min_rows(bf16, frozenset({"fp16_gemm"})) == lowp.UPCAST_MIN_ROWS == 16
    assert lowp.upcast_min_rows(fp16, frozenset({"fp16_gemm"})) is None
    assert lowp.upcast_min_rows(fp16, frozenset({"amx_bf16", "avx512_bf16"})) == lowp.UPCAST_MIN_ROWS


def test_avx512_bf16_alone_keeps_the_bf16_kernel_at_any_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lowp, "cpu_features", lambda: frozenset({"avx512_bf16"}))
    few, many = lowp_operands(8, torch.bfloat16), lowp_operands(512, torch.bfloat16)
    assert not lowp.upcasts(few[0], few[1]) and not lowp.upcasts(many[0], many[1])
    assert not lowp.upcasts_autocast_dtype(torch.bfloat16)  # training under bf16 autocast keeps autocast's kernels
    assert lowp.upcasts(many[0].half(), many[1].half())  # fp16 without oneDNN's fp16 kernels: from 16 rows


@pytest.mark.parametrize("cap", [None, "", "AVX512_CORE_BF16", "avx2", "SSE41", "AVX512_CORE_AMX"])
def test_this_cpus_features_are_torchs_under_onednns_cap(monkeypatch: pytest.MonkeyPatch, cap: str | None) -> None:
    """torch.cpu's probes read the CPU; ONEDNN_MAX_CPU_ISA holds oneDNN's kernels, and so torch's bf16 matmul, below
    them (the second test configuration sets it), and the features follow the cap."""
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    lowp.cpu_features.cache_clear()
    try:
        got = lowp.cpu_features()
    finally:
        lowp.cpu_features.cache_clear()
    amx, avx512_bf16 = torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_bf16_supported()
    low = (cap or "").upper() in ("AVX2", "SSE41")
    assert ("amx_bf16" in got) is (amx and not low and cap != "AVX512_CORE_BF16")
    assert ("avx512_bf16" in got) is (avx512_bf16 and not low)
    assert ("fp16_gemm" in got) is bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def test_a_bf16_prefill_runs_every_matmul_in_float32_and_a_decode_step_in_bf16(
    no_bf16_units, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # noqa: ANN001
    model = GPT2(TINY).init_weights(0).to(torch.bfloat16).eval().requires_grad_(False)
    seen: list[torch.dtype] = []
    real = F.linear

    def spy(x, w, b=None):  # noqa: ANN001, ANN202
        seen.append(w.dtype)
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    ids = torch.randint(0, TINY.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    assert logits.dtype == torch.bfloat16
    assert len(seen) == 6 * TINY.n_layer + 1 and set(seen) == {torch.float32}  # q, k, v, c_proj, c_fc, c_proj, head
    seen.clear()
    with torch.no_grad():
        model(ids[:, :1])
    assert seen and set(seen) == {torch.bfloat16}


# -- autocast on a CPU whose bf16/fp16 GEMM is slow: float32 products of the cast operands, rounded as autocast does -
def _rel(a: torch.Tensor, truth: torch.Tensor) -> float:
    return float((a.double() - truth).norm() / truth.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_linear_rounds_where_autocast_rounds_and_is_as_close_as_its_kernel(dtype, no_bf16_units) -> None:  # noqa: ANN001
    """Forward and both gradient products: each the float32 product of the operands cast to `dtype`, rounded once to
    `dtype` (what its GEMM with float32 sums returns, up to the order of the sums), the gradients cast back to the
    inputs' float32; and each no further from float64 truth than autocast's own kernel is."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 256, generator=g).requires_grad_(True)
    w = torch.randn(512, 256, generator=g).requires_grad_(True)
    b = torch.randn(512, generator=g).requires_grad_(True)
    up = torch.randn(64, 512, generator=g).to(dtype)  # the incoming gradient, in autocast's dtype as its output's

    def run(upcast: bool) -> tuple[torch.Tensor, ...]:
        lowp.set_autocast_upcast(upcast)
        try:
            x.grad = w.grad = b.grad = None
            with torch.autocast("cpu", dtype=dtype):
                y = lowp.linear_wb(x, w, b)
            y.backward(up)
        finally:
            lowp.set_autocast_upcast(True)
        return y.detach(), x.grad, w.grad, b.grad

    y, gx, gw, gb = run(True)
    xc, wc, bc = (t.detach().to(dtype).float() for t in (x, w, b))
    assert y.dtype == dtype and gx.dtype == gw.dtype == gb.dtype == torch.float32
    assert torch.equal(y, F.linear(xc, wc, bc).to(dtype))  # widened exactly, rounded once
    assert torch.equal(gx, (up.float() @ wc).to(dtype).float())
    assert torch.equal(gw, (up.float().t() @ xc).to(dtype).float())
    assert torch.equal(gb, up.sum(0).float())
    kernel = run(False)
    truths = (
        F.linear(xc.double(), wc.double(), bc.double()),
        up.double() @ wc.double(),
        up.double().t() @ xc.double(),
    )
    for ours, theirs, truth in zip((y, gx, gw), kernel, truths, strict=False):
        assert _rel(ours, truth) <= 1.05 * _rel(theirs, truth), (_rel(ours, truth), _rel(theirs, truth))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_on_float32_copies_rounds_once_and_is_closer_than_the_kernel(dtype, no_bf16_units) -> None:  # noqa: ANN001
    """Under autocast on a CPU without bf16 units, causal SDPA with autograd recording runs on float32 copies of the
    low-precision q, k, v: the output is float32 SDPA's rounded once to their dtype, the gradients of q, k and v
    float32 SDPA's rounded once, and each is no further from float64 truth than SDPA's own low-precision kernel.
    Without autograd recording (inference), or without autocast, SDPA's kernel runs as it is."""
    g = torch.Generator().manual_seed(3)
    B, nh, T, hs = 2, 4, 64, 32
    leaves = [torch.randn(B, nh, T, hs, generator=g).to(dtype).requires_grad_(True) for _ in range(3)]
    up = torch.randn(B, nh, T, hs, generator=g).to(dtype)  # the incoming gradient, in q's dtype as the output's
    x = torch.empty(B, T, nh * hs)  # the attention's input: only its rows and device decide

    def run(upcast: bool) -> tuple[torch.Tensor, ...]:
        for t in leaves:
            t.grad = None
        lowp.set_autocast_upcast(upcast)
        try:
            with torch.autocast("cpu", dtype=dtype):
                assert lowp.upcasts_attention(x, leaves[0]) is upcast
                y = lowp.attention(x, *leaves, is_causal=True)
            y.backward(up)
        finally:
            lowp.set_autocast_upcast(True)
        return (y.detach(), *(t.grad for t in leaves))

    ours = run(True)
    f32 = [t.detach().float().requires_grad_(True) for t in leaves]
    y32 = F.scaled_dot_product_attention(*f32, is_causal=True)
    y32.backward(up.float())
    assert ours[0].dtype == dtype and all(o.dtype == dtype for o in ours[1:])
    for o, want in zip(ours, (y32.detach(), *(t.grad for t in f32)), strict=True):
        assert torch.equal(o, want.to(dtype))  # float32 SDPA of the exact widening, rounded once
    f64 = [t.detach().double().requires_grad_(True) for t in leaves]
    y64 = F.scaled_dot_product_attention(*f64, is_causal=True)
    y64.backward(up.double())
    truths = (y64.detach(), *(t.grad for t in f64))
    kernel = run(False)
    for o, k, truth in zip(ours, kernel, truths, strict=True):
        assert _rel(o, truth) <= 1.05 * _rel(k, truth), (_rel(o, truth), _rel(k, truth))
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        assert not lowp.upcasts_attention(x, leaves[0])  # inference: SDPA's forward is as fast in bf16 here
    assert not lowp.upcasts_attention(x, leaves[0])  # no autocast: nothing to stand in for


@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize(("features", "upcast"), [(frozenset(), True), (frozenset({"amx_bf16"}), False)])
def test_a_bf16_autocast_training_step_runs_no_bf16_product_where_the_cpu_has_no_bf16_units(
    monkeypatch: pytest.MonkeyPatch, kernels: str, features: frozenset, upcast: bool
) -> None:
    """Forward (both heads, the fused loss) and backward under bf16 autocast: on a CPU without bf16 units every
    matrix product of the blocks and the head, and SDPA's forward and backward, run in float32; with AMX they run in
    bf16, autocast's kernels. The same with the float32 products turned off."""
    monkeypatch.setattr(lowp, "cpu_features", lambda: features)
    cfg = TINY.with_dropout(0.0)
    model = GPT2(cfg).init_weights(0).train()
    model.set_kernels(kernels)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for on in (True, False):
        lowp.set_autocast_upcast(on)
        try:
            with LowPrecisionProducts() as seen:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(ids, labels=ids).loss
                loss.backward()
        finally:
            lowp.set_autocast_upcast(True)
        assert torch.isfinite(loss)
        assert (seen.count == 0) is (upcast and on), seen.count
        assert seen.attention == (0 if upcast and on else 2 * cfg.n_layer), seen.attention  # forward and backward


def test_no_float32_products_under_compile_or_off_the_cpu(no_bf16_units) -> None:  # noqa: ANN001
    x = torch.randn(32, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lowp.autocast_upcast(x) == torch.bfloat16
        assert lowp.autocast_upcast(x[: lowp.UPCAST_MIN_ROWS - 1]) is None  # a decoding row keeps the kernel
    assert lowp.autocast_upcast(x) is None  # no autocast: nothing to stand in for
    x_meta = torch.randn(32, 8, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lowp.autocast_upcast(x_meta) is None
        f = torch.compile(lambda t: torch.tensor(lowp.autocast_upcast(t) is None), backend="eager", fullgraph=True)
        assert bool(f(x))
