"""Decoding's hand-written GPU kernels, run here on the CPU through triton's interpreter (the same programs, executed by
numpy), alone and inside a whole generation: the residual add with the layer norm after it (model/add_norm.py; torch's
two ops everywhere but CUDA), the matmuls with the add and norm before them and the projections' partial sums
(model/norm_linear.py), the cache write with the attention (model/decode_attention.py; the cache write and SDPA
elsewhere), a plain greedy token's argmax with its finite check (generate/greedy_pick.py) and the chosen tokens taken
into the sequence (generate/accept.py); what happens when one
fails or disagrees with torch's ops (gpt2_port/gpu_kernel.py). The kernels on a GPU: tests/test_cuda.py."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, attention_inputs, chaotic_model, chaotic_weights, norm_ulps, summed_in_order

from gpt2_port.model import add_norm as add_norm_mod

pytest.importorskip("triton", reason="NOT RUN: triton is not installed (pyproject's dev extra brings it)")
from gpt2_port.generate import accept, greedy_pick  # noqa: E402
from gpt2_port.model import add_norm_triton, decode_attention, norm_linear  # noqa: E402

KERNELS = (add_norm_mod.KERNEL, decode_attention.KERNEL, greedy_pick.KERNEL, accept.KERNEL, *norm_linear.KERNELS)

# conftest.py sets TRITON_INTERPRET=1 where there is no GPU, before triton is imported: the kernel is then interpreted
# on the CPU. On a GPU machine it compiles for the GPU instead (CPU tensors can't go there): tests/test_cuda.py runs it.
interpreted_here = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="NOT RUN: triton compiles for the GPU in this process (CUDA is present); tests/test_cuda.py runs the kernel",
)

# The kernel's layer norm against torch's, both from the same rounded sum, in ulps of the dtype at the size of the
# value's larger term (|w * normed| or |b|): its mean and variance are summed in another order. ULPS: how much farther
# from float64's than torch's it may be; from torch's, twice that (each is apart from float64's). Worst seen (widths
# 64, 768, 1600; the embeddings' sum): float32 8.5 ulps from torch's (3.2 from float64's, torch's 5.3), and 6 under
# the floors' configuration, where torch's layer norm is its unvectorised kernel (3.7 from float64's, torch's 2.2 ..
# 3.6); fp16 within 0.01 (1.0 from float64's, as torch's); bf16 2 (2.0 from float64's, torch's 1.0): triton's
# interpreter converts float32 to bf16 by dropping the low bits, an error of up to 1 ulp where rounding to nearest
# makes 0.5 (a GPU rounds: tests/test_cuda.py holds it to 1 from float64's beyond torch's).
ULPS = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernels run on the CPU (triton's interpreter runs them) wherever the step asks for them and their operands'
    rules hold: the device's rule (CUDA) is lifted; none fails meanwhile (a failure would leave torch's ops, and a
    comparison with them would pass for nothing)."""
    for kernel in KERNELS:
        monkeypatch.setattr(kernel, "may_run", lambda t: True)
        monkeypatch.setattr(kernel, "broken", None)
        monkeypatch.setattr(kernel, "checked", set())  # each call shape's first result checked again
    yield
    for kernel in KERNELS:
        assert kernel.broken is None, (kernel.what, kernel.broken)


@pytest.fixture
def combines(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The grids the split attention's combine kernel is launched with, in order (decode_attention_triton)."""
    from gpt2_port.model import decode_attention_triton as da

    grids: list[tuple] = []
    real = da.combine_kernel

    class Counted:
        def __getitem__(self, grid: tuple):  # noqa: ANN204
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(da, "combine_kernel", Counted())
    return grids


def _inputs(dtype: torch.dtype, rows: int, width: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 1, width, generator=g) * 4).to(dtype)  # a residual stream's scale
    d = torch.randn(rows, 1, width, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(width, generator=g)).to(dtype)
    b = (0.5 * torch.randn(width, generator=g)).to(dtype)
    return x, d, w, b


@interpreted_here
@pytest.mark.exactness
@pytest.mark.parametrize("width", [64, 768, 1600])  # 1600: gpt2-xl's, not a power of two (a masked tail)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "fp16", "bf16"])
def test_the_kernel_adds_as_torch_adds_and_norms_within_an_ulp_of_torchs_layer_norm(
    interpreted: None, dtype: torch.dtype, width: int
) -> None:
    """The kernel's residual sum is torch's `x + d` bit for bit (float32 and fp16; bf16 within one ulp, and only
    there: triton's interpreter converts float32 to bf16 by dropping the low bits, where a GPU rounds to nearest even
    as torch does, which tests/test_cuda.py checks bit for bit); its layer norm of that sum is as far from float64's as
    torch's `F.layer_norm` at most `ULPS` more, and within twice that of torch's. Three rows, each normalised on its
    own."""
    x, d, w, b = _inputs(dtype, 3, width)
    s, y = add_norm_mod.add_norm(x, d, (w, b), 1e-5, kernel=True)
    want_s = x + d
    if dtype == torch.bfloat16:
        up = torch.nextafter(want_s, want_s.sign() * float("inf"))  # the next bf16 from 0 outward
        assert ((s == want_s) | (s == torch.nextafter(want_s, want_s.sign() * 0.0)) | (s == up)).all()
        s = want_s  # the norm below from torch's sum; the kernel's own differs by the interpreter's truncation
        _, y = add_norm_triton.launch(x - x, want_s, w, b, 1e-5)  # 0 + s is s exactly: the norm of torch's sum
    else:
        assert torch.equal(s, want_s)
    off, ours, theirs = norm_ulps(y, want_s, w, b, 1e-5)
    assert off <= 2 * ULPS[dtype] and ours <= theirs + ULPS[dtype], (off, ours, theirs)
    assert y.shape == s.shape == x.shape and y.dtype == s.dtype == dtype


@interpreted_here
@pytest.mark.exactness
def test_each_row_is_normalised_on_its_own_and_eps_is_the_one_given(interpreted: None) -> None:
    """A row of equal values normalises to the bias alone (its variance 0, so eps alone keeps it finite); a row
    scaled by 1000 normalises as its unscaled copy does, to float32's rounding; a large eps shrinks the output by the
    factor torch's gives."""
    w, b = torch.ones(768), torch.linspace(-1, 1, 768)
    x = torch.randn(3, 1, 768, generator=torch.Generator().manual_seed(1))
    x[0] = 2.5
    x[2] = x[1] * 1000
    _, y = add_norm_mod.add_norm(x, torch.zeros_like(x), (w, b), 1e-5, kernel=True)
    assert torch.equal(y[0, 0], b) and torch.allclose(y[2], y[1], atol=1e-5)
    for eps in (1e-5, 10.0):
        _, y = add_norm_mod.add_norm(x[1:2], torch.zeros_like(x[1:2]), (w, b), eps, kernel=True)
        torch.testing.assert_close(y, F.layer_norm(x[1:2], (768,), w, b, eps), rtol=1e-6, atol=1e-6)


