"""Scoring windows: which tokens a forward pass sees and which of its predictions are scored.

Everything the evaluator scores is a `Request`, lm-evaluation-harness's (context, continuation) pair of token lists:
the model reads `(context + continuation)[:-1]` (cut on the left to `max_length`) and the continuation's tokens are
scored from the last `len(continuation)` positions. Rolling and strided perplexity windows, LAMBADA targets and
multiple-choice endings are all requests, so one batched scorer serves them all.

The text side streams: `read_text_pieces` reads a file in blocks, cuts it only where GPT-2's pre-tokenizer would cut
anyway, so encoding piece by piece gives exactly the tokens of encoding the whole file, and the window builders keep
only the last window's worth of tokens.
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError

READ_BLOCK = 1 << 20  # bytes read at a time from a text file (1 MiB: about 250k tokens of English)
_WHITESPACE_RUN = re.compile(r"\s+")


@dataclass(frozen=True)
class Request:
    """Score `continuation` given `context` (lm-eval's pair): both are token ids; the context is never empty."""

    context: list[int]
    continuation: list[int]

    def model_input(self, max_length: int) -> list[int]:
        """The tokens the model reads: context + continuation without its last token, the last max_length of them."""
        return (self.context + self.continuation)[-(max_length + 1) :][:-1]


# -- rolling: lm-evaluation-harness's loglikelihood_rolling ---------------------------------------------------------
def rolling_requests(chunks: Iterable[Sequence[int]], prefix: int, max_length: int) -> Iterator[Request]:
    """lm-eval's `get_rolling_token_windows(tokens, prefix, max_length, context_len=1)` + `make_disjoint_window`.

    The tokens (arriving in chunks) are cut into disjoint windows of `max_length` predictions:
    - the first window predicts tokens[0:M] from `prefix` (<|endoftext|>) followed by tokens[0:M-1];
    - each later full window predicts the next M tokens, conditioned on the one token before them;
    - the last, partial window (k < M tokens) is conditioned on the M - k + 1 tokens before it, so the model still
      reads M tokens.
    Every token is scored exactly once. Only the last M tokens and the unscored ones are held.
    """
    if max_length < 1:
        raise UsageError(f"--max-length must be a positive integer, got {max_length}")
    M = max_length
    history: list[int] = []  # the last M scored tokens: context for a partial last window
    pending: list[int] = []
    start = 0  # first unscored token in `pending`
    first = True
    for chunk in chunks:
        pending.extend(chunk)
        while len(pending) - start >= M:  # a full window: M tokens are there, whatever follows
            cont = pending[start : start + M]
            yield Request([prefix] if first else [history[-1]], cont)
            first = False
            history = cont
            start += M
        pending = pending[start:]
        start = 0
    if pending:  # the last, partial window
        k = len(pending)
        yield Request([prefix] if first else history[-(M - k + 1) :], pending)


# -- strided: the transformers docs' sliding window, every token scored once ---------------------------------------
def strided_requests(chunks: Iterable[Sequence[int]], prefix: int, max_length: int, stride: int) -> Iterator[Request]:
    """Windows of `max_length` inputs starting every `stride` tokens of seq = [prefix] + tokens.

    Window k reads seq[kS : kS+M] and can predict seq[kS+1 : kS+M+1]; it scores only the tokens no earlier window
    scored (the first window all M, later ones the S new tokens, with M - S tokens of context). The last window is
    cut at the end of the text. With S = M this is the rolling evaluation except for the last partial window, which
    rolling extends to the left instead.
    """
    if max_length < 1:
        raise UsageError(f"--max-length must be a positive integer, got {max_length}")
    if not 0 < stride <= max_length:
        raise UsageError(f"--stride must be in 1..--max-length ({max_length}), got {stride}")
    M, S = max_length, stride
    buf: list[int] = [prefix]  # seq[base:]
    base = 0
    begin = 0  # kS: where the current window starts in seq
    scored_to = 1  # seq[1:scored_to] are scored
    for chunk in chunks:
        buf.extend(chunk)
        while base + len(buf) >= begin + M + 1:
            end = begin + M + 1
            yield Request(buf[begin - base : scored_to - base], buf[scored_to - base : end - base])
            scored_to, begin = end, begin + S
            buf = buf[begin - base :]  # (the next window starts at begin; scored_to >= begin + 1 since S <= M)
            base = begin
    end = base + len(buf)
    if scored_to < end:  # the last window, cut at the end of the text
        yield Request(buf[begin - base : scored_to - base], buf[scored_to - base :])


# -- streaming a text file -------------------------------------------------------------------------------------------
def safe_cut(text: str) -> int:
    """The last index i where text[:i] and text[i:] encode to exactly the tokens of the whole (0 if none).

    GPT-2's pre-tokenizer never joins across "x\\ny" (a newline between two non-space characters): no word,
    number or punctuation piece contains a newline, and the newline is a whitespace piece of its own because the
    character after it is not whitespace and the one before it is not either. Cutting after such a newline gives the
    same pieces, hence the same BPE tokens, and no whitespace run crosses the cut (the word count is additive too).
    """
    i = text.rfind("\n", 0, len(text) - 1)
    while i >= 1:
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i + 1
        i = text.rfind("\n", 0, i)
    return 0


@dataclass
class TextStats:
    """What lm-eval counts over the text itself: UTF-8 bytes, and words as len(re.split(r"\\s+", text))."""

    bytes: int = 0
    whitespace_runs: int = 0
    bytes_read: int = 0  # progress: bytes of the file read so far

    @property
    def words(self) -> int:
        return self.whitespace_runs + 1


def read_text_pieces(
    path: str | os.PathLike[str], stats: TextStats | None = None, block: int = READ_BLOCK
) -> Iterator[str]:
    """Yield the UTF-8 text of `path` in pieces that can be encoded separately (see `safe_cut`).

    A piece is at most about `block` bytes when the text has a cut point in each block; a text with no such point
    (no "x\\ny" at all) is held whole. UsageError (naming the file and the byte offset) on bytes that are not UTF-8.
    """
    p = Path(path)
    stats = stats if stats is not None else TextStats()
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    held = ""
    try:
        f = open(p, "rb")  # noqa: SIM115 (closed below; a generator holds it across yields)
    except OSError as e:
        raise UsageError(f"--text {p}: cannot read it ({e.strerror or e})") from None
    with f:
        while True:
            data = f.read(block)
            held_bytes = len(decoder.getstate()[0])  # the start of a character cut by the previous block
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise UsageError(
                    f"--text {p}: not UTF-8 ({e.reason} at byte {stats.bytes_read - held_bytes + e.start}); "
                    f"expected a UTF-8 text file"
                ) from None
            stats.bytes_read += len(data)
            held += text
            if not data:
                break
            cut = safe_cut(held)
            if cut:
                piece, held = held[:cut], held[cut:]
                _count(piece, stats)
                yield piece
    if held:
        _count(held, stats)
        yield held


def _count(piece: str, stats: TextStats) -> None:
    stats.bytes += len(piece.encode("utf-8"))
    stats.whitespace_runs += sum(1 for _ in _WHITESPACE_RUN.finditer(piece))


def token_chunks(pieces: Iterable[str], encode) -> Iterator[list[int]]:  # noqa: ANN001 (a tokenizer's encode)
    """Encode each text piece on its own (the pieces are cut where that gives the tokens of the whole text)."""
    for piece in pieces:
        ids = encode(piece)
        if ids:
            yield ids
