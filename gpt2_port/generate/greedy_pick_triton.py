"""A plain greedy choice as one Triton kernel: greedy_pick.py's kernel on CUDA.

Imported only where triton is (gpt2_port/gpu_kernel.py asks first). One program a row reads its logits once, BLOCK at a
time: the first index of the largest (torch.argmax's tie rule: the lower id), and whether every logit is finite; the
rows' flags meet in one value by an atomic minimum (1: all finite), or one row's is stored. The vocabulary is a constant
of the compiled kernel (one compile per head width; its loop then has a known count). No `from __future__ import
annotations`: triton reads the kernel's annotations (`tl.constexpr`) as objects.
"""

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits a loop step reads: 13 steps for GPT-2's 50,257


def _argmax_finite(x_ptr, out_ptr, stride, B, V: tl.constexpr, BLOCK: tl.constexpr, ATOMIC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([1], float("-inf"), dtype=tl.float32)
    best_at = tl.zeros([1], dtype=tl.int64)
    ok = tl.full([1], 1, dtype=tl.int64)
    for start in range(0, V, BLOCK):
        at = start + tl.arange(0, BLOCK)
        inside = at < V
        x = tl.load(x_ptr + row * stride + at, mask=inside, other=float("-inf")).to(tl.float32)  # exact: the same order
        ok = tl.minimum(ok, tl.min(tl.where(inside, (tl.abs(x) < float("inf")).to(tl.int64), 1), axis=0))
        m = tl.max(x, axis=0)
        better = m > best  # strictly: an equal value later in the row is a higher id, which argmax does not take
        best_at = tl.where(better, start + tl.argmax(x, axis=0).to(tl.int64), best_at)
        best = tl.where(better, m, best)
    tl.store(out_ptr + row + tl.arange(0, 1), best_at)
    if ATOMIC:  # the rows' flags meet in out[B], set to 1 before the launch
        tl.atomic_min(out_ptr + B + tl.arange(0, 1), ok)
    else:  # one row: its flag is the flag
        tl.store(out_ptr + B + tl.arange(0, 1), ok)


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
    argmax_finite_kernel[(B,)](logits, out, logits.stride(0), B, V=V, BLOCK=BLOCK, ATOMIC=B > 1, num_warps=8)
    return out[:B], out[B]
