"""The random windows the training loop draws from a `.bin` token file (io/tokens.py reads and checks the file).

A batch is `batch` random windows, as the tutorials draw them: x = data[i:i+T], y = data[i+1:i+1+T], gathered on the
host and copied to the device from pinned memory without waiting (`Batches`).

One seeded `torch.Generator` draws the whole global batch of a step (micro-batches x processes x batch size offsets);
process r takes the slices that belong to it. The same seed therefore gives the same windows whatever the number of
processes and however the global batch is split into micro-steps, and the generator's state is the data position a
resume restores.
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from ..io.tokens import TokenFile, open_split

__all__ = ["Batches", "GlobalBatchSampler", "TokenFile", "open_split"]


class Batches:
    """Windows of a TokenFile on the training device: gathered on the host into pinned memory (CUDA) and copied with
    `non_blocking`, so the host gathers and queues it without waiting for the work already queued on the device (the
    copy itself runs after that work, on the same stream: a batch of 16 x 1025 ids is 131 kB, microseconds)."""

    def __init__(self, data: TokenFile, block_size: int, device: torch.device) -> None:
        self.data, self.block_size, self.device = data, block_size, device
        self.pin = device.type == "cuda"

    def get(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) offsets -> x, y (N, T) int64 on the device."""
        w = self.data.rows(offsets, self.block_size)  # (N, T+1)
        if self.pin:
            w = w.pin_memory()
        w = w.to(self.device, non_blocking=True)
        return w[:, :-1], w[:, 1:]

    def blank(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y (n, T) of token 0, laid out as `get` lays them out (views of one (n, T+1) tensor on the device): the
        shapes and strides a compiled step is specialised on, for a dry step that compiles what the real ones run."""
        w = torch.zeros(n, self.block_size + 1, dtype=torch.long, device=self.device)  # (n, T+1)
        return w[:, :-1], w[:, 1:]


class GlobalBatchSampler:
    """Random window offsets for one step: one generator draws the global batch, each process takes its share.

    The global batch is `grad_accum * world_size * batch_size` windows, drawn as one (grad_accum, world_size,
    batch_size) block: micro-step m of process r takes block[m, r]. 1 process with grad_accum 2 and 2 processes with
    grad_accum 1 thus see the same windows in the same global positions.
    """

    def __init__(self, n_tokens: int, block_size: int, batch_size: int, grad_accum: int, world_size: int, seed: int):
        if n_tokens < block_size + 1:
            raise UsageError(f"{n_tokens} tokens cannot hold one window of {block_size} + 1")
        self.high = n_tokens - block_size  # offsets in [0, n - T): the target window ends inside the data
        self.batch_size, self.grad_accum, self.world_size = batch_size, grad_accum, world_size
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (offsets (A, W, B), generator state before)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.world_size

    def _draw(self) -> torch.Tensor:
        shape = (self.grad_accum, self.world_size, self.batch_size)
        return torch.randint(self.high, shape, generator=self.generator)  # (A, W, B)

    def next_step(self, rank: int) -> torch.Tensor:
        """(grad_accum, batch_size) offsets this process uses for the next step (the others' are drawn too): the
        prefetched ones when `prefetch` drew them already."""
        offsets = self._pending[0] if self._pending is not None else self._draw()
        self._pending = None
        self.batches_drawn += 1
        return offsets[:, rank]  # (A, B)

    def prefetch(self, rank: int) -> torch.Tensor:
        """The next step's offsets for this process, drawn ahead (so its batch can be on its way to the device while
        this step finishes); `next_step` returns them. The data position (`state`) stays where it was until then."""
        if self._pending is None:
            before = self.generator.get_state()
            self._pending = (self._draw(), before)
        return self._pending[0][:, rank]

    def state(self) -> torch.Tensor:
        """The generator's state as of the steps taken (a prefetched draw not counted): what a resume restores."""
        return self._pending[1] if self._pending is not None else self.generator.get_state()

    def restore(self, state: torch.Tensor, batches_drawn: int) -> None:
        self.generator.set_state(state)
        self.batches_drawn, self._pending = batches_drawn, None
