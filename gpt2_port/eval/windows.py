"""Scoring windows: which tokens a forward pass sees and which of its predictions are scored.

Everything the evaluator scores is a `Request`, lm-evaluation-harness's (context, continuation) pair of token lists:
the model reads `(context + continuation)[:-1]` (cut on the left to `max_length`) and the continuation's tokens are
scored from the last `len(continuation)` positions. Rolling and strided perplexity windows, LAMBADA targets and
multiple-choice endings are all requests, so one batched scorer serves them all.

The text side streams: io/text.py's `read_text_pieces` reads a file in blocks and cuts it only where GPT-2's
pre-tokenizer would cut anyway (the rule `prepare` uses), so encoding piece by piece gives exactly the tokens of
encoding the whole file, and the window builders keep only the last window's worth of tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from ..errors import UsageError


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


# -- tokens of a streamed text --------------------------------------------------------------------------------------
def token_chunks(pieces: Iterable[str], encode) -> Iterator[list[int]]:  # noqa: ANN001 (a tokenizer's encode)
    """Encode each text piece on its own (the pieces are cut where that gives the tokens of the whole text)."""
    for piece in pieces:
        ids = encode(piece)
        if ids:
            yield ids
