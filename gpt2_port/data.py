"""Token corpora in nanoGPT's `.bin` format and the random windows the training loop draws from them.

A `.bin` file is a flat array of little-endian uint16 token ids with no header (nanoGPT's `prepare.py`, llm.c and
`gpt2-port prepare` write it). It is memory-mapped, never read whole. A batch is `batch` random windows, as the
tutorials draw them: x = data[i:i+T], y = data[i+1:i+1+T].

One seeded `torch.Generator` draws the whole global batch of a step (micro-batches x processes x batch size offsets);
process r takes the slices that belong to it. The same seed therefore gives the same windows whatever the number of
processes and however the global batch is split into micro-steps, and the generator's state is the data position a
resume restores.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .errors import UsageError

BIN_DTYPE = np.dtype("<u2")
_SCAN_CHUNK = 1 << 24  # ids checked per chunk when validating: 32 MB of uint16, bounded memory for any file size


class TokenFile:
    """A validated, memory-mapped `.bin` of token ids: every id < `vocab_size`, at least `min_tokens` of them."""

    def __init__(self, path: str | os.PathLike[str], vocab_size: int, min_tokens: int = 2) -> None:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"{p}: no such file (expected token ids as little-endian uint16, nanoGPT's .bin)")
        size = p.stat().st_size
        if size % BIN_DTYPE.itemsize:
            raise UsageError(f"{p}: {size} bytes is not a whole number of uint16 token ids (truncated?)")
        n = size // BIN_DTYPE.itemsize
        if n < min_tokens:
            raise UsageError(f"{p}: holds {n} tokens, fewer than the {min_tokens} one window needs (block size + 1)")
        self.path, self.vocab_size = p, vocab_size
        self.ids = np.memmap(p, dtype=BIN_DTYPE, mode="r", shape=(n,))
        self._check_ids()

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def _check_ids(self) -> None:
        """Every id must be a row of the embedding: the first one that is not is named with its offset."""
        V = self.vocab_size
        if V > int(np.iinfo(BIN_DTYPE).max):
            return  # every uint16 is in range
        for start in range(0, len(self), _SCAN_CHUNK):
            chunk = self.ids[start : start + _SCAN_CHUNK]
            if int(chunk.max()) >= V:
                i = int(np.argmax(chunk >= V))
                raise UsageError(
                    f"{self.path}: token id {int(chunk[i])} at offset {start + i} (byte {2 * (start + i)}) is not in "
                    f"the model's vocabulary of {V} (expected 0 <= id < {V}: was it encoded for another tokenizer?)"
                )

    def windows(self, offsets: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) start offsets -> x, y int64 (N, T): x = data[i:i+T], y = data[i+1:i+1+T]."""
        idx = offsets.numpy()[:, None] + np.arange(block_size + 1)[None, :]  # (N, T+1)
        w = torch.from_numpy(self.ids[idx].astype(np.int64))  # (N, T+1)
        return w[:, :-1], w[:, 1:]


def open_split(data_dir: str | os.PathLike[str], split: str, vocab_size: int, block_size: int) -> TokenFile:
    """DIR/{split}.bin, as `gpt2-port prepare` writes it; a missing file names what the directory should hold."""
    d = Path(data_dir)
    if not d.is_dir():
        raise UsageError(f"--data {d}: not a directory (expected the output of gpt2-port prepare: train.bin, val.bin)")
    f = d / f"{split}.bin"
    if not f.is_file():
        raise UsageError(f"--data {d}: no {split}.bin (expected the output of gpt2-port prepare: train.bin, val.bin)")
    return TokenFile(f, vocab_size, min_tokens=block_size + 1)


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

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.world_size

    def next_step(self, rank: int) -> torch.Tensor:
        """(grad_accum, batch_size) offsets this process uses for the next step (the others' are drawn too)."""
        shape = (self.grad_accum, self.world_size, self.batch_size)
        offsets = torch.randint(self.high, shape, generator=self.generator)  # (A, W, B)
        self.batches_drawn += 1
        return offsets[:, rank]  # (A, B)
