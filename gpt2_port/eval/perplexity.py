"""Perplexity and bits per byte of a text, or of a prepared `.bin` split, as lm-evaluation-harness computes them.

`loglikelihood_rolling` windows (or the strided window of the transformers docs) over a stream of tokens; perplexity
per token, bits per byte and byte perplexity over the UTF-8 bytes, word perplexity over len(re.split(r"\\s+", text))
words. A text file's bytes and words are counted as it is read; a `.bin` split's come from the meta.json
`gpt2-port prepare` wrote (its text is not there to count). Memory stays flat as the input grows: text is read and
encoded in blocks (io/text.py), a `.bin` is memory-mapped, and only one batch of windows is held.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..io.text import READ_BYTES, TextStats, read_text_pieces
from ..io.tokens import TokenFile, open_split, read_meta
from .score import DEFAULT_BATCH_SIZE, Scorer, batched, check_batch_size, score_batch
from .windows import Request, rolling_requests, strided_requests, token_chunks


def _ratio(f: Callable[[], float], known: bool) -> float | None:
    return f() if known else None


@dataclass
class TextResult:
    tokens: int = 0
    nll: float = 0.0
    bytes: int | None = 0  # None: not known (a .bin whose meta.json does not record its text's size)
    words: int | None = 0
    window_nll: list[float] = field(default_factory=list)  # per window, in order (for the parity check)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def bits_per_byte(self) -> float | None:
        return _ratio(lambda: self.nll / self.bytes / math.log(2), bool(self.bytes))  # type: ignore[operator]

    @property
    def byte_perplexity(self) -> float | None:
        return _ratio(lambda: math.exp(self.nll / self.bytes), bool(self.bytes))  # type: ignore[operator]

    @property
    def word_perplexity(self) -> float | None:
        return _ratio(lambda: math.exp(self.nll / self.words), bool(self.words))  # type: ignore[operator]

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "nll": self.nll,
            "perplexity": self.perplexity,
            "bytes": self.bytes,
            "bits_per_byte": self.bits_per_byte,
            "byte_perplexity": self.byte_perplexity,
            "words": self.words,
            "word_perplexity": self.word_perplexity,
            "windows": len(self.window_nll),
        }


def check_text_file(path: str | os.PathLike[str]) -> int:
    """Fail before any work on a missing, empty or non-UTF-8 file; return its size in bytes."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--text {p}: no such file (expected a UTF-8 text file)")
    size = p.stat().st_size
    if size == 0:
        raise UsageError(f"--text {p}: the file is empty (expected some UTF-8 text to score)")
    for _ in read_text_pieces(p):  # one streaming pass: decoding errors name the byte offset
        pass
    return size


def count_text_tokens(path: str | os.PathLike[str], encode: Callable[[str], list[int]], block: int = READ_BYTES) -> int:
    """The tokens a text file encodes to (streamed): what a progress bar over the scored tokens counts to."""
    return sum(len(ids) for ids in token_chunks(read_text_pieces(path, block=block), encode))


def check_window_args(max_length: int, stride: int | None, n_positions: int) -> None:
    if not 0 < max_length <= n_positions:
        raise UsageError(f"--max-length must be in 1..{n_positions} (the model's context), got {max_length}")
    if stride is not None and not 0 < stride <= max_length:
        raise UsageError(f"--stride must be in 1..{max_length} (--max-length), got {stride}")


def evaluate_tokens(
    scorers: Sequence[Scorer],
    chunks: Iterable[Sequence[int]],
    max_length: int,
    eot_id: int,
    stride: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int], None] | None = None,
) -> dict[str, TextResult]:
    """Score a stream of tokens (arriving in chunks) through rolling (or strided) windows, the first token
    conditioned on <|endoftext|>; every scorer scores the same batches. `progress(tokens scored)` after each batch."""
    if stride is None:
        reqs = rolling_requests(chunks, eot_id, max_length)
    else:
        reqs = strided_requests(chunks, eot_id, max_length, stride)
    return evaluate_requests(scorers, reqs, max_length, eot_id, batch_size, progress)


def evaluate_requests(
    scorers: Sequence[Scorer],
    reqs: Iterable[Request],
    max_length: int,
    eot_id: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int], None] | None = None,
) -> dict[str, TextResult]:
    """Score perplexity windows (streamed) in batches of `batch_size`, in order; every scorer scores the same
    batches. `progress(tokens scored)` after each batch."""
    check_batch_size(batch_size)
    out = {s.name: TextResult() for s in scorers}
    done = scored = 0
    for batch in batched(reqs, batch_size):
        n = sum(len(r.continuation) for r in batch)
        for s in scorers:
            sums, _, _ = score_batch(s, batch, max_length, eot_id, "window", done, want_greedy=False)
            res = out[s.name]
            res.window_nll += sums
            res.nll += sum(sums)
            res.tokens += n
        done += len(batch)
        scored += n
        if progress is not None:
            progress(scored)
    return out


def evaluate_text(
    scorers: Sequence[Scorer],
    encode: Callable[[str], list[int]],
    path: str | os.PathLike[str],
    max_length: int,
    eot_id: int,
    stride: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int], None] | None = None,
    block: int = READ_BYTES,
) -> dict[str, TextResult]:
    """A text file's log-likelihood: its tokens (streamed) through `evaluate_tokens`, its bytes and words counted
    as it is read."""
    stats = TextStats()
    chunks = token_chunks(read_text_pieces(path, stats, block), encode)
    out = evaluate_tokens(scorers, chunks, max_length, eot_id, stride, batch_size, progress)
    for res in out.values():
        if res.tokens == 0:
            raise UsageError(f"--text {path}: encodes to no tokens (expected some text to score)")
        res.bytes, res.words = stats.bytes, stats.words
    return out


def open_split_for_eval(data_dir: str | os.PathLike[str], split: str, vocab_size: int) -> tuple[TokenFile, dict]:
    """DIR/{split}.bin checked as training checks it, and what meta.json says of its text ({} without one)."""
    return open_split(data_dir, split, vocab_size, block_size=0), read_meta(data_dir) or {}


def evaluate_split(
    scorers: Sequence[Scorer],
    tokens: TokenFile,
    meta: dict,
    split: str,
    max_length: int,
    eot_id: int,
    stride: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int], None] | None = None,
) -> dict[str, TextResult]:
    """A prepared split's log-likelihood (every token of the .bin scored once, as for a text); its bytes and words
    from meta.json when `prepare` recorded them, else None (the token-level figures stand alone)."""
    out = evaluate_tokens(scorers, tokens.chunks(), max_length, eot_id, stride, batch_size, progress)
    for res in out.values():
        res.bytes, res.words = meta.get(f"{split}_bytes"), meta.get(f"{split}_words")
    return out
