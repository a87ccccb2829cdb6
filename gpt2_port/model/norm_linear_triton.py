"""A decode step's matmuls as Triton kernels, with the residual add and the layer norm before them: norm_linear.py's
kernels on CUDA.

Imported only where triton is (gpt2_port/gpu_kernel.py asks first). A few rows (B <= 4) times a weight, as a
matrix-vector product: each program reads a (BK, BN) tile of the weight at a time, for every row at once, and keeps
float32 products in a (BB, BK, BN) accumulator it sums once at the end. Where the rows come from (`IN`):

- 0, a tensor: the (B, K) rows as they are (the attention's output into c_proj, the GELU's into the MLP's c_proj);
- 1, a sum: x + d, both (B, K) tensors, rounded to their dtype as torch's add stores it, then the layer norm;
- 2, a sum with partials: x + (the P float32 partial sums of the projection before, summed in order, plus its bias,
  rounded to the dtype as that projection's matmul stores it), then the layer norm;
- 3, a lookup: the rows of the token and position embedding tables that xi and di name, added as in 1, then the norm.

With the norm (1-3) each program first reads its rows whole (K values each) for the mean and the variance, then again a
slice at a time, normalising and rounding each value to the dtype (what torch's layer norm stores) before its product:
so every program makes the same normalised rows, and the first stores the sum, the new residual stream. What the matmul
makes: the (B, N) output with the bias added to the float32 sums and, with `GELU`, the tanh GELU (as x * sigmoid(2 *
inner), the same function: (1 + tanh z) / 2 = sigmoid(2 z)), rounded once; or with `PARTIAL`, each program a slice of K
for a slice of N (grid (N / BN, SPLIT)), (SPLIT, B, N) float32 partial sums, the bias not added, for the next kernel to
sum (input 2 above, or `_add_norm`) in a fixed order: no atomics, the same bits every run. Loops have counts known when
compiling (K, N and the slice are constants: one compile per shape), and the loop over the tiles of K is unrolled: each
tile of the weight is asked for one or two tiles before it is multiplied (`ahead`), the first ones before the norm's
prologue, so that a program's reads are in flight together where one tile at a time would wait for memory once a tile (a
step's matmul takes microseconds: those waits are much of its time). No `from __future__ import annotations`: triton
reads the kernel's annotations (`tl.constexpr`) as objects.
"""

import torch
import triton
import triton.language as tl

from ..gpu_kernel import COMPILE_OPTIONS

# A one-token matmul reads its weight once, and a GPU reads at full speed only with many programs at work: at 32
# outputs a program 124M's c_attn would be 72 programs and c_fc 96, fewer than an H100's 132 SMs. At 16, 144 and 192
# (gpt2-xl's 300 and 400); a projection into the residual stream (768 outputs: 48 programs) is split over K until it
# has about TARGET_PROGRAMS, each slice's partial sums read again by every program of the next kernel (its norm's
# prologue), so at most MAX_SPLIT slices. Fixed numbers, not the GPU's: a split is a summation order, and the bits
# stay the same on every GPU.
BN = 16  # outputs a program makes
TILE = 4096  # rows x BK x BN: the accumulator's size (32 float32 a thread at 4 warps)
TARGET_PROGRAMS = 256
MAX_SPLIT = 4


def ahead(weight: torch.Tensor) -> int:
    """How many of the weight's tiles a program asks for before the one it multiplies (1 or 2): reads of 24 to 32 KiB
    in flight at once (a one-row tile is 8 KiB in 16 bits, 3 in flight; 16 KiB in float32, 2), where asking for one
    tile at a time waits for memory once a tile. Two ahead in float32 would take gpt2-xl's kernels to ptxas's 255
    registers a thread (python -m benchmarks.kernel_code prints what each compiles to)."""
    return 1 if weight.element_size() == 4 else 2


