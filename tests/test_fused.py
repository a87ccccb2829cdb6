"""The fast training kernels (model/fused.py): the same loss and gradients as the reference arithmetic to rounding,
used only when asked and only when training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import LowPrecisionProducts

from gpt2_port.errors import UsageError
from gpt2_port.model import from_pretrained, fused, lowp
from gpt2_port.model.loss import IGNORE_INDEX, cross_entropy, shift_labels

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

# float32 CPU, these shapes: loss rel worst seen 1.2e-7, gradients norm-rel worst seen 3.1e-7 (summation order only)
LOSS_REL = 1e-6
GRAD_NORM_REL = 1e-5
# bf16 autocast, the gradients made by the public path under torch.compile against eager's private kernels, both
# rounded to bf16 (one rounding flipped would be about 2e-4 at these shapes): worst seen 0 on this CPU
LOWP_GRAD_NORM_REL = 1e-3


def _norm_rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


def _case(seed: int, N: int, C: int, V: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g)
    w = torch.randn(V, C, generator=g) * 0.5
    b = torch.randn(V, generator=g) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[::4] = IGNORE_INDEX
    return h, w, b, t


def _grads(fn, h, w, b, t, num_items=None):
    leaves = [x.clone().requires_grad_(True) if x is not None else None for x in (h, w, b)]
    loss = fn(*leaves, t, num_items)
    loss.backward()
    return loss.detach(), [x.grad if x is not None else None for x in leaves]


def _reference(h, w, b, t, num_items):
    return cross_entropy(F.linear(h, w, b), t, num_items=num_items)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_items", [None, 7])
def test_linear_cross_entropy_equals_the_head_then_the_loss(monkeypatch, bias: bool, num_items) -> None:
    monkeypatch.setattr(fused, "CHUNK_ROWS", 5)  # 23 rows: several chunks and a partial last one
    h, w, b, t = _case(0, 23, 16, 97, bias)
    want, want_g = _grads(_reference, h, w, b, t, num_items)
    got, got_g = _grads(fused.linear_cross_entropy, h, w, b, t, num_items)
    assert abs(float(got - want)) <= LOSS_REL * abs(float(want))
    for x, y in zip(got_g, want_g):
        if y is None:
            assert x is None
        else:
            assert _norm_rel(x, y) <= GRAD_NORM_REL


@pytest.mark.parametrize("num_items", [None, 7])
def test_the_logits_gradient_is_the_references_bit_for_bit_in_any_chunks(num_items) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(23, 97, generator=g) * 4
    t = torch.randint(0, 97, (23,), generator=g)
    t[::4] = IGNORE_INDEX
    leaf = logits.clone().requires_grad_(True)
    want = cross_entropy(leaf, t, num_items=num_items)
    want.backward()  # the reference: log-softmax and nll_loss, autograd's backward from a gradient of 1
    keep = t != IGNORE_INDEX
    divisor = torch.tensor(float(keep.sum() if num_items is None else num_items))
    step = -(1.0 / divisor)
    zeros = torch.zeros(5, 97)
    nlls, grads = [], []
    for s in range(0, 23, 5):  # chunks of 5 rows, the last one partial
        n = len(t[s : s + 5])
        safe = torch.where(keep, t, 0)[s : s + 5]
        nll, grad = fused.nll_and_logit_grad(
            logits[s : s + 5].clone(), safe, keep[s : s + 5], step, torch.float32, zeros[:n]
        )
        nlls.append(nll)
        grads.append(grad)
    assert torch.equal(torch.cat(grads), leaf.grad)
    assert torch.count_nonzero(zeros) == 0  # the incoming-gradient buffer is left zeroed for the next chunk
    want = want.detach()
    assert abs(float(sum(nlls) / divisor - want)) <= LOSS_REL * abs(float(want))


def test_one_chunk_gives_the_references_gradients_bit_for_bit(monkeypatch) -> None:
    monkeypatch.setattr(fused, "CHUNK_ROWS", 64)  # all 23 rows at once: the reference's matmuls, unsplit
    h, w, b, t = _case(5, 23, 16, 97, True)
    _, want_g = _grads(_reference, h, w, b, t)
    _, got_g = _grads(fused.linear_cross_entropy, h, w, b, t)
    for x, y in zip(got_g, want_g):
        assert torch.equal(x, y)


def test_linear_cross_entropy_scales_by_the_incoming_gradient() -> None:
    h, w, b, t = _case(1, 9, 8, 31, False)
    _, g1 = _grads(lambda *a: fused.linear_cross_entropy(*a), h, w, b, t)
    _, g3 = _grads(lambda *a: 3.0 * fused.linear_cross_entropy(*a), h, w, b, t)
    assert torch.allclose(g3[0], 3 * g1[0]) and torch.allclose(g3[1], 3 * g1[1])


def test_chunk_rows_per_device_and_the_chunk_argument(monkeypatch) -> None:
    """The CPU's chunks are CHUNK_ROWS; a GPU's take as many rows as GPU_CHUNK_BYTES of float32 logits hold (a
    multiple of CHUNK_ROWS, never fewer). The `chunk` argument runs the same arithmetic as that many CHUNK_ROWS."""
    assert fused.chunk_rows("cpu", 50304) == fused.CHUNK_ROWS
    for V in (97, 50304, 1 << 22):
        r = fused.chunk_rows("cuda", V)
        assert r % fused.CHUNK_ROWS == 0 and r >= fused.CHUNK_ROWS
        assert r == fused.CHUNK_ROWS or r * V * 4 <= fused.GPU_CHUNK_BYTES < (r + fused.CHUNK_ROWS) * V * 4
    h, w, b, t = _case(4, 23, 16, 97, True)
    got, got_g = _grads(lambda *a: fused.linear_cross_entropy(*a, chunk=5), h, w, b, t, 7)
    monkeypatch.setattr(fused, "CHUNK_ROWS", 5)
    want, want_g = _grads(fused.linear_cross_entropy, h, w, b, t, 7)
    assert torch.equal(got, want) and all(torch.equal(x, y) for x, y in zip(got_g, want_g))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(UsageError, match="chunk must be a positive integer"):
            fused.linear_cross_entropy(h, w, b, t, chunk=bad)  # type: ignore[arg-type]


def test_all_targets_ignored_gives_nan_like_the_reference() -> None:
    h, w, b, t = _case(2, 6, 8, 31, False)
    t[:] = IGNORE_INDEX
    assert torch.isnan(fused.linear_cross_entropy(h, w, b, t)) and torch.isnan(_reference(h, w, b, t, None))


def _ours(path: Path, kernels: str):
    m, _ = from_pretrained(path)
    m.set_attn_impl("sdpa")
    return m.set_kernels(kernels).set_dropout(0.0).train().requires_grad_(True)


@pytest.mark.parametrize("which", ["tiny_official", "tiny_hf_untied"])
def test_fast_kernels_train_like_the_reference(which: str, request, monkeypatch) -> None:
    import gpt2_port.model.modules as model_mod

    calls = []
    monkeypatch.setattr(model_mod, "gelu_tanh", lambda x: calls.append(1) or fused.gelu_tanh(x))
    path = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX
    ref, fast = _ours(path, "reference"), _ours(path, "fast")
    a, b = ref(ids, labels=labels), fast(ids, labels=labels)
    assert b.logits is None  # the head was fused with the loss: no (B, T, V) logits were made
    assert len(calls) == fast.config.n_layer  # every block's MLP ran the one-kernel GELU (the reference model none)
    assert abs(float(b.loss.detach() - a.loss.detach())) <= LOSS_REL * abs(float(a.loss.detach()))
    a.loss.backward()
    b.loss.backward()
    fp = dict(fast.named_parameters())
    # k_proj.bias's gradient is 0 in exact arithmetic (softmax ignores a shift shared by every key): its rounding
    # residue (~1e-11 here) is compared against the whole gradient's scale, every other one norm-relative.
    scale = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()
    for n, p in ref.named_parameters():
        assert fp[n].grad is not None, n
        assert (fp[n].grad - p.grad).norm() <= GRAD_NORM_REL * p.grad.norm() + 1e-7 * scale, n
    # targets (already aligned) are the same loss as labels (shifted inside)
    c = fast(ids, targets=shift_labels(labels))
    assert float(c.loss.detach()) == float(b.loss.detach())


def test_fast_kernels_leave_inference_and_recorded_logits_alone(tiny_official: Path) -> None:
    ids = torch.tensor([[464, 2444, 4721, 511, 3835]])
    ref, fast = _ours(tiny_official, "reference"), _ours(tiny_official, "fast")
    with torch.no_grad():
        assert torch.equal(ref.eval()(ids), fast.eval()(ids))  # eval, no grad: the reference arithmetic, bit for bit
    with torch.no_grad():  # a validation loss: the fused loss without gradients, no logits made
        a, b = ref(ids, labels=ids), fast(ids, labels=ids)
    assert b.logits is None and abs(float(b.loss - a.loss)) <= LOSS_REL * abs(float(a.loss.detach()))
    fast.train()
    with fast.record(["logits"]) as acts:
        out = fast(ids, labels=ids)
    assert out.logits is not None and "logits" in acts  # asked for the logits: the unfused head
    with pytest.raises(UsageError, match="kernels must be"):
        fast.set_kernels("turbo")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="not both"):
        fast(ids, labels=ids, targets=ids)


def test_a_second_backward_through_the_fused_loss_is_refused() -> None:
    h, w, b, t = _case(3, 6, 8, 31, False)
    h.requires_grad_(True)
    loss = fused.linear_cross_entropy(h, w, b, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_the_private_log_softmax_ops_are_used_on_tested_torch_versions_only(monkeypatch) -> None:
    tested = fused.minor_version(torch.__version__) in fused.PRIVATE_OPS_TESTED  # CI's two (tests/test_versions.py)
    assert fused.private_ops_usable() == tested and fused.USE_PRIVATE_OPS == tested
    assert fused.minor_version("2.11.0+cu128") == (2, 11) and fused.minor_version("2.13.0") == (2, 13)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert not fused.private_ops_usable()  # an untested release: the public fallback
    monkeypatch.setattr(torch, "__version__", "{}.{}.0".format(*min(fused.PRIVATE_OPS_TESTED)))
    monkeypatch.delattr(torch, "_log_softmax_backward_data")
    assert not fused.private_ops_usable()  # a release without the op


@pytest.mark.parametrize("num_items", [None, 7])
def test_the_public_fallback_gives_the_references_loss_and_gradients_to_rounding(monkeypatch, num_items) -> None:
    monkeypatch.setattr(fused, "USE_PRIVATE_OPS", False)
    monkeypatch.setattr(fused, "CHUNK_ROWS", 5)
    h, w, b, t = _case(2, 23, 16, 97, True)
    want, want_g = _grads(_reference, h, w, b, t, num_items)
    got, got_g = _grads(fused.linear_cross_entropy, h, w, b, t, num_items)
    assert abs(float(got - want)) <= LOSS_REL * abs(float(want))
    for x, y in zip(got_g, want_g):
        assert _norm_rel(x, y) <= GRAD_NORM_REL
    # and it is a different computation of the same thing: not the private kernel's bits
    monkeypatch.setattr(fused, "USE_PRIVATE_OPS", True)
    _, private_g = _grads(fused.linear_cross_entropy, h, w, b, t, num_items)
    assert any(not torch.equal(x, y) for x, y in zip(got_g, private_g))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_without_its_dense_incoming_buffer_is_the_kernels_formula_bit_for_bit(grad_dtype) -> None:
    """The public path makes the logits' gradient without the (n, V) buffer of nll_loss's incoming gradient: the
    log-softmax backward's formula, g - exp(lp) * sum(g) over the row, with that buffer written out, gives the same
    bits, rounded once to the gradient's dtype."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(23, 97, generator=g) * 4
    t = torch.randint(0, 97, (23,), generator=g)
    t[::4] = IGNORE_INDEX
    keep, safe = t != IGNORE_INDEX, torch.where(t != IGNORE_INDEX, t, 0)
    step = -(1.0 / keep.sum().to(torch.float32))
    nll, got = fused.nll_and_logit_grad(logits.clone(), safe, keep, step, grad_dtype, None)
    lp = torch.log_softmax(logits, 1)
    dense = torch.zeros(23, 97)
    dense[torch.arange(23), safe] = torch.where(keep, step, 0.0)  # (n, V) the incoming gradient
    want = (dense - lp.exp() * dense.sum(1, keepdim=True)).to(grad_dtype)
    assert got.dtype == grad_dtype and torch.equal(got, want)
    assert torch.equal(nll, -(lp[torch.arange(23), safe] * keep).sum())


