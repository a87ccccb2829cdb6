"""A step's chosen tokens taken into the sequence, in one kernel on CUDA.

After each step's choice the loop stores each row's token in the sequence's next column (the padding for a row that
has ended), ends the rows that chose EOS, and puts the tokens and the step's status (finite or not) side by side in
one (B + 1,) tensor for the one transfer to the host a token: torch's where, ne, in-place and, and cat, four kernels
launched one by one outside the captured step. `take` makes them one (accept_triton.py) where `in_kernel` holds:
where gpt2_port/gpu_kernel.py lets a kernel run (CUDA, triton installed, not under torch.compile or autocast), (B,)
int64 choices, a () bool or int64 status, a contiguous (B,) bool mask of the running rows and an int64 column, all
on one device. Integer work only: the values are torch's ops' exactly, and the kernel's first result for a shape is
checked against theirs, which run instead where it disagrees or fails. The mask of running rows comes back as a new
tensor (the old one is left as it was: the repetition penalty reads it after, and the first-call check runs torch's
ops on the same inputs).

Given `feed` (a StaticKVCache and the column's slot: generate's static step), the kernel also sets the next step's
inputs as `StaticKVCache.feed` would (the token, the slot, its mask value and each row's position), which were four
more launches a token outside the captured step; torch's ops then call `feed`. Setting them is idempotent, so the
first-call check's torch's ops may set them again; the first result carries a copy of what the kernel set, compared
with what `feed` sets.
"""

from __future__ import annotations

import torch

from ..gpu_kernel import GpuKernel
from .cache import StaticKVCache

Taken = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the column (B,), the rows still running (B,), what to send
Feed = tuple[StaticKVCache, int]  # a static cache, and the slot whose step inputs to set
FED = ("tokens fed", "slot fed", "mask fed", "positions fed")


def _fed(feed: Feed | None) -> tuple[torch.Tensor, ...]:
    """Copies of the step inputs `feed` sets (none without it): what a first call compares."""
    if feed is None:
        return ()
    cache = feed[0]
    return tuple(t.clone() for t in (cache.tok, cache.slot, cache.bias, cache.pos))


def _agree(got: tuple, want: tuple) -> str | None:
    """The kernel's first result against torch's: the same tokens, rows and status, and step inputs, exactly."""
    names = ("tokens", "running rows", "values sent", *FED)[: len(want)]
    for name, g, w in zip(names, got, want, strict=True):
        if not torch.equal(g, w):
            return f"{name} {g.tolist()} where torch's ops give {w.tolist()}"
    return None


KERNEL = GpuKernel("the token-taking kernel", "torch's where, ne, and and cat", _agree)


def takes(
    choice: torch.Tensor,
    status: torch.Tensor,
    running: torch.Tensor,
    column: torch.Tensor,
    feed: Feed | None = None,
) -> bool:
    """The kernel's rules for its operands, the device aside (see the module docstring)."""
    B = choice.shape[0] if choice.dim() == 1 else -1
    tensors = [choice, status, running, column]
    if feed is not None:
        cache, at = feed
        if cache.tok.shape != (B, 1) or not 0 <= at < cache.bias.shape[1]:
            return False
        tensors.append(cache.bias)
    return (
        choice.dtype == torch.long
        and status.dim() == 0
        and status.dtype in (torch.bool, torch.long)
        and running.shape == (B,)
        and running.dtype == torch.bool
        and running.is_contiguous()
        and column.shape == (B,)
        and column.dtype == torch.long
        and len({t.device for t in tensors}) == 1
    )


def in_kernel(
    choice: torch.Tensor,
    status: torch.Tensor,
    running: torch.Tensor,
    column: torch.Tensor,
    feed: Feed | None = None,
) -> bool:
    """Whether `take` runs the kernel."""
    return KERNEL.may_run(choice) and takes(choice, status, running, column, feed)


def take(
    choice: torch.Tensor,
    status: torch.Tensor,
    running: torch.Tensor,
    pad: tuple[int, torch.Tensor],
    eos: int | None,
    column: torch.Tensor,
    feed: Feed | None = None,
) -> Taken:
    """(B,) choices, () status, (B,) bool running rows, the padding id (as a number, and as a () tensor on the device
    for torch.where), EOS (or None), the sequence's (B,) column -> (that column, written: each running row's choice,
    else the padding; the rows still running: those that did not choose EOS; (B + 1,) int64: the column's tokens, then
    the status), on the device, without a wait. `feed`: (a StaticKVCache, a slot) whose step inputs are set to the
    column's tokens at that slot (StaticKVCache.feed), or None."""
    pad, pad_id = pad
    if in_kernel(choice, status, running, column, feed):
        key = (choice.shape, status.dtype, eos is None, None if feed is None else feed[0].bias.dtype)
        got = KERNEL.run(
            choice,
            key,
            lambda: _kernel(choice, status, running, column, pad, eos, feed, key),
            lambda: _torch_ops(choice, status, running, pad_id, eos, column, feed) + _fed(feed),
        )
        return got[:3]
    return _torch_ops(choice, status, running, pad_id, eos, column, feed)


def _kernel(choice, status, running, column, pad, eos, feed, key) -> tuple:  # noqa: ANN001
    from .accept_triton import launch  # triton's import too: a failing one is the kernel's failure

    still, send = launch(choice, status, running, column, pad, eos, feed)
    if feed is not None:
        feed[0].fed = feed[1]
    # a first call's result is compared with torch's ops', which set the step inputs again: a copy of the kernel's
    return (column, still, send) + (_fed(feed) if KERNEL.checking(choice, key) else ())


def _torch_ops(
    choice: torch.Tensor,
    status: torch.Tensor,
    running: torch.Tensor,
    pad_id: torch.Tensor,
    eos: int | None,
    column: torch.Tensor,
    feed: Feed | None = None,
) -> Taken:
    nxt = torch.where(running, choice, pad_id, out=column)  # (B,) into its column: finished rows padded
    still = running & (nxt != eos) if eos is not None else running
    send = torch.cat([nxt, status.to(nxt.device, torch.long).view(1)])
    if feed is not None:
        feed[0].feed(nxt, feed[1])
    return nxt, still, send
