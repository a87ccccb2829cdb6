"""A chosen token taken into the sequence as one Triton kernel: accept.py's kernel on CUDA.

Imported only where triton is (gpt2_port/gpu_kernel.py asks first). One program for all rows (B <= BLOCK): each row's
token where it still runs, else the padding, stored in its column of the sequence and in the first B values of the
(B + 1,) tensor for the host, the step's status (a bool or an integer) after them as an int64; the rows still running
after it (those that did not choose EOS) stored as a new mask. With FEED, the next decode step's inputs set too, as
StaticKVCache.feed sets them: each row's token, its slot's mask value 0, its position (its origin plus the slot), and
the slot itself. Integers and bools only (the mask's 0 aside, exact in every dtype): the values are torch's exactly.
The slot is not specialised on (triton compiles a kernel of its own for an integer argument of 1 and for multiples
of 16: three compiles in the middle of a generation). No `from __future__ import annotations`: triton reads the
kernel's annotations (`tl.constexpr`) as objects.
"""

import torch
import triton
import triton.language as tl

from ..gpu_kernel import COMPILE_OPTIONS


def _accept(
    choice_ptr,
    s_choice,
    status_ptr,
    running_ptr,
    column_ptr,
    s_column,
    still_ptr,
    send_ptr,
    tok_ptr,
    slot_ptr,
    bias_ptr,
    s_bias,
    origin_ptr,
    pos_ptr,
    at,
    pad,
    eos,
    B,
    EOS: tl.constexpr,
    FEED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.arange(0, BLOCK)
    live = r < B
    choice = tl.load(choice_ptr + r * s_choice, mask=live, other=0)
    running = tl.load(running_ptr + r, mask=live, other=0) != 0
    nxt = tl.where(running, choice, pad)
    tl.store(column_ptr + r * s_column, nxt, mask=live)
    tl.store(send_ptr + r, nxt, mask=live)
    if EOS:
        running = running & (nxt != eos)
    tl.store(still_ptr + r, running, mask=live)
    status = tl.load(status_ptr + tl.arange(0, 1)).to(tl.int64)
    tl.store(send_ptr + B + tl.arange(0, 1), status)
    if FEED:  # the next step's inputs: tok (B, 1), bias (B, slots), origin and pos (B, 1), slot (1,)
        tl.store(tok_ptr + r, nxt, mask=live)
        tl.store(bias_ptr + r * s_bias + at, tl.zeros([BLOCK], bias_ptr.dtype.element_ty), mask=live)
        origin = tl.load(origin_ptr + r, mask=live, other=0)
        tl.store(pos_ptr + r, origin + at, mask=live)
        tl.store(slot_ptr + tl.arange(0, 1), tl.zeros([1], tl.int64) + at)


accept_kernel = triton.jit(_accept, do_not_specialize=["at"])


def launch(
    choice: torch.Tensor,
    status: torch.Tensor,
    running: torch.Tensor,
    column: torch.Tensor,
    pad: int,
    eos: int | None,
    feed: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) int64 choice (any stride), () status, (B,) bool running rows (contiguous), the sequence's (B,) int64 column
    (any stride, written), and `feed`: None, or (a StaticKVCache, the slot) whose step inputs to set -> (the rows
    still running, (B + 1,) int64 tokens then status). `accept_kernel` is looked up here at each call (a test may put
    triton's interpreter there)."""
    B = choice.shape[0]
    still = torch.empty_like(running)
    send = torch.empty(B + 1, dtype=torch.long, device=choice.device)
    if feed is None:
        inputs, s_bias, at = (send,) * 5, 0, 0  # not read: FEED is off
    else:
        cache, at = feed
        inputs, s_bias = (cache.tok, cache.slot, cache.bias, cache.origin, cache.pos), cache.bias.stride(0)
    tok, slot, bias, origin, pos = inputs
    accept_kernel[(1,)](
        choice,
        choice.stride(0),
        status,
        running,
        column,
        column.stride(0),
        still,
        send,
        tok,
        slot,
        bias,
        s_bias,
        origin,
        pos,
        at,
        pad,
        -1 if eos is None else eos,
        B,
        EOS=eos is not None,
        FEED=feed is not None,
        BLOCK=max(16, triton.next_power_of_2(B)),
        num_warps=1 if B <= 256 else 4,
        **COMPILE_OPTIONS,
    )
    return still, send
