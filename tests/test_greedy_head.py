"""The fast greedy heads (generate/greedy_head.py): each returns the argmax of the model's logits or declines.

ScreenedHead's bound is checked against float64 truth on a head shaped like GPT-2's (a large common component in
every row of wte, so the logits carry a large common offset, and a hidden state with a few huge dimensions), in
float32 and float16; both heads are checked against the float32 argmax on near ties they must decline or get right,
and the screen against the float16 argmax, whose rounded logits tie where the float32 sums do not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from conftest import greedy_heads

from gpt2_port.cpu import on_packed, pack, packs
from gpt2_port.generate import greedy_head
from gpt2_port.generate.greedy_head import (
    SCREEN_SAFETY,
    FastGreedyHead,
    LogitRounding,
    ScreenedHead,
    TransposedHead,
    norm_slack,
)

pytestmark = pytest.mark.exactness

HEADS = greedy_heads()
SCREENED = [p for p in HEADS if p.id == "screened"]
V, C = 5000, 256


@contextlib.contextmanager
def onednn_float32_matmuls(precision: str) -> Iterator[None]:
    """oneDNN's float32 matmul precision set to `precision` ("ieee", "bf16", "tf32") for the block, then put back."""
    matmul = torch.backends.mkldnn.matmul
    old = matmul.fp32_precision
    matmul.fp32_precision = precision
    try:
        yield
    finally:
        matmul.fp32_precision = old


def gpt2_like_head(seed: int = 0) -> torch.Tensor:
    """(V, C) rows with a common component 3x the size of each row's own (GPT-2's wte is as anisotropic), row norms
    spread over 2x, and a few rare rows 3x longer."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(C, generator=g) * 0.4
    w = torch.randn(V, C, generator=g) * 0.13 * (1 + torch.rand(V, 1, generator=g))
    w[:: V // 10] *= 3
    return w + common


def hidden(n: int, w: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """(n, C) final hidden states like GPT-2's: unit-scale dimensions, three 20x larger, and a component along the
    common row that gives every logit a large negative offset (about -100)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, C, generator=g) * 1.5
    h[:, [3, 77, 200]] *= 20
    common = w.mean(dim=0)
    return h - 100 * common / common.norm() ** 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("kind", SCREENED)
def test_the_screens_bound_holds_against_float64_truth(kind: type, dtype: torch.dtype) -> None:
    """|s_j - e'_j| <= B + U |s_j| for every token (e'_j the exact shifted logit), without the bound's safety factor.
    Worst case seen: 0.12 of the undoubled B (float32 and float16 alike)."""
    w = gpt2_like_head().to(dtype)
    head = kind(w)
    h = hidden(16, w.float()).to(dtype)
    s, bounds, _ = head.screen(h)
    truth = h.double() @ (w.double() - head.mean.double()).t()  # (16, V): the shifted logits, exactly enough
    raw = torch.tensor(bounds, dtype=torch.float64)[:, None] / (SCREEN_SAFETY * norm_slack(C))
    err = (s.double() - truth).abs() - head.u_s * s.double().abs()
    worst = float((err / raw).max())
    assert worst <= 1.0, worst
    logits = F.linear(h.float(), w.float())
    assert float(logits.mean(dim=1).amax()) < -50  # GPT-2-like: a large common offset ...
    assert float(s.mean(dim=1).abs().amax()) < 1.0  # ... that the shift removes before bf16 rounds