def test_the_compiled_loss_makes_its_gradient_without_a_dense_incoming_buffer(monkeypatch) -> None:  # noqa: ANN001
    """Under torch.compile the fused loss runs the public path: the traced forward holds no log-softmax backward
    kernel and no (n, V) buffer of the incoming gradient, which the compiler would write and read in full each chunk;
    the loss and gradients stay eager's to rounding (eager on autocast's own kernels, as the traced graph runs them,
    not a CPU's float32 products)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep_graph(gm, _inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return make_boxed_func(gm)

    monkeypatch.setattr(lowp, "_autocast_upcast", [False])
    torch._dynamo.reset()
    h, w, b, t = _case(3, 23, 16, 97, False)
    f = torch.compile(
        lambda *a: fused.linear_cross_entropy(*a, chunk=8), backend=aot_autograd(fw_compiler=keep_graph), fullgraph=True
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_g = _grads(f, h, w, b, t)
        want, want_g = _grads(lambda *a: fused.linear_cross_entropy(*a, chunk=8), h, w, b, t)
    torch._dynamo.reset()
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert graphs and not any("_log_softmax_backward_data" in x for x in targets)
    dense = [
        n
        for g in graphs
        for n in g.graph.nodes
        if n.op == "call_function"
        and "index_put" in str(n.target)
        and n.meta["val"].dtype == torch.float32
        and n.meta["val"].shape[-1] == 97
    ]
    assert not dense  # no scatter into an (n, V) float32 tensor: only the bf16 gradient's targets are written
    assert abs(float(got - want)) <= LOSS_REL * abs(float(want))
    for x, y in zip(got_g[:2], want_g[:2]):
        assert _norm_rel(x, y) <= LOWP_GRAD_NORM_REL


@pytest.mark.parametrize("multiple", [8, 64])  # 97 -> 104 and 128 rows: a pad of 7 and of 31
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("private", [True, False])
def test_a_padded_head_gives_the_loss_and_gradients_of_the_real_rows(monkeypatch, multiple, bias, private) -> None:
    monkeypatch.setattr(fused, "USE_PRIVATE_OPS", private)
    monkeypatch.setattr(fused, "CHUNK_ROWS", 5)
    h, w, b, t = _case(6, 23, 16, 97, bias)
    want, want_g = _grads(_reference, h, w, b, t, 7)
    got, got_g = _grads(lambda *a: fused.linear_cross_entropy(*a, pad_multiple=multiple), h, w, b, t, 7)
    assert abs(float(got - want)) <= LOSS_REL * abs(float(want))
    for x, y in zip(got_g, want_g):
        if y is None:
            assert x is None
        else:
            assert x.shape == y.shape  # the weight's own rows: the pad never reaches a parameter
            assert _norm_rel(x, y) <= GRAD_NORM_REL


def test_the_pad_takes_no_probability(monkeypatch) -> None:
    """Without the -inf the pad's logits are 0 and take exp(0) of every row's softmax: the loss changes."""
    h, w, b, t = _case(7, 23, 16, 97, False)
    want = _reference(h, w, b, t, None)
    assert abs(float(fused.linear_cross_entropy(h, w, b, t, pad_multiple=64) - want)) <= LOSS_REL * float(want)
    unpadded_logits = F.linear(h, F.pad(w, (0, 0, 0, 128 - 97)))  # what the pad alone would give
    assert abs(float(cross_entropy(unpadded_logits, t) - want)) > 1e-3 * float(want)


def test_padding_under_bf16_autocast_keeps_the_real_rows() -> None:
    h, w, b, t = _case(8, 23, 16, 97, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_g = _grads(fused.linear_cross_entropy, h, w, b, t)
        got, got_g = _grads(lambda *a: fused.linear_cross_entropy(*a, pad_multiple=64), h, w, b, t)
    assert got.dtype == torch.float32 and abs(float(got - want)) <= LOSS_REL * abs(float(want))
    for x, y in zip(got_g[:2], want_g[:2]):
        assert x.shape == y.shape and x.dtype == torch.float32
        assert _norm_rel(x, y) <= GRAD_NORM_REL  # the same bf16 products: only the softmax's row length differs


@pytest.mark.parametrize("bias", [False, True])
def test_under_bf16_autocast_without_bf16_units_the_float32_products_are_as_close_as_the_kernels(
    monkeypatch: pytest.MonkeyPatch, bias: bool
) -> None:
    """A CPU without bf16 units (lowp.autocast_upcast): the fused head's logits and its two gradient products are
    float32 products of the bf16 operands, rounded to bf16 as autocast's kernels round theirs. Loss and gradients
    lie no further from float64 truth (over the same bf16 operands) than autocast's kernels do, and (by the bias
    case) the bias's products run the same way."""
    monkeypatch.setattr(fused, "CHUNK_ROWS", 16)  # 40 rows: chunks of 16, each above lowp's threshold
    monkeypatch.setattr(lowp, "cpu_features", lambda: frozenset())
    h, w, b, t = _case(9, 40, 32, 97, bias)

    def run(upcast: bool):  # noqa: ANN202
        lowp.set_autocast_upcast(upcast)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return _grads(fused.linear_cross_entropy, h, w, b, t)
        finally:
            lowp.set_autocast_upcast(True)

    hb, wb = h.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()
    bb = None if b is None else b.to(torch.bfloat16).double()
    truth, truth_g = _grads(lambda *a: cross_entropy(F.linear(*a[:3]), a[3]), hb, wb, bb, t)
    with LowPrecisionProducts() as seen:
        ours = run(True)
    assert seen.count == 0  # every product in float32
    kernel = run(False)
    hc, wc, bc = hb.float(), wb.float(), None if bb is None else bb.float()
    rounded = cross_entropy(F.linear(hc, wc, bc).to(torch.bfloat16).float(), t)  # the logits rounded as bf16 GEMM's
    assert abs(float(ours[0] - rounded)) <= LOSS_REL * float(rounded)  # seen 2.1e-7 (unrounded logits: 1.3e-4 off)
    assert _norm_rel(ours[0].double(), truth) <= 1.5 * _norm_rel(kernel[0].double(), truth) + 1e-7
    for got, theirs, want in zip(ours[1], kernel[1], truth_g, strict=True):
        if want is not None:
            assert got.dtype == torch.float32
            assert _norm_rel(got.double(), want) <= 1.5 * _norm_rel(theirs.double(), want), (got, theirs)


