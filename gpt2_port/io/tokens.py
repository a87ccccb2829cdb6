"""Token corpora in nanoGPT's `.bin` format: a flat array of little-endian uint16 token ids with no header
(nanoGPT's `prepare.py`, llm.c and `gpt2-port prepare` write it), with `gpt2-port prepare`'s meta.json beside it.

A file is memory-mapped, never read whole, and checked once where it enters: its size against the token count and
dtype meta.json records (when `prepare` wrote one), its values against the model's vocabulary, and, without a
meta.json, for the signs of ids written in another dtype (int32, int64, float32), which would otherwise read as valid
uint16 ids and train on garbage. Training (train/data.py) and evaluation (eval/perplexity.py) read it through here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UsageError

BIN_DTYPE = np.dtype("<u2")
META_FILE = "meta.json"
_SCAN_CHUNK = 1 << 24  # ids checked per chunk when validating: 32 MB of uint16, bounded memory for any file size
_SNIFF = 1 << 16  # uint16 values looked at for the signs of another dtype


def _other_dtype(ids: np.ndarray) -> str | None:
    """What a file of uint16 values `ids` (its start) looks like when it is not uint16 token ids, or None.

    Little-endian int32 ids below 65536 leave every second uint16 zero (int64: three of four); float32 ids put each
    value's sign, exponent and top mantissa bits in every second uint16, which for the whole numbers 1..65535 lies in
    0x3F80..0x477F (0.0 gives 0); float64 does the same in every fourth, in 0x3FF0..0x40EF. Real GPT-2 text has none of
    these patterns over thousands of tokens."""
    n = len(ids) - len(ids) % 4
    if n < 64:
        return None
    v = ids[:n].astype(np.int64)
    hi2, hi4 = v[1::2], v[3::4]
    if not v[1::4].any() and not v[2::4].any() and not hi4.any() and v[0::4].any():
        return "int64 (8 bytes per id: three of every four uint16 values are 0)"
    if not hi2.any() and v[0::2].any():
        return "int32 (4 bytes per id: every second uint16 value is 0)"
    if (((hi4 >= 0x3FF0) & (hi4 < 0x40F0)) | (hi4 == 0)).all() and hi4.any():
        return "float64 (8 bytes per id: every fourth uint16 value is a float's exponent)"
    if (((hi2 >= 0x3F80) & (hi2 < 0x4780)) | (hi2 == 0)).all() and hi2.any():
        return "float32 (4 bytes per id: every second uint16 value is a float's exponent)"
    return None


def read_meta(data_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """DIR/meta.json as `gpt2-port prepare` writes it, or None when there is none."""
    meta = Path(data_dir) / META_FILE
    if not meta.is_file():
        return None
    try:
        m = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(
            f"{meta}: not readable JSON ({e.__class__.__name__}: {e}); expected prepare's meta.json"
        ) from None
    if not isinstance(m, dict):
        raise UsageError(f"{meta}: a JSON {type(m).__name__}, expected prepare's meta.json (an object)")
    return m


def _meta_tokens(path: Path) -> tuple[int, str] | None:
    """(token count, dtype) that the meta.json `prepare` wrote beside `path` records for it, or None (no meta.json,
    or one that says nothing about this file)."""
    m = read_meta(path.parent)
    n = None if m is None else m.get(f"{path.name.removesuffix('.bin')}_tokens")
    if not isinstance(n, int) or isinstance(n, bool):
        return None
    return n, str(m.get("dtype", "uint16"))  # type: ignore[union-attr]


class TokenFile:
    """A validated, memory-mapped `.bin` of token ids: every id < `vocab_size`, at least `min_tokens` of them."""

    def __init__(self, path: str | os.PathLike[str], vocab_size: int, min_tokens: int = 2, also: str = "") -> None:
        """`also`: one more way out, named beside a smaller block size and more text when the file is too short."""
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"{p}: no such file (expected token ids as little-endian uint16, nanoGPT's .bin)")
        size = p.stat().st_size
        recorded = _meta_tokens(p)
        if recorded is not None:
            n_meta, dt = recorded
            if dt != "uint16":
                raise UsageError(f"{p}: {META_FILE} says the ids are {dt}; expected uint16 (nanoGPT's .bin)")
            if size != 2 * n_meta:
                per = size / n_meta if n_meta else float("nan")
                like = {4.0: ", as int32 or float32 ids would", 8.0: ", as int64 or float64 ids would"}.get(per, "")
                raise UsageError(
                    f"{p}: {size:,} bytes, but {META_FILE} says {n_meta:,} uint16 tokens ({2 * n_meta:,} bytes): "
                    f"{per:g} bytes per token{like}; expected the file gpt2-port prepare wrote (run it again)"
                )
        if size % BIN_DTYPE.itemsize:
            raise UsageError(f"{p}: {size} bytes is not a whole number of uint16 token ids (truncated?)")
        n = size // BIN_DTYPE.itemsize
        if n == 0:
            raise UsageError(f"{p}: holds 0 tokens; expected more text (gpt2-port prepare)")
        if n < min_tokens:
            fixes = [f"a --block-size of at most {n - 1}"] if n > 1 else []
            fixes += [also] if also else []
            fixes.append("more text (gpt2-port prepare)")
            raise UsageError(
                f"{p}: holds {n} tokens, fewer than the {min_tokens} one window needs (block size + 1); expected "
                + (f"{', '.join(fixes[:-1])} or {fixes[-1]}" if len(fixes) > 1 else fixes[0])
            )
        self.path, self.vocab_size = p, vocab_size
        self.ids = np.memmap(p, dtype=BIN_DTYPE, mode="r", shape=(n,))
        if recorded is None:
            other = _other_dtype(np.asarray(self.ids[:_SNIFF]))
            if other is not None:
                raise UsageError(
                    f"{p}: looks like token ids written as {other}, not uint16; expected little-endian uint16 ids "
                    f"as gpt2-port prepare and nanoGPT write them (np.array(ids, dtype=np.uint16).tofile(path))"
                )
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

    def chunks(self, size: int = 1 << 20) -> Iterator[list[int]]:
        """Every id in order, `size` at a time (for evaluation: the file is never held whole)."""
        for start in range(0, len(self), size):
            yield self.ids[start : start + size].tolist()

    def windows(self, offsets: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) start offsets -> x, y int64 (N, T): x = data[i:i+T], y = data[i+1:i+1+T]."""
        w = self.rows(offsets, block_size)
        return w[:, :-1], w[:, 1:]

    def rows(self, offsets: torch.Tensor, block_size: int) -> torch.Tensor:
        """(N,) start offsets -> (N, T+1) int64: each window with its next token."""
        idx = offsets.numpy()[:, None] + np.arange(block_size + 1)[None, :]  # (N, T+1)
        return torch.from_numpy(self.ids[idx].astype(np.int64))


def open_split(
    data_dir: str | os.PathLike[str], split: str, vocab_size: int, block_size: int, optional: bool = False
) -> TokenFile:
    """DIR/{split}.bin, as `gpt2-port prepare` writes it; a missing file names what the directory should hold.
    `optional`: the caller runs without the file too (train without val.bin), a way out a short file names."""
    d = Path(data_dir)
    if not d.is_dir():
        raise UsageError(f"--data {d}: not a directory (expected the output of gpt2-port prepare: train.bin, val.bin)")
    f = d / f"{split}.bin"
    if not f.is_file():
        raise UsageError(f"--data {d}: no {split}.bin (expected the output of gpt2-port prepare: train.bin, val.bin)")
    also = f"no {split}.bin (training without a validation loss)" if optional else ""
    return TokenFile(f, vocab_size, min_tokens=block_size + 1, also=also)