@pytest.mark.parametrize("kind", HEADS)
def test_the_fast_argmax_is_the_float32_argmax_or_none(kind: type) -> None:
    """On random hidden states and on near ties (pairs of rows apart by 1e-7 .. 1e-2 of their length, the hidden
    state aimed at the pair), every answer equals torch.argmax of the model's float32 logits; ties too close to
    prove are declined, clear leads are answered."""
    w = gpt2_like_head(2)
    for j, rel in enumerate([1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2]):
        w[100 + j] = w[10 + j] * (1 + rel)  # the pair (10 + j, 100 + j): 100 + j leads by a hair when h aims at it
    head = kind(w)
    h = hidden(64, w, seed=3)
    aimed = torch.stack([w[10 + j] * 4 for j in range(6)]) + hidden(6, w, seed=4) * 0.01  # (6, C)
    answered = declined = 0
    for row in torch.cat([h, aimed]):
        got = head.argmax(row[None])
        want = torch.argmax(F.linear(row[None], w), dim=-1)  # the model's head: one float32 matmul
        if got is None:
            declined += 1
        else:
            answered += 1
            assert torch.equal(got, want)
    assert answered >= 64  # every random state answered: clear leads
    assert declined >= 2  # the closest ties (1e-7, 1e-6 of a row) cannot be proven in float32
    batch = head.argmax(h)  # (64,) in one call
    assert batch is not None and torch.equal(batch, torch.argmax(F.linear(h, w), dim=-1))


@pytest.mark.parametrize("kind", SCREENED)
def test_the_float16_argmax_is_the_models_or_none_even_where_rounding_ties(kind: type) -> None:
    """A float16 head rounds each float32 sum to float16, so two logits apart by more than the float32 margin 4 G
    can round to one value, and torch.argmax then takes the first. On random states and near ties (pairs of rows apart
    by 1e-5 .. 1e-2 of their length, the state aimed at the pair) every answer equals the argmax of the float16
    logits as torch's fp16 GEMM and oneDNN's packed fp16 kernel compute them; the data holds such rounding ties, and
    the float32 rule alone (no rounding gap) answers some of them wrongly."""
    w = gpt2_like_head(2)
    rels = torch.logspace(-5, -2, 24).tolist()
    for j, rel in enumerate(rels):
        w[100 + j] = w[10 + j] * (1 + rel)
    w16 = w.half()
    aimed = torch.stack([w[10 + j] * 4 for j in range(len(rels))]) + hidden(len(rels), w, seed=4) * 0.01
    states = torch.cat([hidden(64, w, seed=3), aimed]).half()  # (88, C)
    packed = pack(w16) if packs(torch.float16) else None
    head = kind(w16)
    answered, ties = [], 0
    for i, row in enumerate(states):
        logits = F.linear(row[None], w16)  # (1, V) float16
        want = torch.argmax(logits.float(), dim=-1)
        if packed is not None:
            assert torch.equal(torch.argmax(on_packed(row[None], packed, None).float(), dim=-1), want)
        sums = torch.topk((row.float() @ w16.float().t()), 2).values.tolist()  # float32 sums, before rounding
        rounded = torch.topk(logits[0].float(), 2).values.tolist()
        ties += sums[0] - sums[1] > 4 * head.g_scale * float(row.float().norm()) and rounded[0] == rounded[1]
        got = head.argmax(row[None])
        if got is not None:
            answered.append(i)
            assert torch.equal(got, want)
    random = [i for i in answered if i < 64]
    assert len(random) >= 60 and ties >= 1  # random states: a lead clear of float16's ulp; the near ties hold ties
    batch = head.argmax(states[random])
    assert batch is not None and torch.equal(batch, torch.argmax(F.linear(states[random], w16).float(), dim=-1))
    with pytest.MonkeyPatch.context() as mp:  # the float32 rule alone: some rounding ties get the wrong token
        mp.setattr(LogitRounding, "of", staticmethod(lambda dtype: LogitRounding(None, 0.0, 0.0, 1e38)))
        loose = kind(w16)
        answers = [(loose.argmax(row[None]), torch.argmax(F.linear(row[None], w16).float(), dim=-1)) for row in states]
        assert any(got is not None and not torch.equal(got, want) for got, want in answers)


