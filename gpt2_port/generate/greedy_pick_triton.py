"""A plain greedy choice as one Triton kernel: greedy_pick.py's kernel on CUDA.

Imported only where triton is (gpt2_port/gpu_kernel.py asks first). One program a row reads its logits once, BLOCK at a
time: the first index of the largest (torch.argmax's tie rule: the lower id), and whether every logit is finite; the
rows' flags meet in one value by an atomic minimum (1: all finite), or one row's is stored. The vocabulary is a constant
of the compiled kernel (one compile per head width): the loop over its blocks is unrolled and each lane keeps its own
largest value, so the blocks' reads are all asked for at once and the lanes meet once, at the end. No `from __future__
import annotations`: triton reads the kernel's annotations (`tl.constexpr`) as objects.
"""

import torch
import triton
import triton.language as tl

from ..gpu_kernel import COMPILE_OPTIONS

BLOCK = 4096  # logits a lane group reads at once: 13 blocks for GPT-2's 50,257


def _argmax_finite(x_ptr, out_ptr, stride, B, V: tl.constexpr, BLOCK: tl.constexpr, ATOMIC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    # each lane's largest value over the blocks, the first id where it stands (a later equal value is a higher id) and
    # whether all its values are finite: elementwise, so no block waits for another's reads (the loop is unrolled)
    best = tl.load(x_ptr + row * stride + lane, mask=lane < V, other=float("-inf")).to(tl.float32)  # exact
    best_at = lane.to(tl.int64)
    ok = (tl.abs(best) < float("inf")) | (lane >= V)
    for t in tl.static_range(1, (V + BLOCK - 1) // BLOCK):
        at = t * BLOCK + lane
        inside = at < V
        x = tl.load(x_ptr + row * stride + at, mask=inside, other=float("-inf")).to(tl.float32)
        ok = ok & ((tl.abs(x) < float("inf")) | ~inside)
        better = x > best
        best_at = tl.where(better, at.to(tl.int64), best_at)
        best = tl.where(better, x, best)
    m = tl.max(best, axis=0)
    first = tl.min(tl.where(best == m, best_at, V), axis=0)  # the lowest id of the largest: torch.argmax's tie rule
    first = tl.where(first < V, first, 0)  # a NaN matches nothing (the flag says so): an id in range all the same
    flag = tl.min(ok.to(tl.int64), axis=0)
    tl.store(out_ptr + row + tl.arange(0, 1), first + tl.zeros([1], dtype=tl.int64))
    if ATOMIC:  # the rows' flags meet in out[B], set to 1 before the launch
        tl.atomic_min(out_ptr + B + tl.arange(0, 1), flag + tl.zeros([1], dtype=tl.int64))
    else:  # one row: its flag is the flag
        tl.store(out_ptr + B + tl.arange(0, 1), flag + tl.zeros([1], dtype=tl.int64))


argmax_finite_kernel = triton.jit(_argmax_finite)


def launch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) logits, unit stride along V -> ((B,) int64 argmax, () int64 1 if every logit is finite else 0): views
    of one (B + 1,) tensor, the ids then the flag, as the decode loop sends them to the host (no cast, and for one row
    no fill either). `argmax_finite_kernel` is looked up here at each call (a test may put triton's interpreter
    there)."""
    B, V = logits.shape
    out = torch.empty(B + 1, dtype=torch.long, device=logits.device)
    if B > 1:
        out[B] = 1
    argmax_finite_kernel[(B,)](
        logits, out, logits.stride(0), B, V=V, BLOCK=BLOCK, ATOMIC=B > 1, num_warps=8, **COMPILE_OPTIONS
    )
    return out[:B], out[B]
