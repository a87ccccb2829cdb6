"""Greedy next tokens on the CPU without the head's full product, used only when provably the exact argmax.

The head is the largest single read of a float32 decode step (154 MB for GPT-2 124M, a quarter of the step's
bytes). Two shortcuts, each proving per step that its token is the argmax of the logits `model.head` would compute,
and declining (None: the exact logits are computed as usual) when it cannot:

- `ScreenedHead`, where oneDNN has bf16 kernels (AVX512-BF16 or AMX: `cpu.packs(torch.bfloat16)`): a bf16 product
  with rigorous error bounds screens the vocabulary, and float64 dot products decide among the few tokens it cannot
  rule out. Reads half the head's bytes in float32; in float16 the same bytes as the fp16 head, but through oneDNN's
  bf16 kernel, which is faster there than its fp16 one on CPUs without AMX-FP16 (1.7 ms against 3.4 ms for the
  124M head on the Xeon of BENCHMARKS.md).
- `TransposedHead` elsewhere (float32 only): the float32 product on a (C, V) copy of the weight, ~30% faster than
  (V, C) on a CPU.

Both rest on one bound (Higham, any summation order): a float32 dot product of length n is within
G = gamma_n * sum_i |h_i w_ji| <= gamma_n * |h| * |w_j| of the true one, gamma_n = n u / (1 - n u). The logits the
model would compute and any other float32 evaluation of them are each within G of the true dot products, so within
2 G of each other, and a lead of more than 4 G over every rival in one is a lead in the other (the screen's float64
products are within e << G of the truth: a lead of 2 (G + e) there). The bound holds where float32 matmuls run in
float32: a reduced `torch.set_float32_matmul_precision` (bf16 or tf32 on oneDNN) makes the model's own logits
something else, and float32 models then get no shortcut (`cpu.float32_matmuls_exact`).

A float16 model's head accumulates in float32 too (oneDNN's "strict" mode; torch's own fp16 GEMM sums in float) and
rounds each logit once to float16, so its logits can tie where the float32 sums do not, and torch.argmax then takes
the first. `LogitRounding` carries that rounding, in any mode: a sum x becomes one of its two float16 neighbours,
down(x) <= r(x) <= up(x). The leader's sum is at least c0 - (G + e) and every rival's at most c1 + (G + e), so
down(c0 - G - e) > up(c1 + G + e) makes the leader's rounded logit strictly the largest: no tie, whichever way it
would be broken. The fp16 head itself is not touched by the float32 precision setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cpu import float16_sums_in_float32, float32_matmuls_exact, on_packed, pack, packs
from ..devices import autocast_dtype
from .protocol import CausalLM

F32_U = 2.0**-24  # float32's unit roundoff (round to nearest)
F64_U = 2.0**-53  # float64's
BF16_U = 2.0**-8  # bfloat16's
SCREEN_SAFETY = 2.0  # the screen's bound is doubled: a looser screen only leaves a few more candidates
NO_OVERFLOW = 1e38  # |h| * max|w_j| below this: no logit can overflow float32 (max 3.4e38), so every logit is finite


@dataclass(frozen=True)
class LogitRounding:
    """How the model's head rounds its float32 sums into logits (`dtype`; None: it does not, the sums are the
    float32 logits): any rounding r has |r(x) - x| <= rel |x| + tiny, and r(x) is one of the two neighbours
    `down(x)`, `up(x)`; every logit is finite while the bound on |sum| stays below `limit`."""

    dtype: torch.dtype | None
    rel: float
    tiny: float
    limit: float

    @staticmethod
    def of(dtype: torch.dtype) -> LogitRounding:
        if dtype == torch.float32:
            return LogitRounding(None, 0.0, 0.0, NO_OVERFLOW)
        if dtype == torch.float16:
            return LogitRounding(torch.float16, 2.0**-10, 2.0**-24, torch.finfo(torch.float16).max / 2)
        raise ValueError(f"no fast greedy head for {dtype} logits (expected torch.float32 or torch.float16)")

    def gap(self, a: float, b: float) -> float:
        """What the rounding may take from the difference of two sums a > b (any rounding mode: a full ulp each)."""
        return self.rel * (abs(a) + abs(b)) + 2 * self.tiny

    def _near(self, x: float, toward: float) -> float:
        """The nearest value of `dtype` to x on toward's side (x itself without a dtype; NaN stays NaN)."""
        if self.dtype is None:
            return x
        y = torch.tensor(x, dtype=torch.float64).to(self.dtype)  # one of x's two neighbours, whichever the rounding
        if (toward < 0 and float(y) > x) or (toward > 0 and float(y) < x):
            y = torch.nextafter(y, torch.tensor(toward, dtype=self.dtype))
        return float(y)

    def down(self, x: float) -> float:
        """The largest value of `dtype` at most x: no rounding of a sum >= x gives less."""
        return self._near(x, -math.inf)

    def up(self, x: float) -> float:
        """The smallest value of `dtype` at least x: no rounding of a sum <= x gives more."""
        return self._near(x, math.inf)