@pytest.mark.parametrize("kind", SCREENED)
def test_the_float16_screen_keeps_rivals_that_round_to_the_leaders_logit(kind: type) -> None:
    """A screen that is nearly exact (weights, mean and state exact in bf16) rules a token out by a hair's margin;
    but a rival 0.125 below a leader at -999 rounds to the same float16 logit (the spacing there is 0.5), and comes
    first. The screen's margin holds float16's gap, so the rival stays a candidate and the tie is declined; without
    that gap the screen drops it and answers the leader, the wrong token."""
    w = torch.zeros(8, 64)
    w[:, 0] = -100.0  # the mean row: every logit is -1000 + x_j
    w[:, 1] = torch.tensor([0.875, 1.0, -0.5, -0.5, -0.875, 0.0, 0.0, 0.0])  # x_j, summing to 0
    h = torch.zeros(1, 64)
    h[0, 0], h[0, 1] = 10.0, 1.0
    w16, h16 = w.half(), h.half()
    logits = F.linear(h16, w16)
    assert logits[0, :2].tolist() == [-999.0, -999.0] and int(torch.argmax(logits.float(), dim=-1)) == 0
    assert kind(w16).argmax(h16) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LogitRounding, "gap", lambda self, a, b: 0.0)
        assert kind(w16).argmax(h16).tolist() == [1]  # what the test guards against


@pytest.mark.parametrize("kind", SCREENED)
def test_the_float16_decision_holds_under_a_reduced_float32_matmul_precision(kind: type) -> None:
    """With oneDNN's float32 matmuls in bf16 (`torch.set_float32_matmul_precision("medium")` does the same), a float32
    product of 33 rows or more is bf16 arithmetic, far outside the float32 bound, while the fp16 head is untouched.
    Here 62 candidates: row 1 (bf16 rounds its entries up) trails row 0 (entries rounded down) by less than half a
    float16 ulp, so their fp16 logits tie and the first wins; bf16 candidate products would put row 1 ahead. The
    float64 products cannot be reduced: the answer is the model's or none."""
    g = torch.Generator().manual_seed(0)
    C, V = 768, 1000
    h = (1 + torch.rand(C, generator=g, dtype=torch.float64)).to(torch.bfloat16).double()  # exact in bf16 and fp16
    step = 2.0**-7  # bf16's spacing at 1.3
    base = torch.floor(torch.full((C,), 1.3, dtype=torch.float64) / step) * step

    def rounded_down(frac: float) -> torch.Tensor:  # entries bf16 rounds down; a fraction one bf16 step higher
        return base + step * (torch.rand(C, generator=g, dtype=torch.float64) < frac) + 3 / 8 * step

    up = base + 5 / 8 * step  # entries bf16 rounds up
    while not (0 < float(h @ (lead := rounded_down(0.30))) - float(h @ up) < 0.25):  # half an ulp of ~1520: 0.5
        pass
    w = torch.randn(V, C, generator=g, dtype=torch.float64) * 0.05
    w[0], w[1] = lead, up
    fill = 2
    while fill < 62:  # rivals below row 1, close enough to stay candidates
        row = rounded_down(0.22)
        if float(h @ row) < float(h @ up):
            w[fill], fill = row, fill + 1
    w16, h16 = w.half(), h.half()[None]
    want = torch.argmax(F.linear(h16, w16).float(), dim=-1)
    assert int(want) == 0
    with onednn_float32_matmuls("bf16"):
        got = kind(w16).argmax(h16)
    assert got is None or torch.equal(got, want)