@triton.jit
def _residual(
    x_ptr,
    d_ptr,
    parts_ptr,
    pbias_ptr,
    xi_ptr,
    di_ptr,
    rows,
    cols,
    inside,
    B,
    K: tl.constexpr,
    P: tl.constexpr,
    IN: tl.constexpr,
):
    """(BB, len(cols)) float32 values of x + d, rounded to x's dtype (torch's add), for `rows` and `cols`."""
    if IN == 3:  # the tables' rows the ids name
        x_rows = tl.load(xi_ptr + rows, mask=rows < B, other=0)
        d_rows = tl.load(di_ptr + rows, mask=rows < B, other=0)
    else:
        x_rows = rows
        d_rows = rows
    x = tl.load(x_ptr + x_rows[:, None] * K + cols[None, :], mask=inside, other=0.0)
    if IN == 2:  # the partial sums in order, then the bias, rounded as the projection's matmul stores its output
        d = tl.zeros(inside.shape, dtype=tl.float32)
        for p in tl.static_range(P):
            d += tl.load(parts_ptr + (p * B + rows[:, None]) * K + cols[None, :], mask=inside, other=0.0)
        d = (d + tl.load(pbias_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
    else:
        d = tl.load(d_ptr + d_rows[:, None] * K + cols[None, :], mask=inside, other=0.0)
    return (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype).to(tl.float32)


@triton.jit
def _weight_tile(w_ptr, sw_n, sw_k, n_in, n, k0, wanted: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """The (BK, BN) tile of the weight at rows k0.. (its n columns), or nothing read where not `wanted` (a tile past
    the slice: the mask is false when compiling)."""
    k = k0 + tl.arange(0, BK)
    inside = ((k < K) & wanted)[:, None] & n_in[None, :]
    return tl.load(w_ptr + n[None, :] * sw_n + k[:, None] * sw_k, mask=inside, other=0.0)


def _norm_linear(
    x_ptr,
    d_ptr,
    parts_ptr,
    pbias_ptr,
    xi_ptr,
    di_ptr,
    lnw_ptr,
    lnb_ptr,
    eps,
    w_ptr,
    sw_n,
    sw_k,
    b_ptr,
    out_ptr,
    s_ptr,
    B,
    K: tl.constexpr,
    N: tl.constexpr,
    P: tl.constexpr,
    IN: tl.constexpr,
    GELU: tl.constexpr,
    PARTIAL: tl.constexpr,
    KS: tl.constexpr,
    BB: tl.constexpr,
    BK: tl.constexpr,
    BN: tl.constexpr,
    KB: tl.constexpr,
    AHEAD: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = tl.arange(0, BB)
    live = rows < B
    n = pid_n * BN + tl.arange(0, BN)
    n_in = n < N
    # the weight's first tiles asked for before anything else: their reads overlap the norm's below
    w0 = _weight_tile(w_ptr, sw_n, sw_k, n_in, n, pid_s * KS, True, K, BK)
    if AHEAD == 2:
        w1 = _weight_tile(w_ptr, sw_n, sw_k, n_in, n, pid_s * KS + BK, 1 < KS // BK, K, BK)
    if IN != 0:  # the rows whole: their sum's mean and variance (the first program stores the sum)
        cols = tl.arange(0, KB)
        whole = live[:, None] & (cols < K)[None, :]
        s = _residual(x_ptr, d_ptr, parts_ptr, pbias_ptr, xi_ptr, di_ptr, rows, cols, whole, B, K, P, IN)
        mean = tl.sum(s, axis=1) / K
        dev = tl.where(whole, s - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(dev * dev, axis=1) / K + eps)
        first = (rows * 0 + pid_n + pid_s) == 0  # (BB,): the first program's rows
        tl.store(s_ptr + rows[:, None] * K + cols[None, :], s.to(s_ptr.dtype.element_ty), mask=whole & first[:, None])
    acc = tl.zeros([BB, BK, BN], dtype=tl.float32)
    for t in tl.static_range(KS // BK):  # unrolled: tile t + AHEAD is asked for before tile t is used
        w_next = _weight_tile(w_ptr, sw_n, sw_k, n_in, n, pid_s * KS + (t + AHEAD) * BK, t + AHEAD < KS // BK, K, BK)
        k = pid_s * KS + t * BK + tl.arange(0, BK)
        k_in = k < K
        here = live[:, None] & k_in[None, :]  # (BB, BK)
        if IN == 0:
            h = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=here, other=0.0).to(tl.float32)
        else:  # this slice of the normalised rows, rounded as torch's layer norm stores them
            s_k = _residual(x_ptr, d_ptr, parts_ptr, pbias_ptr, xi_ptr, di_ptr, rows, k, here, B, K, P, IN)
            lw = tl.load(lnw_ptr + k, mask=k_in, other=0.0).to(tl.float32)
            lb = tl.load(lnb_ptr + k, mask=k_in, other=0.0).to(tl.float32)
            h = (s_k - mean[:, None]) * rstd[:, None] * lw[None, :] + lb[None, :]
            h = tl.where(here, h.to(lnw_ptr.dtype.element_ty).to(tl.float32), 0.0)
        acc += h[:, :, None] * w0.to(tl.float32)[None, :, :]  # (BB, BK, BN)
        if AHEAD == 2:
            w0 = w1
            w1 = w_next
        else:
            w0 = w_next
    y = tl.sum(acc, axis=1)  # (BB, BN)
    out_here = live[:, None] & n_in[None, :]
    if not PARTIAL:
        y += tl.load(b_ptr + n, mask=n_in, other=0.0).to(tl.float32)[None, :]
        if GELU:  # 0.5 y (1 + tanh(inner)) as y * sigmoid(2 inner), inner = sqrt(2 / pi) (y + 0.044715 y^3)
            t = 1.5957691216057308 * (y + 0.044715 * y * y * y)
            e = tl.exp(-tl.abs(t))  # at most 1: no overflow for any t
            y = y * tl.where(t >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        tl.store(out_ptr + rows[:, None] * N + n[None, :], y.to(out_ptr.dtype.element_ty), mask=out_here)
    else:
        tl.store(out_ptr + (pid_s * B + rows[:, None]) * N + n[None, :], y, mask=out_here)


def _add_norm(
    x_ptr,
    d_ptr,
    parts_ptr,
    pbias_ptr,
    lnw_ptr,
    lnb_ptr,
    eps,
    s_ptr,
    y_ptr,
    B,
    K: tl.constexpr,
    P: tl.constexpr,
    IN: tl.constexpr,
    BB: tl.constexpr,
    KB: tl.constexpr,
):
    """The sum of input 2 above (its partials) and its layer norm, stored (the step's last norm, ln_f, before the
    head)."""
    rows = tl.arange(0, BB)
    cols = tl.arange(0, KB)
    whole = (rows < B)[:, None] & (cols < K)[None, :]
    s = _residual(x_ptr, d_ptr, parts_ptr, pbias_ptr, x_ptr, x_ptr, rows, cols, whole, B, K, P, IN)
    mean = tl.sum(s, axis=1) / K
    dev = tl.where(whole, s - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(dev * dev, axis=1) / K + eps)
    w = tl.load(lnw_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    b = tl.load(lnb_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    at = rows[:, None] * K + cols[None, :]
    tl.store(s_ptr + at, s.to(s_ptr.dtype.element_ty), mask=whole)
    tl.store(y_ptr + at, (dev * rstd[:, None] * w[None, :] + b[None, :]).to(y_ptr.dtype.element_ty), mask=whole)


norm_linear_kernel = triton.jit(_norm_linear)
add_norm_kernel = triton.jit(_add_norm)


def _blocks(rows: int) -> tuple[int, int]:
    """(BB, BK) for `rows` rows: BB rows padded to a power of two, BK as many of K as keep the tile at TILE."""
    bb = triton.next_power_of_2(rows)
    return bb, max(16, TILE // (bb * BN))


def split_of(k: int, n: int, rows: int) -> tuple[int, int]:
    """(slices, values a slice) of K for an (n, k) projection made into partials: as many slices as bring its
    programs to about TARGET_PROGRAMS, at most MAX_SPLIT, each a whole number of BK steps, none empty."""
    bk = _blocks(rows)[1]
    steps = triton.cdiv(k, bk)
    want = min(MAX_SPLIT, steps, max(1, triton.cdiv(TARGET_PROGRAMS, triton.cdiv(n, BN))))
    ks = bk * triton.cdiv(steps, want)
    return triton.cdiv(k, ks), ks


def launch(
    mode: int,
    x: torch.Tensor,
    d: torch.Tensor | None,
    parts: torch.Tensor | None,
    pbias: torch.Tensor | None,
    rows: tuple[torch.Tensor, torch.Tensor] | None,
    norm: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gelu: bool,
    split: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One `_norm_linear` launch over B rows of width K (mode: IN above; x: (B, K) rows, or with mode 3 the (V, K)
    token table, d the (n_positions, K) position table and `rows` their (B,) ids; weight (N, K), any strides) ->
    (the (B, K) sum where there is a norm, else None; the (B, N) output, or with `split` (SPLIT, B, N) float32
    partial sums). `norm_linear_kernel` is looked up here at each call (a test may put triton's interpreter there)."""
    N, K = weight.shape
    B = rows[0].numel() if rows is not None else x.numel() // K
    bb, bk = _blocks(B)
    splits, ks = split_of(K, N, B) if split else (1, bk * triton.cdiv(K, bk))
    dev = weight.device
    if split:
        out = torch.empty(splits, B, N, dtype=torch.float32, device=dev)
    else:
        out = torch.empty(B, N, dtype=weight.dtype, device=dev)
    s = torch.empty(B, K, dtype=weight.dtype, device=dev) if mode else None
    xi, di = rows if rows is not None else (x, x)  # not read but with mode 3
    lnw, lnb = norm if norm is not None else (weight, weight)  # not read without a norm
    norm_linear_kernel[(triton.cdiv(N, BN), splits)](
        x,
        d if d is not None else x,
        parts if parts is not None else x,
        pbias if pbias is not None else x,
        xi,
        di,
        lnw,
        lnb,
        eps,
        weight,
        weight.stride(0),
        weight.stride(1),
        bias if bias is not None else weight,
        out,
        s if s is not None else out,
        B,
        K=K,
        N=N,
        P=parts.shape[0] if parts is not None else 1,
        IN=mode,
        GELU=gelu,
        PARTIAL=split,
        KS=ks,
        BB=bb,
        BK=bk,
        BN=BN,
        KB=triton.next_power_of_2(K),
        AHEAD=ahead(weight),
        num_warps=4,
        **COMPILE_OPTIONS,
    )
    return s, out


def launch_add_norm(
    x: torch.Tensor, parts: torch.Tensor, pbias: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, K) x plus the (P, B, K) partials and their bias -> (the sum, its layer norm), (B, K) each."""
    B, K = x.shape
    s = torch.empty_like(x)
    y = torch.empty_like(x)
    add_norm_kernel[(1,)](
        x,
        x,  # d: not read with partials
        parts,
        pbias,
        *norm,
        eps,
        s,
        y,
        B,
        K=K,
        P=parts.shape[0],
        IN=2,
        BB=triton.next_power_of_2(B),
        KB=triton.next_power_of_2(K),
        num_warps=4 if K <= 1024 else 8,
        **COMPILE_OPTIONS,
    )
    return s, y
