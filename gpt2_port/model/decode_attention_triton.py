"""A decode step's attention as one Triton kernel: decode_attention.py's kernel on CUDA.

Imported only where triton is (gpt2_port/gpu_kernel.py asks first). One program a (row, head): it stores the token's key
and value in their slot of the layer's cache, then attends its one query over the cache's slots up to that one with the
cache's additive mask (the slots after it are masked in a static cache, and not read), in blocks of BLOCK slots with a
running maximum (the online softmax), in float32, and rounds the output once to the inputs' dtype. A long cache with
few (row, head)s is split into spans of whole blocks, a program each (the one whose span holds the slot writes the
token's key and value), and a second kernel brings the spans' sums under one maximum and adds them in span order.
The cache's length is a constant of the compiled kernel (one compile per length: a static cache's are multiples of
64, cache.static_len); the blocks after the slot's (read on the device: a CUDA graph's replays each take their own)
are skipped. No `from __future__ import annotations`: triton reads the kernel's annotations (`tl.constexpr`) as
objects.
"""

import torch
import triton
import triton.language as tl

from ..gpu_kernel import COMPILE_OPTIONS

BLOCK = 64  # slots a loop step reads: a static cache holds a multiple of 64 (cache.STATIC_LEN_MULTIPLE)
# A long cache is split over several programs a (row, head) when there are few (row, head)s: one program a head reads
# its head's keys and values block after block, a wait for memory each, on one of the GPU's SMs (124M at batch 1: 12
# programs, 12 of an H100's 132 SMs, 16 blocks in turn at a full 1,024-slot cache). Split, each program attends over
# a span of the cache and a second kernel combines the spans' sums (flash-decoding). Splits are made up to about
# TARGET_PROGRAMS programs, for caches of at least MIN_SPLIT_BLOCKS blocks: the combine is one more launch a block,
# which a short cache's few blocks do not repay.
TARGET_PROGRAMS = 128
MIN_SPLIT_BLOCKS = 8


def splits(rows_heads: int, L: int, split: bool = True) -> tuple[int, int]:
    """(programs a (row, head), slots each one attends over: a multiple of BLOCK) for `rows_heads` (row, head)s over
    a cache of L slots; one program a (row, head) where not `split`."""
    blocks = triton.cdiv(L, BLOCK)
    split = min(blocks, TARGET_PROGRAMS // rows_heads) if split and blocks >= MIN_SPLIT_BLOCKS else 1
    per = triton.cdiv(blocks, max(split, 1))  # blocks a program
    return triton.cdiv(blocks, per), per * BLOCK


@triton.jit
def _block(keys, values, bias_row, d, start, slot, end, L: tl.constexpr, HS: tl.constexpr, BLOCK: tl.constexpr):
    """The (BLOCK, HS) keys and values and the (BLOCK,) mask of the slots from `start`, as stored; the slots after
    `slot`, from `end` on (the next program's span) or past the cache not read: zeros, and -inf in the mask."""
    at = start + tl.arange(0, BLOCK)
    live = (at < L) & (at < end) & (at <= slot)
    grid = at[:, None] * HS + d[None, :]  # (BLOCK, HS)
    k = tl.load(keys + grid, mask=live[:, None], other=0.0)
    v = tl.load(values + grid, mask=live[:, None], other=0.0)
    return k, v, tl.load(bias_row + at, mask=live, other=float("-inf"))


def _decode_attention(
    q_ptr,
    kv_ptr,
    cache_ptr,
    bias_ptr,
    slot_ptr,
    out_ptr,
    part_ptr,
    stats_ptr,
    sq_b,
    sq_h,
    sq_d,
    skv_j,
    skv_b,
    skv_h,
    skv_d,
    B,
    NH,
    scale,
    L: tl.constexpr,
    HS: tl.constexpr,
    BLOCK: tl.constexpr,
    SPAN: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // NH
    h = pid % NH
    lo = tl.program_id(1) * SPAN  # this program's slots: [lo, lo + SPAN)
    d = tl.arange(0, HS)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + d * sq_d).to(tl.float32)  # (HS,)
    slot = tl.load(slot_ptr)
    keys = cache_ptr + (b * NH + h) * L * HS  # this row's and head's (L, HS) keys, then its values B * NH later
    values = cache_ptr + ((B + b) * NH + h) * L * HS
    mine = d < tl.where((slot >= lo) & (slot < lo + SPAN), HS, 0)  # (HS,): the token's slot is in this span
    tl.store(keys + slot * HS + d, tl.load(kv_ptr + b * skv_b + h * skv_h + d * skv_d), mask=mine)
    tl.store(values + slot * HS + d, tl.load(kv_ptr + skv_j + b * skv_b + h * skv_h + d * skv_d), mask=mine)
    tl.debug_barrier()  # the slot just written is read back below, by other threads of this program
    m = tl.zeros([1], dtype=tl.float32) - 1.0e30  # the running maximum (finite: a block all masked gives 0, not NaN)
    total = tl.zeros([1], dtype=tl.float32)  # the running sum of exp(score - m)
    acc = tl.zeros([HS], dtype=tl.float32)  # the running sum of exp(score - m) * value
    # the span's blocks up to the token's slot: those after it are masked (a static cache's mask holds -inf there), so
    # not read, and a step takes as many blocks as its position needs, not the cache's length (a masked block would
    # add exp(-inf) = 0 to the sums and leave the maximum: the same values). A later block is a test and a branch.
    # Each block's keys, values and mask are asked for while the block before it is worked on (none past the slot or
    # the span is read).
    end = lo + SPAN
    k_next, v_next, b_next = _block(keys, values, bias_ptr + b * L, d, lo, slot, end, L, HS, BLOCK)
    for i in range(SPAN // BLOCK):
        start = lo + i * BLOCK
        k, v, bias = k_next, v_next, b_next
        k_next, v_next, b_next = _block(keys, values, bias_ptr + b * L, d, start + BLOCK, slot, end, L, HS, BLOCK)
        if start <= slot:
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale + bias.to(tl.float32)  # (BLOCK,)
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp(s - m_new)  # (BLOCK,): 0 where masked
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            m = m_new
    if SPLIT == 1:
        tl.store(out_ptr + (b * NH + h) * HS + d, (acc / total).to(out_ptr.dtype.element_ty))
    else:  # the span's sums for the combine: (B * NH, SPLIT, HS) and (B * NH, SPLIT, 2) float32
        at = pid * SPLIT + tl.program_id(1)
        tl.store(part_ptr + at * HS + d, acc)
        tl.store(stats_ptr + at * 2 + tl.arange(0, 1), m)
        tl.store(stats_ptr + at * 2 + 1 + tl.arange(0, 1), total)


def _attention_combine(part_ptr, stats_ptr, out_ptr, HS: tl.constexpr, SPLIT: tl.constexpr, SB: tl.constexpr):
    """One program a (row, head): its SPLIT spans' sums, each under its own maximum, brought under the largest and
    added in span order (the same bits every run), the output rounded once."""
    pid = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SB)
    live = sp < SPLIT
    at = pid * SPLIT + sp  # (SB,)
    m = tl.load(stats_ptr + at * 2, mask=live, other=-1.0e30)  # a span past the slot: -1e30 and sums of 0
    total = tl.load(stats_ptr + at * 2 + 1, mask=live, other=0.0)
    d = tl.arange(0, HS)
    acc = tl.load(part_ptr + at[:, None] * HS + d[None, :], mask=live[:, None], other=0.0)  # (SB, HS)
    top = tl.max(m, axis=0)
    w = tl.exp(m - top)  # (SB,): 0 for a span with no slot attended
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * total, axis=0)
    tl.store(out_ptr + pid * HS + d, out.to(out_ptr.dtype.element_ty))


