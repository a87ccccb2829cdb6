"""Each row's progress through generation: its new tokens, whether and why it stopped (EOS, a stop string), and its
text, streamed to a callback as it forms whole characters."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..io.tokenizer import StreamDecoder, Tokenizer

# on_text(row, text): called with each row's new text as soon as it forms whole characters (needs a tokenizer)
TextCallback = Callable[[int, str], None]


class Rows:
    """Each row's progress: its new tokens, whether and why it stopped (EOS, a stop string), and its text, streamed
    to `on_text` as it forms whole characters. Which rows still run is kept on the host (`running`) and mirrored in
    `unfinished` (B,) bool on the model's device, written when a row stops (a copy to the device, no wait)."""

    def __init__(
        self,
        B: int,
        device: torch.device,
        eos_token_id: int | None,
        stops: list[str],
        tokenizer: Tokenizer | None,
        on_text: TextCallback | None,
    ) -> None:
        self.unfinished = torch.ones(B, dtype=torch.bool, device=device)
        self.running = [True] * B
        self.new_ids: list[list[int]] = [[] for _ in range(B)]
        self.reasons = ["length"] * B
        self.decoders: list[StreamDecoder] | None = (
            [tokenizer.stream_decoder() for _ in range(B)] if tokenizer else None
        )
        self.texts = [""] * B
        self.eos, self.stops, self.on_text = eos_token_id, stops, on_text
        self.longest_stop = max((len(s) for s in stops), default=0)

    def _emit(self, row: int, text: str) -> None:
        if text and self.on_text is not None:
            self.on_text(row, text)

    def _stop(self, row: int, reason: str) -> None:
        self.reasons[row] = reason
        self.running[row] = False
        self.unfinished[row : row + 1] = False  # a fill on the device (a 0-d index would copy from the host and wait)

    @property
    def any_running(self) -> bool:
        return any(self.running)

    def _flush(self, row: int) -> None:
        if self.decoders is not None:
            rest = self.decoders[row].flush()
            self.texts[row] += rest
            self._emit(row, rest)

    def accept(self, toks: list[int]) -> int:
        """Take one step's token per row (rows that stopped skip theirs); returns how many rows took one."""
        taken = 0
        for r, tok in enumerate(toks):
            if not self.running[r]:
                continue
            taken += 1
            self.new_ids[r].append(tok)
            if self.eos is not None and tok == self.eos:
                self._stop(r, "eos")
                self._flush(r)
            elif self.decoders is not None:
                self._add_text(r, tok)
        return taken

    def _add_text(self, r: int, tok: int) -> None:
        """Decode the row's token; a stop string in the new text cuts the text just after it and stops the row."""
        piece = self.decoders[r].push(tok)  # type: ignore[index]
        if not piece:
            return
        before = len(self.texts[r])
        self.texts[r] += piece
        if self.stops:
            start = max(0, before - self.longest_stop + 1)
            hits = [(i, s) for s in self.stops if (i := self.texts[r].find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                end = i + len(s)
                self._emit(r, self.texts[r][before:end])
                self.texts[r] = self.texts[r][:end]
                self._stop(r, "stop")
                return
        self._emit(r, piece)

    def close(self, context_limited: bool) -> None:
        """After the last step: rows still running stopped at the length (or the context), their text flushed."""
        for r in range(len(self.reasons)):
            if self.reasons[r] == "length" and context_limited:
                self.reasons[r] = "context"
            if self.reasons[r] in ("length", "context"):
                self._flush(r)
