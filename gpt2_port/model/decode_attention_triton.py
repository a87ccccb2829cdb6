"""A decode step's attention as one Triton kernel: decode_attention.py's kernel on CUDA.

Imported only where triton is (gpt2_port/gpu_kernel.py asks first). One program a (row, head): it stores the token's key
and value in their slot of the layer's cache, then attends its one query over the cache's slots up to that one with the
cache's additive mask (the slots after it are masked in a static cache, and not read), in blocks of BLOCK slots with a
running maximum (the online softmax), in float32, and rounds the output once to the inputs' dtype. The cache's length is
a constant of the compiled kernel (one compile per length: a static cache's are multiples of 64, cache.static_len); the
blocks after the slot's (read on the device: a CUDA graph's replays each take their own) are skipped. No `from
__future__ import annotations`: triton reads the kernel's annotations (`tl.constexpr`) as objects.
"""

import torch
import triton
import triton.language as tl

from ..gpu_kernel import COMPILE_OPTIONS

BLOCK = 64  # slots a loop step reads: a static cache holds a multiple of 64 (cache.STATIC_LEN_MULTIPLE)


@triton.jit
def _block(keys, values, bias_row, d, start, slot, L: tl.constexpr, HS: tl.constexpr, BLOCK: tl.constexpr):
    """The (BLOCK, HS) keys and values and the (BLOCK,) mask of the slots from `start`, as stored; the slots after
    `slot` (or past the cache) not read: zeros, and -inf in the mask."""
    at = start + tl.arange(0, BLOCK)
    live = (at < L) & (at <= slot)
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
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // NH
    h = pid % NH
    d = tl.arange(0, HS)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + d * sq_d).to(tl.float32)  # (HS,)
    slot = tl.load(slot_ptr)
    keys = cache_ptr + (b * NH + h) * L * HS  # this row's and head's (L, HS) keys, then its values B * NH later
    values = cache_ptr + ((B + b) * NH + h) * L * HS
    tl.store(keys + slot * HS + d, tl.load(kv_ptr + b * skv_b + h * skv_h + d * skv_d))
    tl.store(values + slot * HS + d, tl.load(kv_ptr + skv_j + b * skv_b + h * skv_h + d * skv_d))
    tl.debug_barrier()  # the slot just written is read back below, by other threads of this program
    m = tl.zeros([1], dtype=tl.float32) - 1.0e30  # the running maximum (finite: a block all masked gives 0, not NaN)
    total = tl.zeros([1], dtype=tl.float32)  # the running sum of exp(score - m)
    acc = tl.zeros([HS], dtype=tl.float32)  # the running sum of exp(score - m) * value
    # the blocks up to the token's slot: those after it are masked (a static cache's mask holds -inf there), so not
    # read, and a step takes as many blocks as its position needs, not the cache's length (a masked block would add
    # exp(-inf) = 0 to the sums and leave the maximum: the same values). A later block is a test and a branch. Each
    # block's keys, values and mask are asked for while the block before it is worked on (none past the slot is read).
    k_next, v_next, b_next = _block(keys, values, bias_ptr + b * L, d, 0, slot, L, HS, BLOCK)
    for start in range(0, L, BLOCK):
        k, v, bias = k_next, v_next, b_next
        k_next, v_next, b_next = _block(keys, values, bias_ptr + b * L, d, start + BLOCK, slot, L, HS, BLOCK)
        if start <= slot:
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale + bias.to(tl.float32)  # (BLOCK,)
            m_new = tl.maximum(m, tl.max(s, axis=0))
            p = tl.exp(s - m_new)  # (BLOCK,): 0 where masked
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            m = m_new
    tl.store(out_ptr + (b * NH + h) * HS + d, (acc / total).to(out_ptr.dtype.element_ty))


decode_attention_kernel = triton.jit(_decode_attention)


def launch(
    q: torch.Tensor, kv: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor, slot: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (B, nh, 1, hs) and the token's kv (2, B, nh, 1, hs), any strides; the layer's contiguous cache (2, B, nh, L,
    hs) and its (B, L) additive mask, all of one dtype; slot (1,) -> (B, nh, 1, hs) attention output (a transposed
    view of a (B, 1, nh, hs) tensor: heads side by side once transposed back). The cache's slot is written.
    `decode_attention_kernel` is looked up here at each call (a test may put triton's interpreter there)."""
    B, nh, _, hs = q.shape
    L = layer.shape[3]
    out = torch.empty(B, 1, nh, hs, dtype=q.dtype, device=q.device)
    decode_attention_kernel[(B * nh,)](
        q,
        kv,
        layer,
        bias,
        slot,
        out,
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
        num_warps=4,
        **COMPILE_OPTIONS,
    )
    return out.transpose(1, 2)  # (B, nh, 1, hs)