# fp16 autocast, 2048 x 8192 logits, gradients against float32's: the reference's norm-rel error worst seen 4.3e-4, the
# fused loss's 3.8e-4 (4.6e-3 when its gradient products ran in fp16 and its logits' gradient underflowed)
FP16_VS_REFERENCE = 2.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp16_autocast_gradients_survive_a_grad_scaler(device: str) -> None:
    """Under fp16 a GradScaler multiplies the loss's incoming gradient (2**16) in backward, and the reference casts
    the logits' gradient to fp16 only after that; the fused loss made its gradient in forward, unscaled, where its
    entries (about 1/(N x V)) fall below fp16's subnormals. Its gradients must be as close to float32's as the
    reference's are."""
    h, w, b, t = _case(9, 2048, 16, 8192, False)  # the logits' gradient's entries about 6e-8
    h, w, t = h.to(device), w.to(device), t.to(device)
    exact = _grads(_reference, h, w, b, t)[1]
    scale = 2.0**16
    with torch.autocast(device, dtype=torch.float16):
        ref = _grads(lambda *a: _reference(*a) * scale, h, w, b, t)[1]
        got = _grads(lambda *a: fused.linear_cross_entropy(*a) * scale, h, w, b, t)[1]
    for x, y, e in zip(got[:2], ref[:2], exact[:2]):
        assert x.dtype == torch.float32
        assert _norm_rel(x / scale, e) <= FP16_VS_REFERENCE * _norm_rel(y / scale, e)