@interpreted_here
@pytest.mark.exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "fp16", "bf16"])
def test_the_embeddings_looked_up_in_the_kernel_are_torchs(interpreted: None, dtype: torch.dtype) -> None:
    """embed_norm's kernel reads each row's token and position embeddings itself: the sum is F.embedding's of each,
    added (bit for bit in float32 and fp16; bf16 within an ulp, the interpreter truncating), and its norm as the
    add-and-norm test holds it (`ULPS`), for rows of other tokens and positions (768 wide, GPT-2's)."""
    from gpt2_port.model.add_norm import embed_norm, gathers

    g = torch.Generator().manual_seed(2)
    wte, wpe = (torch.randn(97, 768, generator=g) * 2).to(dtype), torch.randn(40, 768, generator=g).to(dtype)
    _, _, w, b = _inputs(dtype, 1, 768)
    ids, pos = torch.tensor([[96], [3], [3]]), torch.tensor([[0], [39], [7]])
    assert gathers(ids, pos, wte, wpe, (w, b)) and not gathers(ids, pos[:1], wte, wpe, (w, b))
    s, y = embed_norm(ids, pos, wte, wpe, (w, b), 1e-5, kernel=True)
    want_s = F.embedding(ids, wte) + F.embedding(pos, wpe)  # (3, 1, 768)
    assert s.shape == y.shape == want_s.shape
    if dtype == torch.bfloat16:
        assert ((s == want_s) | (s == torch.nextafter(want_s, want_s.sign() * 0.0))).all()
    else:
        assert torch.equal(s, want_s)
        off, ours, theirs = norm_ulps(y, want_s, w, b, 1e-5)
        assert off <= 2 * ULPS[dtype] and ours <= theirs + ULPS[dtype], (off, ours, theirs)


def test_the_cpu_runs_torchs_add_and_layer_norm_whatever_is_asked() -> None:
    """No kernel on the CPU (in_kernel never holds there): add_norm is torch's add and layer norm, bit for bit, with or
    without `kernel`, broadcasting as torch's add does (the plan's (1, 1, C) position embedding beside (B, 1, C))."""
    x, d, w, b = _inputs(torch.float32, 2, 64)
    for dd in (d, d[:1]):
        assert not add_norm_mod.in_kernel(x, dd, (w, b))
        for kernel in (False, True):
            s, y = add_norm_mod.add_norm(x, dd, (w, b), 1e-5, kernel=kernel)
            assert torch.equal(s, x + dd) and torch.equal(y, F.layer_norm(x + dd, (64,), w, b, 1e-5))