def test_float32_heads_are_not_used_when_float32_matmuls_are_reduced() -> None:
    """Under a reduced float32 matmul precision the model's own float32 logits are bf16 or tf32 arithmetic, which the
    float32 proof does not describe: no shortcut for float32 models then (float16 keeps the screen: its head is
    untouched by that setting). Nor for float16 models where torch's fp16 GEMM may sum in float16."""
    from gpt2_port.config import GPT2Config
    from gpt2_port.cpu import float32_matmuls_exact
    from gpt2_port.model import GPT2

    model = GPT2(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)).eval()
    model.requires_grad_(False)
    assert float32_matmuls_exact() and FastGreedyHead.usable(model)
    for setting in ("bf16", "tf32"):
        with onednn_float32_matmuls(setting):
            assert not float32_matmuls_exact() and not FastGreedyHead.usable(model)
            assert FastGreedyHead.usable(model.half()) == ScreenedHead.available()
            model.float()
    with onednn_float32_matmuls("ieee"):
        assert float32_matmuls_exact() and FastGreedyHead.usable(model)
    with pytest.MonkeyPatch.context() as mp:  # float16 sums allowed in torch's fp16 GEMM: no float16 shortcut
        mp.setattr(torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", lambda: True)
        assert not FastGreedyHead.usable(model.half()) and FastGreedyHead.usable(model.float())
    with pytest.MonkeyPatch.context() as mp:  # the legacy API sets the same thing
        mp.setattr(torch.backends.mkldnn, "matmul", None)  # a torch without the new API is asked the legacy one
        assert float32_matmuls_exact()
        torch.set_float32_matmul_precision("medium")
        try:
            assert not float32_matmuls_exact()
        finally:
            torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("kind", SCREENED)
def test_the_float16_screen_declines_logits_that_may_overflow(kind: type) -> None:
    """float16 logits overflow past 65504: a bound on |logit| that may reach it gets None (the exact logits are then
    computed and checked), a smaller one an answer."""
    w = gpt2_like_head().half()
    head = kind(w)
    h = hidden(1, w.float())
    top = float(h.norm()) * head.w_max
    assert head.argmax((h * (1000 / top)).half()) is not None
    assert head.argmax((h * (40000 / top)).half()) is None


@pytest.mark.parametrize("kind", SCREENED)
def test_the_screened_head_keeps_no_float32_copy(kind: type) -> None:
    """Its only copy of the head is the packed bf16 one (half the bytes of the float32 weight; oneDNN may pad it),
    and it reads the float32 rows from the weight itself."""
    w = gpt2_like_head()
    head = kind(w)
    assert head.w.data_ptr() == w.data_ptr() and kind(w.half()).w.dtype == torch.float16
    own = [t for t in vars(head).values() if isinstance(t, torch.Tensor) and t is not head.w]
    big = [t for t in own if t.numel() * t.element_size() > 4 * C * 4]
    assert len(big) == 1 and big[0].element_size() == 2 and big[0].numel() <= 1.1 * V * C


def test_the_screen_is_chosen_where_onednn_has_packed_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has no bf16 kernel (AVX2, or capped by ONEDNN_MAX_CPU_ISA) torch's bf16 GEMM is slow code, and
    the transposed float32 head is used."""
    w = gpt2_like_head()
    want = ScreenedHead if ScreenedHead.available() else TransposedHead
    assert type(FastGreedyHead.make(w)) is want
    monkeypatch.setattr(greedy_head, "packs", lambda dtype: False)
    assert not ScreenedHead.available() and type(FastGreedyHead.make(w)) is TransposedHead


@pytest.mark.parametrize(
    ("dtype", "amp"),
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float16, torch.float16)],
    ids=["float32-bf16", "float32-fp16", "float16-fp16"],
)
def test_no_shortcut_under_cpu_autocast(dtype: torch.dtype, amp: torch.dtype) -> None:
    """Under CPU autocast the head's logits are autocast's bf16/fp16 product, which neither proof describes (the
    transposed head's own product would be autocast's too): greedy decoding takes the head's logits, and runs."""
    from conftest import TINY, chaotic_model

    from gpt2_port.generate.loop import generate_full

    model = chaotic_model(TINY, 3).to(dtype).eval()
    model.requires_grad_(False)
    fast_outside = FastGreedyHead.usable(model)
    assert fast_outside == (dtype == torch.float32 or ScreenedHead.available())
    ids = torch.tensor([[5, 17, 42], [7, 8, 9]])
    with torch.autocast("cpu", dtype=amp):
        assert not FastGreedyHead.usable(model)
        g = generate_full(model, ids, 40, eos_token_id=None)  # the float32 screen's differed (bf16: row 1, step 3)
        exact = generate_full(model, ids, 40, eos_token_id=None, fast_head=False)
    assert not g.extra["fast_head"] and g.sequences.tolist() == exact.sequences.tolist()
    assert FastGreedyHead.usable(model) == fast_outside  # the autocast block over, the shortcut is back