def test_the_sparse_wte_gradient_is_taken_on_the_cpu_only(tiny_official: Path) -> None:
    """The fast kernels' sparse wte gradient on the CPU; on a GPU it would be summed by an index_add with atomics
    (not the same bits twice), so there the dense embedding backward runs. 'meta' stands in for the GPU."""
    fast = _ours(tiny_official, "fast")
    ids = torch.tensor([[464, 2444, 464, 4721]])
    assert fast._embed_tokens(ids).grad_fn._saved_sparse is True
    fast.to("meta")
    assert fast._embed_tokens(ids.to("meta")).grad_fn._saved_sparse is False
    assert _ours(tiny_official, "reference")._embed_tokens(ids).grad_fn._saved_sparse is False


def test_the_model_pads_the_fused_head_only(tiny_official: Path) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50257, (2, 16), generator=g)
    ref, fast = _ours(tiny_official, "reference"), _ours(tiny_official, "fast").set_head_padding(128)
    a, b = ref(ids, labels=ids), fast(ids, labels=ids)
    assert b.logits is None and abs(float(b.loss.detach() - a.loss.detach())) <= LOSS_REL * abs(float(a.loss.detach()))
    a.loss.backward()
    b.loss.backward()
    assert fast.wte.weight.grad.shape == (50257, fast.config.n_embd)
    assert _norm_rel(fast.wte.weight.grad.to_dense(), ref.wte.weight.grad) <= GRAD_NORM_REL
    assert fast.state_dict()["wte.weight"].shape[0] == 50257  # what save_pretrained writes
    with torch.no_grad():
        assert fast(ids, labels=ids).loss.shape == ()  # a validation loss runs padded too
        assert fast.eval()(ids).shape[-1] == 50257  # logits keep the vocabulary's own columns
    for bad in (0, -64, 1.5, True, "64"):
        with pytest.raises(UsageError, match="head padding must be a positive integer"):
            fast.set_head_padding(bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="pad_multiple must be a positive integer"):
        fused.linear_cross_entropy(*_case(9, 4, 8, 31, False), pad_multiple=0)