@pytest.mark.parametrize("wrong", ["no import", "raises", "off by far", "nan"])
def test_a_kernel_that_fails_or_disagrees_once_leaves_torchs_ops_from_then_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, wrong: str
) -> None:
    """A kernel that cannot be imported (a triton that fails its own import), compile or launch (a triton too old or
    too new, a GPU it has no code for), or one compiled
    wrong for the GPU it runs on (which tests on other GPUs would not show: its first result for a call's shapes is
    compared with torch's ops' on the same inputs, and disagrees: a norm off by far, or not finite) is logged once,
    naming what happened, and torch's ops give the result, then and on every later call (never tried again)."""
    calls = []

    def launch(x: torch.Tensor, d: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> tuple:
        calls.append(1)
        if wrong == "raises":
            raise RuntimeError("PTX .version 9.9 does not support .target sm_200\nmore lines")
        s = x + d
        y = F.layer_norm(s, s.shape[-1:], w, b, eps)
        return s, y * 1.01 if wrong == "off by far" else y.masked_fill(y > 1, float("nan"))

    monkeypatch.setattr(add_norm_mod.KERNEL, "broken", None)
    monkeypatch.setattr(add_norm_mod.KERNEL, "checked", set())
    monkeypatch.setattr(add_norm_mod, "in_kernel", lambda x, d, norm: add_norm_mod.KERNEL.broken is None)
    monkeypatch.setattr(add_norm_triton, "launch", launch)
    if wrong == "no import":
        monkeypatch.setitem(sys.modules, add_norm_triton.__name__, None)  # `from .add_norm_triton import` raises
    x, d, w, b = _inputs(torch.float32, 2, 64)
    with caplog.at_level(logging.WARNING, logger="gpt2_port.gpu_kernel"):
        for _ in range(3):
            s, y = add_norm_mod.add_norm(x, d, (w, b), 1e-5, kernel=True)
            assert torch.equal(s, x + d) and torch.equal(y, F.layer_norm(x + d, (64,), w, b, 1e-5))
    assert len(calls) == (0 if wrong == "no import" else 1) and not add_norm_mod.KERNEL.checked
    (rec,) = caplog.records
    message = rec.getMessage()
    assert "torch's add and layer norm run instead" in message and "more lines" not in message
    if wrong == "no import":
        assert "ModuleNotFoundError: import of gpt2_port.model.add_norm_triton halted" in message, message
    elif wrong == "raises":
        assert "RuntimeError: PTX .version 9.9 does not support .target sm_200" in message
    else:
        assert "its first result differs from theirs" in message and "x eps" in message
        assert ("nan" in message) == (wrong == "nan"), message


def test_a_kernel_is_checked_once_for_each_shape_and_never_while_a_graph_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check runs torch's ops beside the kernel on its first call for a (dtype, shape), and only then: later calls
    of that shape run the kernel alone, another shape is checked once again; while a CUDA graph records (a capture
    after its warm-up runs, which made the check) nothing is checked, so the graph holds the kernel alone."""
    from gpt2_port import gpu_kernel

    torch_ops = []
    real = add_norm_mod.F.layer_norm

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        torch_ops.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(add_norm_mod.KERNEL, "broken", None)
    monkeypatch.setattr(add_norm_mod.KERNEL, "checked", set())
    monkeypatch.setattr(add_norm_mod, "in_kernel", lambda x, d, norm: True)
    monkeypatch.setattr(
        add_norm_triton, "launch", lambda x, d, w, b, eps: (x + d, real(x + d, (x.shape[-1],), w, b, eps))
    )
    monkeypatch.setattr(add_norm_mod.F, "layer_norm", counted)
    for rows, want in ((2, 1), (2, 1), (3, 2), (3, 2)):
        x, d, w, b = _inputs(torch.float32, rows, 64)
        add_norm_mod.add_norm(x, d, (w, b), 1e-5, kernel=True)
        assert len(torch_ops) == want, (rows, torch_ops)
    monkeypatch.setattr(gpu_kernel, "_capturing", lambda: True)
    x, d, w, b = _inputs(torch.float32, 4, 64)
    add_norm_mod.add_norm(x, d, (w, b), 1e-5, kernel=True)
    assert len(torch_ops) == 2 and ("cpu", torch.float32, x.shape) not in add_norm_mod.KERNEL.checked


def test_a_kernel_launches_with_its_tensors_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """triton launches on the current CUDA device: a kernel for tensors on cuda:1 runs inside torch.cuda.device(cuda:1)
    (a model on a second GPU), and its first-call check is kept per device (another GPU may compile it otherwise).
    torch.cuda.device is a stand-in here, recording what it was entered with; the tensor one that says it is on
    cuda:1."""
    from gpt2_port.gpu_kernel import GpuKernel

    entered, inside = [], []

    class Guard:
        def __init__(self, device: torch.device) -> None:
            self.device = device

        def __enter__(self) -> None:
            entered.append(self.device)

        def __exit__(self, *exc: object) -> None:
            entered.append(None)

    class OnCuda1:  # what GpuKernel.run reads of a tensor
        is_cuda, device = True, torch.device("cuda", 1)

    monkeypatch.setattr(torch.cuda, "device", Guard)
    kernel = GpuKernel("k", "torch's ops", lambda got, want: None)
    t = torch.ones(2)

    def launch() -> torch.Tensor:
        inside.append(entered[-1] if entered else "no guard")
        return t

    assert kernel.run(OnCuda1(), ("shape",), launch, lambda: t) is t
    assert inside == [torch.device("cuda", 1)] and entered[-1] is None
    assert kernel.run(t, ("shape",), launch, lambda: t) is t  # a CPU tensor (the interpreter's): no guard
    assert inside[-1] is None and kernel.checked == {("cuda:1", "shape"), ("cpu", "shape")}


def test_the_kernel_is_not_taken_for_what_it_does_not_handle() -> None:
    """in_kernel's conditions that hold apart from the device (a CPU tensor here, where it never holds): mixed dtypes
    (autocast's float32 residual beside a bf16 projection), float64, other shapes, non-contiguous rows."""
    x, d, w, b = _inputs(torch.bfloat16, 2, 64)
    assert not add_norm_mod.in_kernel(x, d, (w, b))  # the CPU
    cases = {
        "mixed": (x.float(), d, (w, b)),
        "float64": (x.double(), d.double(), (w.double(), b.double())),
        "shapes": (x, d[:1], (w, b)),
        "strided": (torch.cat([x, x], -1)[..., ::2], d, (w, b)),
    }
    for name, (xx, dd, norm) in cases.items():  # `takes`: the rules for the operands, whatever their device
        assert not add_norm_mod.takes(xx, dd, norm), name
    assert add_norm_mod.takes(x, d, (w, b))


@pytest.fixture(scope="module")
def official_chaotic(tiny_official) -> torch.nn.Module:  # noqa: ANN001
    """chaotic_model's weights (greedy text that keeps changing) in the official layout: c_attn one matmul, q, k and v
    views of it, so the step's c_attn is one norm_linear kernel."""
    from gpt2_port.model import from_pretrained
    from gpt2_port.model.c_attn import fused_qkv

    m = chaotic_weights(from_pretrained(tiny_official)[0], torch.Generator().manual_seed(3))
    a = m.h[0].attn
    assert fused_qkv(a.q_proj, a.k_proj, a.v_proj) is not None
    return m


MATMULS = {"addmm", "mm", "linear", "_addmm_activation", "bmm", "matmul"}


@interpreted_here
@pytest.mark.exactness
@pytest.mark.parametrize("which", ["official", "chaotic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_static_step_with_the_kernels_makes_the_forwards_tokens(
    interpreted: None, dtype: torch.dtype, which: str, request: pytest.FixtureRequest
) -> None:
    """The whole fused static step (generate's on CUDA), here interpreted on the CPU: each matmul one kernel with the
    residual add and the layer norm before it (the embeddings' lookups in the first, c_fc's GELU after it), each
    projection partial sums the next kernel adds, ln_f's add one more, each block's cache write and attention another:
    no embedding, add, layer norm, matmul, index_copy_ or SDPA op of torch's is left in the official layout (c_attn
    one matmul); with separate q, k and v (chaotic) those three stay torch's matmuls, after add_norm's kernel. Its
    ln_f output within a few ulps of the step with torch's ops, and 12 greedy tokens of a left-padded batch, each
    chosen by the greedy pick kernel, equal to the forward's. With `linear_kernel=False` (steps.LINEAR_KERNEL) the
    matmuls are torch's, after add_norm's kernel; with `attention_kernel=False` (steps.ATTENTION_KERNEL) the
    attention is the cache write and SDPA again. The tokens go into the sequences through accept.py's kernel."""
    from collections import Counter

    from conftest import OpNames

    from gpt2_port.generate import generate_full
    from gpt2_port.generate.cache import StaticKVCache
    from gpt2_port.model.decode import DecodePlan

    m = (request.getfixturevalue("official_chaotic") if which == "official" else chaotic_model(TINY, seed=3)).to(dtype)
    plan = DecodePlan.for_model(m)
    st = StaticKVCache(m.config, 2, 8, m.dtype, "cpu")
    n = m.config.n_layer
    with torch.no_grad():
        m(torch.tensor([[3], [5]]), cache=st, hidden_only=True)
        st.start(None, 1)
        st.feed(torch.tensor([4, 6]), 1)
        want = plan.static_step(st, fused_kernels=False)
        for attention, linear in ((True, True), (True, False), (False, True)):
            kernels = dict(fused_kernels=True, attention_kernel=attention, linear_kernel=linear)
            plan.static_step(st, **kernels)  # each kernel's first check
            with OpNames() as seen:
                got = plan.static_step(st, **kernels)
            o = Counter(seen.seen)
            assert "layer_norm" not in o and "native_layer_norm" not in o and o["add"] == 0, o
            assert "embedding" not in o and "index_select" not in o, o  # the embeddings' rows read by a kernel
            sdpa = any("scaled_dot_product" in name for name in o)
            assert (o["index_copy_"], sdpa) == ((0, False) if attention else (n, True)), o
            matmuls = sum(o[k] for k in MATMULS)
            qkv = 3 * n if which == "chaotic" else 0  # separate q, k and v: torch's three
            assert matmuls == (qkv if linear else qkv + 3 * n if which == "chaotic" else 4 * n), o
            tol = {torch.float32: 1e-4, torch.bfloat16: 0.1}[dtype]  # the GELU, the norms, the sums: other roundings
            assert (got.float() - want.float()).abs().max().item() < tol
    ids = torch.tensor([[0, 0, 464, 2444, 4721], [11, 7, 3, 2444, 9], [0, 0, 0, 0, 5]])  # left-padded rows
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    opts = dict(attention_mask=mask, eos_token_id=None)
    g = generate_full(m, ids, 12, static_cache=True, fused_kernels=True, fast_head=False, **opts)
    f = generate_full(m, ids, 12, fast_step=False, output_scores=True, **opts)
    assert g.extra["step"] == "static" and g.extra["fused_kernels"] and f.extra["step"] == "forward"
    assert greedy_pick.KERNEL.checked and norm_linear.PROJECT.checked  # the pick and the matmul kernels chose them
    assert accept.KERNEL.checked  # and the tokens were taken into the sequences by the kernel
    if dtype == torch.float32:
        assert torch.equal(g.sequences, f.sequences)
    else:  # bf16: each row's tokens up to its first step whose forward scores' top two are within 4 ulps (a tie)
        compared = 0
        for row in range(ids.shape[0]):
            for t, scores in enumerate(f.scores):  # type: ignore[arg-type]
                first, second = scores[row].topk(2).values.tolist()
                if first - second <= 4 * torch.finfo(dtype).eps * abs(first):
                    break
                assert g.sequences[row, 5 + t] == f.sequences[row, 5 + t], (row, t)
                compared += 1
        assert compared >= 6, compared


def _sdpa(q: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    keys, values = layer.unbind(0)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias[:, None, None, :], scale=scale)


# The kernel's attention against float64's, beside SDPA's (the CPU's) over the same written cache, in units of the
# dtype's epsilon times the output's largest value. Worst seen (head sizes 16 and 64): float32 ours 0.9, SDPA's 0.9;
# fp16 ours 0.5, SDPA's 0.5; bf16 ours 1.0 (the interpreter truncates its bf16 output), SDPA's 0.5.
ATTENTION_EPS = {torch.float32: 4.0, torch.float16: 1.0, torch.bfloat16: 1.5}


@interpreted_here
@pytest.mark.exactness
@pytest.mark.parametrize("hs", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "fp16", "bf16"])
def test_the_attention_kernel_writes_the_slot_and_attends_as_sdpa_does(
    interpreted: None, dtype: torch.dtype, hs: int
) -> None:
    """decode_attention.attend stores the token's key and value in their slot, bit for bit, and nothing else of the
    cache changes; its output (B, nh, 1, hs) is SDPA's over that cache with the mask, within `ATTENTION_EPS` of
    float64's (as SDPA's is), a block all masked included (no NaN). Its first call for these shapes (on a copy of the
    cache) is checked against the cache write and SDPA (gpu_kernel.py); after it the fallback is not called."""
    q, kv, layer, bias, slot = attention_inputs(dtype, hs)
    assert decode_attention.takes(q, kv, layer, bias)
    want_layer = layer.clone().index_copy_(3, slot, kv)
    scale = hs**-0.5
    first = layer.clone()

    def write_and_sdpa() -> torch.Tensor:
        first.index_copy_(3, slot, kv)
        return _sdpa(q, first, bias, scale)

    decode_attention.attend(q, kv, first, bias, slot, scale, write_and_sdpa)
    assert ("cpu", dtype, q.shape, layer.shape, True) in decode_attention.KERNEL.checked
    out = decode_attention.attend(q, kv, layer, bias, slot, scale, lambda: pytest.fail("the fallback ran"))
    assert torch.equal(layer, want_layer)
    assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    truth = _sdpa(q.double(), want_layer.double(), bias.double(), scale)
    unit = torch.finfo(dtype).eps * truth.abs().max().item()
    ours = (out.double() - truth).abs().max().item() / unit
    theirs = (_sdpa(q, want_layer, bias, scale).double() - truth).abs().max().item() / unit
    assert ours <= ATTENTION_EPS[dtype] and theirs <= ATTENTION_EPS[dtype], (ours, theirs)


@interpreted_here
@pytest.mark.exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_attention_kernel_reads_no_slot_after_the_tokens(interpreted: None, dtype: torch.dtype) -> None:
    """The slots after the token's are masked in a static cache and the kernel does not read them (its reads grow with
    the position, not the cache's length): NaN keys and values there, which any read would carry into the output
    (NaN times a zero weight is NaN), leave its output bit for bit what it is over a clean cache, a block wholly after
    the slot included. The contract it relies on: a StaticKVCache's mask holds -inf at every slot after the one fed,
    from the prompt's start through a generation's steps."""
    from gpt2_port.generate.cache import StaticKVCache

    q, kv, layer, bias, slot = attention_inputs(dtype, 64)  # 130 slots, the token at 120: slots 121.. masked
    scale = 0.125
    first = layer.clone()  # the first call for these shapes is checked against the cache write and SDPA

    def write_and_sdpa() -> torch.Tensor:
        return _sdpa(q, first.index_copy_(3, slot, kv), bias, scale)

    clean = decode_attention.attend(q, kv, first, bias, slot, scale, write_and_sdpa)
    dirty = layer.clone()
    dirty[..., int(slot) + 1 :, :] = float("nan")
    out = decode_attention.attend(q, kv, dirty, bias, slot, scale, lambda: pytest.fail("the fallback ran"))
    assert torch.isfinite(out).all() and torch.equal(out, clean)
    cache = StaticKVCache(TINY, 2, 16, dtype, "cpu")
    cache.start(torch.tensor([[0, 1, 1], [1, 1, 1]]), 3)
    for at in range(3, 16):
        cache.feed(torch.tensor([1, 2]), at)
        assert bool((cache.bias[:, at + 1 :] == float("-inf")).all()) and bool((cache.bias[:, at] == 0).all())


@interpreted_here
@pytest.mark.exactness
@pytest.mark.parametrize(
    "L, target, at", [(1024, 128, 1013), (1000, 36, 1000 - 10), (1024, 24, 300)], ids=["16-spans", "6-spans", "mid"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_a_long_cache_is_split_over_programs_and_combined_as_sdpa_attends(
    interpreted: None,
    dtype: torch.dtype,
    L: int,
    target: int,
    at: int,
    combines: list[tuple],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache of 8 blocks or more with few (row, head)s is attended in spans of whole blocks, a program each, and a
    second kernel combines them (flash-decoding): 16 spans of one block, 6 of three (the last one block, of a cache
    that ends inside it), 4 of four with the token's slot in the second (the spans after it read nothing). The token's
    key and value are written once, in their slot, nothing else of the cache changing; the output is SDPA's over that
    cache within `ATTENTION_EPS` of float64's, with a row left-padded past the first spans (spans wholly masked) and
    NaN in every slot after the token's (none read)."""
    from gpt2_port.model import decode_attention_triton as da

    monkeypatch.setattr(da, "TARGET_PROGRAMS", target)
    q, kv, layer, _, _ = attention_inputs(dtype, 64, L=L)
    B, nh = q.shape[:2]
    split, span = da.splits(B * nh, L)
    assert split == {128: 16, 36: 6, 24: 4}[target] and span == {16: 64, 6: 192, 4: 256}[split]
    slot = torch.tensor([at])
    bias = torch.full((B, L), float("-inf"))
    bias[0, at // 2 + 37 : at + 1] = 0.0  # row 0 left-padded over its first spans
    bias[1, : at + 1] = 0.0
    bias = bias.to(dtype)
    layer[..., at + 1 :, :] = float("nan")  # after the token's slot: never read
    want_layer = layer.clone().index_copy_(3, slot, kv)
    scale = 0.125
    first = layer.nan_to_num()  # the first call is checked against the cache write and SDPA (which reads NaN)
    decode_attention.attend(
        q, kv, first, bias, slot, scale, lambda: _sdpa(q, first.index_copy_(3, slot, kv), bias, scale)
    )
    out = decode_attention.attend(q, kv, layer, bias, slot, scale, lambda: pytest.fail("the fallback ran"))
    assert combines == [(B * nh,)] * 2  # each call combined its spans
    assert torch.equal(layer.nan_to_num(), want_layer.nan_to_num()) and layer[..., : at + 1, :].isfinite().all()
    clean = want_layer.nan_to_num()  # the truth over the same slots: the masked ones weigh 0
    truth = _sdpa(q.double(), clean.double(), bias.double(), scale)
    unit = torch.finfo(dtype).eps * truth.abs().max().item()
    ours = (out.double() - truth).abs().max().item() / unit
    theirs = (_sdpa(q, clean, bias, scale).double() - truth).abs().max().item() / unit
    # worst seen: float32 2.3 (SDPA's 6.9: its error grows with the keys, past ATTENTION_EPS), bf16 0.67 (SDPA's 0.36)
    assert torch.isfinite(out).all() and ours <= ATTENTION_EPS[dtype], (ours, theirs)
    # not split (steps.SPLIT_ATTENTION off): one program a head, no combine, within the same bound
    decode_attention.attend(q, kv, first.clone(), bias, slot, scale, lambda: _sdpa(q, first, bias, scale), False)
    whole = decode_attention.attend(q, kv, layer, bias, slot, scale, lambda: pytest.fail("the fallback ran"), False)
    assert len(combines) == 2 and (whole.double() - truth).abs().max().item() / unit <= ATTENTION_EPS[dtype]


@interpreted_here
@pytest.mark.exactness
def test_a_generation_over_a_split_cache_makes_the_forwards_tokens(
    combines: list[tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A static generation whose cache is split (here from 2 blocks: a 60-token left-padded prompt and 12 new tokens
    make 128 slots) attends through the split kernel and its combine every step (the attention kernel alone
    interpreted): the forward's 12 greedy tokens, float32."""
    from gpt2_port.generate import generate_full
    from gpt2_port.model import decode_attention_triton as da

    monkeypatch.setattr(da, "MIN_SPLIT_BLOCKS", 2)
    monkeypatch.setattr(decode_attention.KERNEL, "may_run", lambda t: True)
    monkeypatch.setattr(decode_attention.KERNEL, "broken", None)
    monkeypatch.setattr(decode_attention.KERNEL, "checked", set())
    m = chaotic_model(TINY, seed=3)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, TINY.vocab_size, (2, 60), generator=g)
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :9] = 0  # row 1 left-padded
    opts = dict(attention_mask=mask, eos_token_id=None)
    got = generate_full(m, ids, 12, static_cache=True, fused_kernels=True, **opts)
    want = generate_full(m, ids, 12, fast_step=False, **opts)
    assert got.extra["step"] == "static" and decode_attention.KERNEL.broken is None
    assert len(combines) >= 11 * TINY.n_layer  # every decode step's every layer combined its spans
    assert torch.equal(got.sequences, want.sequences)


def test_only_a_long_cache_with_few_rows_and_heads_is_split() -> None:
    """`splits`: one program a (row, head) under 8 blocks (the benchmark's 192-slot cache; a short generation's combine
    would cost more than it saves) or with about TARGET_PROGRAMS (row, head)s already; else spans of whole blocks up
    to about TARGET_PROGRAMS programs, every block in one span: 124M at batch 1 over 1,024 slots 8 spans of 2 blocks,
    gpt2-xl (25 heads) 4 of 4, 124M at batch 8 one."""
    from gpt2_port.model.decode_attention_triton import BLOCK, splits

    assert splits(12, 192) == (1, 192) and splits(12, 448) == (1, 448)
    assert splits(12, 1024) == (8, 128) and splits(25, 1024) == (4, 256) and splits(96, 1024) == (1, 1024)
    for rows_heads in range(1, 140):
        for L in range(64, 1025, 64):
            split, span = splits(rows_heads, L)
            assert span % BLOCK == 0 and (split - 1) * span < L <= split * span, (rows_heads, L)
            assert split == 1 or rows_heads * split <= 128


def test_the_attention_kernel_is_not_taken_for_what_it_does_not_handle() -> None:
    """decode_attention.in_kernel never holds on the CPU; `takes` (its operands' rules) refuses mixed dtypes
    (autocast's bf16 key and value beside a float32 cache), float64, a head size that is not a power of two, more
    than one query, a non-contiguous cache, and a mask of another length."""
    q, kv, layer, bias, slot = attention_inputs(torch.bfloat16, 16)
    assert decode_attention.takes(q, kv, layer, bias) and not decode_attention.in_kernel(q, kv, layer, bias)
    q48, kv48, layer48, bias48, _ = attention_inputs(torch.float32, 48)
    cases = {
        "mixed": (q, kv, layer.float(), bias.float()),
        "float64": (q.double(), kv.double(), layer.double(), bias.double()),
        "head size 48": (q48, kv48, layer48, bias48),
        "two queries": (q.expand(-1, -1, 2, -1), kv, layer, bias),
        "strided cache": (q, kv, layer.transpose(3, 4).contiguous().transpose(3, 4), bias),
        "mask length": (q, kv, layer, bias[:, :-1]),
    }
    for name, args in cases.items():
        assert not decode_attention.takes(*args), name


@interpreted_here
@pytest.mark.exactness
@pytest.mark.parametrize("V", [130, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "fp16", "bf16"])
def test_the_greedy_pick_is_torchs_argmax_and_finite_check(interpreted: None, dtype: torch.dtype, V: int) -> None:
    """greedy_pick.argmax_finite's kernel: each row's token is torch.argmax's (ties to the lower id: a row whose largest
    value stands twice, once in a later block; one where it stands three times, in one lane of two blocks and in a
    lower lane of the later one; a row whose largest is in the last, partial block) and the flag is 1
    while every logit is finite; a NaN, +Inf or -Inf anywhere in any row makes it 0. Rows with a stride of their own
    (a slice of wider logits, as a padded head's); one row alone too."""
    g = torch.Generator().manual_seed(0)
    wide = (torch.randn(3, V + 7, generator=g) * 3).to(dtype)
    logits = wide[:, :V]  # (3, V), row stride V + 7
    top = logits.max().item() + 1
    logits[0, 5] = logits[0, V - 3] = top  # a tie: the lower id wins
    logits[2, V - 1] = top  # in the last block
    if V > 2 * 4096:  # ties a block apart: in one lane (9 and 4105), and in a later block's lower lane (4098: lane 2)
        logits[1, 9] = logits[1, 4105] = logits[1, 4098] = top
    assert greedy_pick.takes(logits) and logits.stride(0) == V + 7
    ids, ok = greedy_pick.argmax_finite(logits)
    assert torch.equal(ids, torch.argmax(logits, dim=-1)) and ids.tolist()[0] == 5 and ids.tolist()[2] == V - 1
    assert V < 2 * 4096 or ids.tolist()[1] == 9
    assert ids.dtype == torch.long and int(ok) == 1
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = logits.clone()
        broken[1, V // 2] = bad
        ids, ok = greedy_pick.argmax_finite(broken)
        assert int(ok) == 0, bad
        assert ids[0] == 5 and ids[2] == V - 1  # the finite rows' tokens stand
        ids, ok = greedy_pick.argmax_finite(broken[:1])  # one row alone (batch-1 decoding: its flag stored)
        assert ids.tolist() == [5] and int(ok) == 1, bad
        assert int(greedy_pick.argmax_finite(broken[1:2])[1]) == 0, bad


def test_the_greedy_pick_is_not_taken_for_what_it_does_not_handle() -> None:
    """greedy_pick.in_kernel never holds on the CPU; `takes` refuses float64, rows without unit stride, and other than
    (B, V) logits."""
    logits = torch.randn(2, 64)
    assert greedy_pick.takes(logits) and not greedy_pick.in_kernel(logits)
    for name, bad in {"float64": logits.double(), "strided": logits.t().contiguous().t(), "3-D": logits[None]}.items():
        assert not greedy_pick.takes(bad), name


@interpreted_here
@pytest.mark.parametrize("B", [1, 3, 37])
@pytest.mark.parametrize("status_dtype", [torch.long, torch.bool], ids=["int64", "bool"])
@pytest.mark.parametrize("eos", [7, None], ids=["eos", "no-eos"])
def test_the_token_taking_kernel_is_torchs_where_ne_and_cat(
    interpreted: None, B: int, status_dtype: torch.dtype, eos: int | None
) -> None:
    """accept.take's kernel: each running row's choice (a strided view, as a sampled draw's may be) goes into its
    column of the sequence (a column of a (B, L) tensor: stride L), a finished row's padding instead; the rows that
    chose EOS end (and only those: a finished row's padding is EOS too, as generate's default padding is); the (B + 1,)
    values for the host are the column, then the status as an int64. Equal to torch's ops' bit for bit, the sequence's
    other columns untouched, the mask given left as it was."""
    g = torch.Generator().manual_seed(B)
    choice = torch.randint(0, 9, (B, 2), generator=g)[:, 1]  # (B,), stride 2
    choice[0] = 7  # row 0 chooses EOS
    running = torch.rand(B, generator=g) < 0.7
    running[0] = True
    seq = torch.randint(100, 200, (B, 6), generator=g)
    before = running.clone()
    for status in (torch.ones((), dtype=status_dtype), torch.zeros((), dtype=status_dtype)):
        seq_k, seq_t = seq.clone(), seq.clone()
        pad = (7, torch.full((), 7))
        nxt, still, sent = accept.take(choice, status, running, pad, eos, seq_k[:, 4])
        want = accept._torch_ops(choice, status, running.clone(), pad[1], eos, seq_t[:, 4])
        assert torch.equal(seq_k, seq_t) and torch.equal(nxt, want[0]) and torch.equal(sent, want[2])
        assert torch.equal(still, want[1]) and still.dtype == torch.bool and sent.dtype == torch.long
        assert torch.equal(running, before)
        assert int(sent[-1]) == int(status) and sent[:-1].tolist() == seq_k[:, 4].tolist()
        if eos is not None:
            assert not still[0] and torch.equal(still, running & (seq_k[:, 4] != 7))
    assert accept.KERNEL.checked  # the kernel ran (its first result checked against torch's, then trusted)


@interpreted_here
def test_a_sampled_batch_with_eos_and_a_penalty_takes_its_tokens_through_the_kernel_as_through_torchs_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole generation with the token-taking kernel (interpreted; the other kernels off): a left-padded batch,
    sampled with a seed, a repetition penalty (which reads the running rows before EOS ends them) and an EOS that
    some rows choose: the same sequences, texts' ids and stop reasons as with torch's ops."""
    from gpt2_port.generate import generate_full

    m = chaotic_model(TINY, seed=5)
    ids = torch.tensor([[0, 0, 464, 2444], [11, 7, 3, 2444], [0, 0, 0, 5]])
    mask = (ids != 0).long()
    opts = dict(attention_mask=mask, do_sample=True, top_k=8, repetition_penalty=1.3, seed=3, fast_step=False)
    plain = generate_full(m, ids, 24, eos_token_id=None, **opts)
    eos = int(plain.sequences[0, 7])  # a token row 0 samples at its fourth step: it ends there
    want = generate_full(m, ids, 24, eos_token_id=eos, **opts)
    monkeypatch.setattr(accept.KERNEL, "may_run", lambda t: True)
    monkeypatch.setattr(accept.KERNEL, "broken", None)
    monkeypatch.setattr(accept.KERNEL, "checked", set())
    got = generate_full(m, ids, 24, eos_token_id=eos, **opts)
    assert accept.KERNEL.checked and accept.KERNEL.broken is None
    assert torch.equal(got.sequences, want.sequences) and got.new_ids == want.new_ids
    assert got.stop_reasons == want.stop_reasons and "eos" in want.stop_reasons


@interpreted_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bf16", "fp16"])
def test_the_token_taking_kernel_feeds_the_next_step_as_the_cache_does(interpreted: None, dtype: torch.dtype) -> None:
    """Given a static cache and a slot, accept.take's kernel also sets the next step's inputs: each row's token (the
    padding for a finished row, as in the sequence), the slot's mask value 0 for every row, each row's position (a
    left-padded row's counted from its first real token) and the slot; StaticKVCache.feed's values bit for bit, at
    the first new slot and later ones, whatever the kernel's first check, the cache's other slots untouched."""
    from gpt2_port.generate.cache import StaticKVCache

    B, T, slots = 3, 4, 64
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    kernel_fed, torch_fed = (StaticKVCache(TINY, B, slots, dtype, "cpu") for _ in range(2))
    for cache in (kernel_fed, torch_fed):
        cache.start(prompt_mask, T)
    running = torch.tensor([True, False, True])
    pad = (7, torch.full((), 7))
    for k, at in enumerate((T, T + 1, 16, 17, 33)):  # 16: where triton would specialise an integer argument
        choice = torch.tensor([11, 12, 13]) + k
        seq_k, seq_t = torch.zeros(B, slots, dtype=torch.long), torch.zeros(B, slots, dtype=torch.long)
        status = torch.ones((), dtype=torch.bool)
        accept.take(choice, status, running, pad, None, seq_k[:, at], (kernel_fed, at))
        accept._torch_ops(choice, status, running, pad[1], None, seq_t[:, at])
        torch_fed.feed(seq_t[:, at], at)
        assert kernel_fed.fed == at and torch.equal(seq_k, seq_t)
        for name in ("tok", "slot", "bias", "pos"):
            assert torch.equal(getattr(kernel_fed, name), getattr(torch_fed, name)), (at, name)
        assert kernel_fed.tok.view(-1).tolist() == [11 + k, 7, 13 + k]  # row 1 finished: its padding
        assert kernel_fed.pos.view(-1).tolist() == [at, at - 2, at - 3]  # positions: slots less the left padding
        assert int(kernel_fed.slot) == at and bool((kernel_fed.bias[:, at] == 0).all())
    assert accept.KERNEL.checked  # the kernel ran, with its fed inputs checked once against feed's


@interpreted_here
def test_a_static_generation_feeds_its_steps_through_the_token_taking_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a static generation (generate's on CUDA) the kernel that takes each token into the sequence sets the next
    step's inputs too: StaticKVCache.feed (four launches a token) runs only in the kernel's first check, not once a
    token; the tokens are those of the generation with torch's ops, which feed every step."""
    from gpt2_port.generate import generate_full
    from gpt2_port.generate.cache import StaticKVCache

    fed: list[int] = []
    real = StaticKVCache.feed

    def counted(self: StaticKVCache, tok: torch.Tensor, slot: int) -> None:
        fed.append(slot)
        real(self, tok, slot)

    monkeypatch.setattr(StaticKVCache, "feed", counted)
    m = chaotic_model(TINY, seed=5)
    ids = torch.tensor([[0, 0, 464, 2444], [11, 7, 3, 2444]])
    opts = dict(attention_mask=(ids != 0).long(), eos_token_id=None, static_cache=True, fast_head=False)
    want = generate_full(m, ids, 12, **opts)
    assert fed == list(range(4, 4 + 12))  # torch's ops: every step's slot, the last one's included
    fed.clear()
    monkeypatch.setattr(accept.KERNEL, "may_run", lambda t: True)
    monkeypatch.setattr(accept.KERNEL, "broken", None)
    monkeypatch.setattr(accept.KERNEL, "checked", set())
    got = generate_full(m, ids, 12, **opts)
    assert accept.KERNEL.checked and accept.KERNEL.broken is None
    assert fed == [4]  # the kernel's first result checked against feed's, once
    assert got.extra["step"] == "static" and torch.equal(got.sequences, want.sequences)


def test_the_token_taking_kernel_is_not_taken_for_what_it_does_not_handle() -> None:
    """accept.in_kernel never holds on the CPU; `takes` refuses int32 choices, a (B,) status, a non-bool or strided
    mask, a column of another dtype or length."""
    choice, status, running, column = (
        torch.zeros(4, dtype=torch.long),
        torch.ones((), dtype=torch.long),
        torch.ones(4, dtype=torch.bool),
        torch.zeros(4, 3, dtype=torch.long)[:, 1],
    )
    assert accept.takes(choice, status, running, column) and not accept.in_kernel(choice, status, running, column)
    cases = {
        "int32 choice": (choice.int(), status, running, column),
        "float status": (choice, status.float(), running, column),
        "status per row": (choice, status.expand(4), running, column),
        "int64 mask": (choice, status, running.long(), column),
        "strided mask": (choice, status, torch.ones(8, dtype=torch.bool)[::2], column),
        "int32 column": (choice, status, running, column.int()),
        "short column": (choice, status, running, column[:3]),
    }
    for name, args in cases.items():
        assert not accept.takes(*args), name


# The norm-and-matmul kernel's output against float64's (the Linear over torch's own normalised rows, rounded as torch
# stores them), in units of the dtype's epsilon times the output's largest value; torch's F.linear beside it. Worst
# seen (K x N 64 x 96, 768 x 384, 768 x 2304, 1600 x 160; 1 and 3 rows; with and without the GELU; both venvs):
# float32 ours 5.1, torch's CPU matmul 12.6; fp16 ours 0.44, torch's 0.62; bf16 ours 1.34 (1.17 on this test's
# inputs), torch's 0.54: the interpreter truncates its bf16 roundings of the normalised rows and of the output, where
# a GPU rounds to nearest (tests/test_cuda.py holds bf16 to 1).
LINEAR_EPS = {torch.float32: 8.0, torch.float16: 0.5, torch.bfloat16: 1.5}


def _linear_inputs(dtype: torch.dtype, rows: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A residual stream's x and d (B, 1, K), a layer norm's weight and bias, and a Linear's (N, K) weight as the
    checkpoint holds it (a transposed view of Conv1D's [in, out]) with its bias."""
    x, d, lnw, lnb = _inputs(dtype, rows, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.randn(k, n, generator=g) / k**0.5).to(dtype).t()
    b = (0.5 * torch.randn(n, generator=g)).to(dtype)
    return x, d, lnw, lnb, w, b


def _eps_far(got: torch.Tensor, truth: torch.Tensor) -> float:
    """The largest distance in units of got's dtype's epsilon times truth's largest value."""
    return (got.double() - truth).abs().max().item() / (torch.finfo(got.dtype).eps * truth.abs().max().item())


def _same_sum(s: torch.Tensor, want: torch.Tensor, d: torch.Tensor | None = None) -> bool:
    """s is want bit for bit; in bf16 within an ulp of want, and where `d` (a rounded term of the sum) is given,
    within an ulp of d more: triton's interpreter truncates each rounding to bf16, where a GPU rounds to nearest as
    torch does (tests/test_cuda.py holds the sum bit for bit there)."""
    if s.dtype != torch.bfloat16:
        return torch.equal(s, want)

    def ulp(t: torch.Tensor) -> torch.Tensor:
        return torch.finfo(s.dtype).eps * torch.exp2(torch.floor(torch.log2(t.double().abs().clamp_min(1e-30))))

    bound = ulp(want) + (ulp(d) if d is not None else 0.0)
    return bool(((s.double() - want.double()).abs() <= bound).all())


@interpreted_here
@pytest.mark.exactness
@pytest.mark.parametrize("stream", ["sum", "partials", "lookup"])
@pytest.mark.parametrize(
    "shape", [(1, 768, 2304, True), (3, 768, 384, False), (3, 1600, 160, True), (1, 64, 96, False)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "fp16", "bf16"])
def test_the_norm_linear_kernel_adds_norms_and_multiplies_as_torchs_ops(
    interpreted: None, dtype: torch.dtype, shape: tuple[int, int, int, bool], stream: str
) -> None:
    """norm_linear's one kernel: the residual stream's sum (x + d, x + a projection's partial sums and bias, or the
    embeddings' rows) is torch's add of the same terms bit for bit, and the Linear (with the tanh GELU after it where
    asked) over the sum's layer norm is within `LINEAR_EPS` of float64's, as torch's F.linear is. Rows of 1 and 3,
    widths of GPT-2's (768; gpt2-xl's 1600, a masked tail) and small, the weight the checkpoint's transposed view."""
    from gpt2_port.model.norm_linear import Lookup, Parts, in_kernel, norm_linear

    rows, k, n, gelu = shape
    x, d, lnw, lnb, w, b = _linear_inputs(dtype, rows, k, n)
    if stream == "partials":  # three slices' float32 sums and the projection's bias: d as torch's matmul stores it
        sums = torch.randn(3, rows, 1, k, generator=torch.Generator().manual_seed(5))
        d_bias = torch.randn(k, generator=torch.Generator().manual_seed(6)).to(dtype)
        got_in = (x, Parts(sums, d_bias, dtype))
        d = (summed_in_order(sums) + d_bias).to(dtype)  # the kernel's order
    elif stream == "lookup":  # tables of other sizes, each row's token and position ids apart
        g = torch.Generator().manual_seed(7)
        wte = (torch.randn(2 * rows + 3, k, generator=g) * 4).to(dtype)
        wpe = torch.randn(rows + 2, k, generator=g).to(dtype)
        ids, pos = torch.arange(2 * rows + 2, rows + 2, -1).view(rows, 1), torch.arange(1, rows + 1).view(rows, 1)
        x, d = F.embedding(ids, wte), F.embedding(pos, wpe)
        got_in = Lookup(ids, pos, wte, wpe)
    else:
        got_in = (x, d)

    def then(h: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(h, w, b), approximate="tanh") if gelu else F.linear(h, w, b)

    assert in_kernel(got_in, (lnw, lnb), (w, b))
    s, out = norm_linear(got_in, (lnw, lnb), 1e-5, (w, b), then, gelu, True, True)
    want_s = x + d
    h = F.layer_norm(want_s, (k,), lnw, lnb, 1e-5)  # torch's normalised rows, rounded as torch stores them
    truth = F.linear(h.double(), w.double(), b.double())
    truth = F.gelu(truth, approximate="tanh") if gelu else truth
    assert s.shape == want_s.shape and out.shape == (rows, 1, n)
    assert _same_sum(s, want_s, d if stream == "partials" else None)
    ours, theirs = _eps_far(out, truth), _eps_far(then(h), truth)
    assert ours <= LINEAR_EPS[dtype], (ours, theirs)


@interpreted_here
@pytest.mark.exactness
@pytest.mark.parametrize("shape", [(1, 3072), (3, 768)], ids=["mlp", "attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_the_projection_kernels_partials_sum_to_the_linear_and_the_last_norm_adds_them(
    interpreted: None, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    """project's kernel (c_proj, the MLP's c_proj): partial sums over as many slices of K as `split_of` says, whose
    sum with the bias is the Linear's output within `LINEAR_EPS` of float64's; the same bits on a second run (no
    atomics); the next kernels read them: `add_norm_of` (ln_f's) makes torch's add of the partials summed in order,
    bit for bit, and its layer norm. MLP-shaped (3072 -> 768) and attention-shaped (768 -> 768), 1 and 3 rows."""
    from gpt2_port.model.norm_linear import Parts, add_norm_of, project
    from gpt2_port.model.norm_linear_triton import split_of

    rows, k = shape
    y, _, _, _, w, b = _linear_inputs(dtype, rows, k, 768)  # (B, 1, K) rows into a (768, K) weight
    x, _, lnw, lnb = _inputs(dtype, rows, 768, seed=1)
    parts = project(y, lambda t: F.linear(t, w, b), (w, b), kernel=True)
    assert (
        isinstance(parts, Parts)
        and parts.sums.shape == (split_of(k, 768, rows)[0], rows, 1, 768)
        and parts.sums.shape[0] > 1
    )
    assert torch.equal(project(y, lambda t: F.linear(t, w, b), (w, b), kernel=True).sums, parts.sums)
    truth = F.linear(y.double(), w.double(), b.double())
    assert _eps_far(parts.total(), truth) <= LINEAR_EPS[dtype]
    d = (summed_in_order(parts.sums) + b).to(dtype)
    want_s = x + d
    s, normed = add_norm_of((x, parts), (lnw, lnb), 1e-5, kernel=True)
    assert _same_sum(s, want_s, d)
    if dtype == torch.float32:
        off, ours, theirs = norm_ulps(normed, want_s, lnw, lnb, 1e-5)
        assert off <= 2 * ULPS[dtype] and ours <= theirs + ULPS[dtype], (off, ours, theirs)


def test_the_norm_linear_kernels_are_not_taken_for_what_they_do_not_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules apart from the device (lifted here): more than MAX_ROWS rows (a matrix product: cuBLAS's), a Linear
    that is not plain (int8's layers: no weights) or has no bias, mixed dtypes (autocast's float32 residual beside a
    bf16 projection), float64, rows not contiguous, partials not float32, rows wider than MAX_WIDTH; and on the CPU
    none of them runs, whatever is asked (the forward's ops)."""
    from gpt2_port.model.norm_linear import KERNELS, MAX_ROWS, Parts, in_kernel, norm_linear, project

    x, d, lnw, lnb, w, b = _linear_inputs(torch.bfloat16, 2, 64, 32)
    norm = (lnw, lnb)
    then = lambda h: F.linear(h, w, b)  # noqa: E731
    s, out = norm_linear((x, d), norm, 1e-5, (w, b), then, False, True, True)  # the CPU: torch's ops
    want = x + d
    assert torch.equal(s, want) and torch.equal(out, then(F.layer_norm(want, (64,), lnw, lnb, 1e-5)))
    assert torch.equal(project(x, then, (w, b), kernel=True), then(x))
    for kernel in KERNELS:
        monkeypatch.setattr(kernel, "may_run", lambda t: True)
    assert in_kernel((x, d), norm, (w, b))
    many = _linear_inputs(torch.bfloat16, MAX_ROWS + 1, 64, 32)[:2]
    wide = torch.ones(1, 1, 8192, dtype=x.dtype)
    cases = {
        "rows": (many, norm, (w, b)),
        "int8": ((x, d), norm, None),
        "no bias": ((x, d), norm, (w, None)),
        "mixed": ((x.float(), d), norm, (w, b)),
        "float64": ((x.double(), d.double()), (lnw.double(), lnb.double()), (w.double(), b.double())),
        "strided": ((torch.cat([x, x], -1)[..., ::2], d), norm, (w, b)),
        "partials": ((x, Parts(torch.zeros(2, *x.shape, dtype=torch.float64), lnb, x.dtype)), norm, (w, b)),
        "wide": ((wide, wide), (wide[0, 0],) * 2, (torch.zeros(32, 8192, dtype=x.dtype), b)),
    }
    for name, (stream, nrm, wb) in cases.items():
        assert not in_kernel(stream, nrm, wb), name