def gamma(n: int, u: float = F32_U) -> float:
    """gamma_n: the relative error bound of an n-term sum or dot product in any order, at unit roundoff u."""
    return n * u / (1 - n * u)


def norm_slack(n: int) -> float:
    """A factor that covers the float32 rounding of the norms a bound is made of (|h|, max |w_j|: each within about
    gamma_n / 2 of its value) and of the bound's own arithmetic."""
    return 1 + 4 * gamma(n)


class TransposedHead:
    """Greedy next tokens from a (C, V) copy of the head weight (one matrix-vector product, ~30% faster on a CPU than
    the (V, C) layout). The two layouts sum in different orders, so their logits differ in the last bits: each of the
    fast and the model's logits is within G = gamma_C |h| max|w_j| of the true one, so when the fast top-1 leads the
    fast top-2 by more than 4 G, the model's logits have the same unique argmax. Costs one (C, V) copy of the head
    weight (154 MB for GPT-2 124M)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype != torch.float32:
            raise ValueError(f"TransposedHead takes a float32 weight, got {weight.dtype}")
        V, C = weight.shape
        self.wt = weight.detach().t().contiguous()  # (C, V)
        self.scale = 4 * gamma(C) * norm_slack(C) * float(weight.detach().norm(dim=1).max())

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """(B, C) float32 final hidden states -> (B,) the exact argmax, or None when the margin is too thin.

        Non-finite logits always get None, so that the exact ones are computed (and generate checks them): NaN fails
        the margin test, and an Inf in h or the weight makes the bound Inf. A logit that overflows from finite
        inputs would pass the margin test with an infinite lead; with torch's unscaled norms their bound overflows
        first, but the explicit test does not rely on how a norm is computed (~20 us on a (1, 50257) row).
        """
        fast = h @ self.wt  # (B, V)
        if not bool(torch.isfinite(fast).all()):
            return None
        best = fast.argmax(dim=-1, keepdim=True)  # (B, 1)
        top1 = fast.gather(1, best)[:, 0]
        top2 = fast.scatter(1, best, -float("inf")).amax(dim=-1)  # (topk is several times slower on CPU)
        bound = self.scale * h.norm(dim=-1)  # (B,)
        if bool(((top1 - top2) > bound).all()):
            return best[:, 0]
        return None


class ScreenedHead:
    """Greedy next tokens from a bf16 screen of the vocabulary and float32 dot products over what it leaves.

    The screen: W' = W - mean row (float32; a shift common to every logit of a row, so every difference between two
    logits is kept, and GPT-2's large common offset, which would cost bf16 precision, is gone), stored in bf16 as
    oneDNN's packed weight. h is split into two bf16 rows, h = hb + hl + h3 (h3 exact in float32, ~2^-16 |h|), both
    multiplied in one call (the weight is read once): s = bf16(hb W'b^T) + bf16(hl W'b^T). bf16 products are exact
    in float32, and oneDNN accumulates in float32 (its default accumulation mode, "strict", documented as f32 for
    floating-point primitives; the bound below allows any rounding of those sums). With e'_j = h . (w_j - mean) the
    true shifted logit and r_j the row's residual, e'_j - s_j comes from h . r_j, h3 . w'b_j, the shift's own
    rounding, the two accumulations and the two roundings to bf16, so

        |s_j - e'_j| <= |h| max|r| + |h3| max|w'b| + 2 u |h| max|w'| + g' (|hb| + |hl|) max|w'b|
                        + 2 u' (1 + g') (1 + u') |hl| max|w'b|                     (= B, the screen)
                        + U |s_j|                                                  (the rounding of s_j)

    with g' = gamma_C, u' = 2^-7 / (1 - 2^-7) and U = u' + 4 u at a full ulp of float32 (u) and bf16 (so any
    rounding mode). A token whose screened logit, raised by its bound, still falls more than 2 G + D short of the
    leader's lowered by its own (G: the float32 bound gamma_C |h| max|w|; D: what the rounding of the logits may take,
    `LogitRounding.gap` at the largest |logit| possible, 0 in float32) cannot be the argmax of the model's logits.
    The rest (3 at the median, 16 at most, on a random 124M) get float64 dot products with W's own rows (the rows and
    h widen exactly; within e = gamma_C(float64) |h| max|w| of the truth, whatever the matmul precision setting); when
    the best of them leads the next by more than 2 (G + e), after the rounding to the logits' dtype (module
    docstring), it is the argmax of the model's logits too. Else, or with more than `max_candidates` left (a quarter
    of the vocabulary by default: the gathered rows then cost about what the screen saved), None.

    Finite h and weights with |h| max|w| below the rounding's `limit` make every logit of the model finite, so the
    exact path's finite check is kept: anything else gets None. Costs one packed bf16 copy of the head weight (77 MB
    for GPT-2 124M), and reads the model's weight only at the candidates' rows.
    """

    def __init__(self, weight: torch.Tensor, max_candidates: int | None = None, chunk: int = 4096) -> None:
        w = weight.detach()
        V, C = w.shape
        self.rounding = LogitRounding.of(w.dtype)
        # (C,) the mean row, summed a chunk at a time in float32 (any vector would do: the shift is common to every
        # logit); no float32 copy of a float16 weight is made
        self.mean = sum(w[i : i + chunk].float().sum(dim=0) for i in range(0, V, chunk)) / V
        wb = torch.empty(V, C, dtype=torch.bfloat16)
        norms = []  # per chunk of rows: max |w_j|, max |w'_j|, max |w'b_j|, max |w'_j - w'b_j| (float32: norm_slack)
        for i in range(0, V, chunk):
            wi = w[i : i + chunk].float()
            wci = wi - self.mean  # W', rounded to float32
            wb[i : i + chunk] = wci
            wbi = wb[i : i + chunk].float()
            norms.append([float(t.norm(dim=1).max()) for t in (wi, wci, wbi, wci - wbi)])  # wci - wbi is exact
        # the largest of each over the chunks (NaN if any is: a NaN weight must not vanish from the bound)
        self.w_max, self.wc_max, self.wb_max, self.r_max = (float(torch.tensor(col).max()) for col in zip(*norms))
        self.w = w  # the model's rows, read only at the candidates
        self.max_candidates = V // 4 if max_candidates is None else max_candidates
        g1 = gamma(C, 2 * F32_U)  # a full ulp: whatever rounding oneDNN's accumulation uses
        u1 = 2 * BF16_U / (1 - 2 * BF16_U)  # the rounding to bf16, at a full ulp
        slack = SCREEN_SAFETY * norm_slack(C)
        # B = |h| a + |h3| b + (|hb| + |hl|) c + |hl| d: the coefficients, doubled
        self.coef = [slack * k for k in (self.r_max + 2 * F32_U * self.wc_max, self.wb_max, g1 * self.wb_max)]
        self.coef.append(slack * 2 * u1 * (1 + g1) * (1 + u1) * self.wb_max)  # 2 u' |s_lo|, |s_lo| bounded
        self.u_s = u1 + 4 * F32_U  # U
        self.g_scale = gamma(C) * norm_slack(C) * self.w_max  # G = g_scale |h|
        self.e_scale = gamma(C, F64_U) * norm_slack(C) * self.w_max  # e = e_scale |h|: the float64 products'
        packed = pack(wb)
        if packed is None:
            raise RuntimeError("ScreenedHead needs oneDNN's packed bf16 kernel, which this torch or CPU lacks")
        self.packed = packed

    @staticmethod
    def available() -> bool:
        """Whether oneDNN runs bf16 matmuls here on its own kernels, packed (AVX512-BF16 or AMX, within any
        ONEDNN_MAX_CPU_ISA cap): there the screen reads half the bytes at full speed. Elsewhere torch's bf16 GEMM is
        slow code and TransposedHead is faster."""
        return packs(torch.bfloat16) and pack(torch.zeros(8, 8, dtype=torch.bfloat16)) is not None

    def screen(self, h: torch.Tensor) -> tuple[torch.Tensor, list[float], list[float]]:
        """(B, C) float32 or float16 -> ((B, V) float32 screened logits, shifted; (B,) each row's screen bound B and
        |h|, as floats)."""
        B = h.shape[0]
        h = h.float()  # exact from float16
        hb = h.to(torch.bfloat16)
        d = h - hb.float()  # exact
        hl = d.to(torch.bfloat16)
        h3 = d - hl.float()  # exact
        s2 = on_packed(torch.cat([hb, hl]), self.packed, None).float()  # (2B, V)
        s = s2[:B] + s2[B:]  # (B, V)
        parts = [h, h3, hb.float(), hl.float()]
        n = torch.stack([t.norm(dim=1) for t in parts]).tolist()  # (4, B)
        a, b, c, e = self.coef
        bound = [a * n0 + b * n1 + c * (n2 + n3) + e * n3 + 1e-30 for n0, n1, n2, n3 in zip(*n)]
        return s, bound, n[0]

    def candidates(self, s: torch.Tensor, b: float, hn: float) -> torch.Tensor | None:
        """One row's (V,) screened logits, screen bound and |h| (from `screen`) -> (k,) the tokens the screen cannot
        rule out (the leader among them), or None where no logit can be bounded (non-finite, or past the rounding's
        `limit`)."""
        s_m = float(s.max())
        g = self.g_scale * hn  # G: the float32 bound of every logit the model computes
        top = hn * self.w_max * norm_slack(self.w.shape[1]) + g  # no |logit| (before rounding) is larger
        r = self.rounding
        if not (math.isfinite(top) and top < r.limit and math.isfinite(s_m) and math.isfinite(b)):
            return None
        u = self.u_s
        # the leader's true logit lowered by its bound, less the margin: 2 G, and the rounding's gap
        y = s_m - u * abs(s_m) - 2 * b - 2 * g - r.gap(top, top)
        thr = y / (1 + u) if y >= 0 else y / (1 - u)  # s_j >= thr  <=>  s_j + u |s_j| >= y
        thr -= 2**-20 * abs(thr) + 1e-30  # below its rounding to float32 (and this arithmetic's own)
        return (s >= thr).nonzero()[:, 0]  # (k,)

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """(B, C) final hidden states in the weight's dtype -> (B,) the exact argmax of the model's logits, or None
        where it cannot be proven."""
        s, bounds, hns = self.screen(h)
        h = h.float()
        r = self.rounding
        out = []
        for i, (b, hn) in enumerate(zip(bounds, hns)):
            idx = self.candidates(s[i], b, hn)
            if idx is None or idx.numel() > self.max_candidates:
                return None
            if idx.numel() == 1:
                out.append(idx[0])
                continue
            # (k,) the candidates' logits in float64 from W's own rows (exact inputs; no matmul precision setting
            # reaches a float64 product), each within e = gamma_C(float64) |h| max|w| of the true one
            c = self.w.index_select(0, idx).double() @ h[i].double()
            best = torch.topk(c, 2)
            c0, c1 = best.values.tolist()
            m = (self.g_scale + self.e_scale) * hn  # the model's sums lie within G + e of these
            # its rounded logits: the leader's no lower than down(c0 - m), every other candidate's no higher than
            # up(c1 + m). In float32: a lead of more than 2 (G + e).
            if not (r.down(c0 - m) > r.up(c1 + m)):  # NaN fails too
                return None
            out.append(idx[best.indices[0]])
        return torch.stack(out)


class FastGreedyHead:
    """Which shortcut a model gets, when it may use one, and the one it keeps between calls."""

    @staticmethod
    def make(weight: torch.Tensor) -> ScreenedHead | TransposedHead:
        """The screen where oneDNN has packed bf16 kernels (a float16 weight gets nothing else: `usable`), else the
        transposed float32 product."""
        return ScreenedHead(weight) if ScreenedHead.available() else TransposedHead(weight)

    @staticmethod
    def for_model(model: CausalLM) -> ScreenedHead | TransposedHead:
        """The model's cached instance, rebuilt when the head weight changes (another tensor, or written in place).

        Kept on the model between calls, so only the first greedy call pays the copy (0.1-0.3 s for 124M).
        """
        w = model.head_weight
        key = (w.data_ptr(), w._version, tuple(w.shape), w.dtype)
        cached = model.__dict__.get("_fast_greedy_head")
        if cached is None or cached[0] != key:
            cached = (key, FastGreedyHead.make(w))
            model.__dict__["_fast_greedy_head"] = cached
        return cached[1]

    @staticmethod
    def usable(model: CausalLM) -> bool:
        """On the CPU, float32 (with float32 matmuls in float32: `cpu.float32_matmuls_exact`), or float16 (with
        float32 sums: `cpu.float16_sums_in_float32`) where the screen runs (`ScreenedHead.available`; bf16 logits
        round too coarsely for a screen to decide often, and the bf16 head reads no more bytes than the screen), a
        plain head, nothing recording, editing or hooking the forward (`intercepted`), inference (not in train mode,
        no gradient wanted: the copies are detached), and CPU autocast off (under it the head's logits are autocast's
        bf16/fp16 product, which neither proof describes)."""
        plain = model.lm_head is None or type(model.lm_head) is torch.nn.Linear
        f32 = model.dtype == torch.float32 and float32_matmuls_exact()  # else the model's logits are not float32's
        f16 = model.dtype == torch.float16 and float16_sums_in_float32() and ScreenedHead.available()
        dtype = (f32 or f16) and autocast_dtype("cpu") is None
        cpu = model.device.type == "cpu"
        return plain and cpu and dtype and not model.intercepted() and not model.wants_grad()