decode_attention_kernel = triton.jit(_decode_attention)
combine_kernel = triton.jit(_attention_combine)


def launch(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: torch.Tensor,
    bias: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    split: bool = True,
) -> torch.Tensor:
    """q (B, nh, 1, hs) and the token's kv (2, B, nh, 1, hs), any strides; the layer's contiguous cache (2, B, nh, L,
    hs) and its (B, L) additive mask, all of one dtype; slot (1,) -> (B, nh, 1, hs) attention output (a transposed
    view of a (B, 1, nh, hs) tensor: heads side by side once transposed back). The cache's slot is written. A long
    cache with few (row, head)s is split (`splits`; not where `split` is False): then a second kernel combines the
    spans. `decode_attention_kernel`
    and `combine_kernel` are looked up here at each call (a test may put triton's interpreter there)."""
    B, nh, _, hs = q.shape
    L = layer.shape[3]
    split, span = splits(B * nh, L, split)
    out = torch.empty(B, 1, nh, hs, dtype=q.dtype, device=q.device)
    part = stats = out  # not written when not split
    if split > 1:
        part = torch.empty(B * nh, split, hs, dtype=torch.float32, device=q.device)
        stats = torch.empty(B * nh, split, 2, dtype=torch.float32, device=q.device)
    decode_attention_kernel[(B * nh, split)](
        q,
        kv,
        layer,
        bias,
        slot,
        out,
        part,
        stats,
        q.stride(0),
        q.stride(1),
        q.stride(3),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(4),
        B,
        nh,
        scale,
        L=L,
        HS=hs,
        BLOCK=BLOCK,
        SPAN=span,
        SPLIT=split,
        num_warps=4,
        **COMPILE_OPTIONS,
    )
    if split > 1:
        SB = triton.next_power_of_2(split)
        combine_kernel[(B * nh,)](part, stats, out, HS=hs, SPLIT=split, SB=SB, num_warps=2, **COMPILE_OPTIONS)
    return out.transpose(1, 2)  # (B, nh, 1, hs)
