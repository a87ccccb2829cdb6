"""Reading text corpora as a stream: one strict UTF-8 reader, and one rule for where text may be cut so that encoding
it piece by piece gives exactly the tokens of encoding it whole. `prepare` (train/) and `eval` (eval/) share both.

- `read_utf8` decodes a file block by block; a byte that is not UTF-8 is a UsageError naming the file and the byte's
  offset, and so is a file that ends inside a character.
- `safe_cut` finds a cut between a non-space character and a following space or newline: GPT-2's pre-tokenizer
  never joins across it, and no whitespace run crosses it (so word counts add up over pieces too).
- `SafePieces` takes text as it arrives and hands out pieces that end at safe cuts, at most about `max_chars` long
  when the text allows, holding only the rest: memory stays flat whatever the corpus size.
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

READ_BYTES = 1 << 20  # 1 MiB per read (about 250k tokens of English)
_WHITESPACE_RUN = re.compile(r"\s+")


def read_utf8(
    path: str | os.PathLike[str],
    label: str,
    read_bytes: int = READ_BYTES,
    on_block: Callable[[bytes], None] | None = None,
) -> Iterator[str]:
    """The file's text, block by block, strictly UTF-8. `label` names the file in errors (e.g. "--text in.txt").

    `on_block` sees each block of raw bytes once it has decoded (for hashing and progress)."""
    p = Path(path)
    try:
        f = open(p, "rb")  # noqa: SIM115 (closed below; a generator holds it across yields)
    except OSError as e:
        raise UsageError(f"{label}: cannot read ({e.strerror or e})") from None
    dec = codecs.getincrementaldecoder("utf-8")(errors="strict")
    offset = 0  # bytes of the file handed to the decoder so far
    with f:
        while True:
            try:
                block = f.read(read_bytes)
            except OSError as e:
                raise UsageError(f"{label}: cannot read ({e.strerror or e})") from None
            if not block:
                break
            held = dec.getstate()[0]  # the start of a character cut by the previous block
            try:
                text = dec.decode(block)
            except UnicodeDecodeError as e:
                at, bad = offset - len(held) + e.start, (held + block)[e.start]
                raise UsageError(
                    f"{label}: not UTF-8 text: invalid byte 0x{bad:02x} at byte offset {at}; expected UTF-8"
                ) from None
            offset += len(block)
            if on_block is not None:
                on_block(block)
            if text:
                yield text
    held = dec.getstate()[0]
    if held:
        raise UsageError(
            f"{label}: not UTF-8 text: the file ends inside a character (byte 0x{held[0]:02x} at byte offset "
            f"{offset - len(held)} starts a sequence that is cut short); expected UTF-8"
        )


def safe_cut(text: str, lo: int = 1, hi: int | None = None) -> int:
    """The last index i in [lo, hi) where encoding text[:i] and text[i:] apart gives the ids of encoding text whole;
    0 if there is none.

    GPT-2's pre-tokenizer (`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`) has no
    piece that holds a non-space character followed by a space: letters, numbers and punctuation exclude whitespace,
    and whitespace pieces start with it. So a piece always ends between a non-space character and a following space
    or newline, and the regex only looks forward from where a piece starts. Cutting there is safe; cutting after a
    space is not ("a\\n\\nb" gives "\\n", "\\n"; "a\\n\\n" alone gives "\\n\\n"). `str.isspace` is true for every
    character the regex's Unicode `\\s` matches (and for a few more), so "not isspace" is never wrong. The cut is
    where a whitespace run starts, so no run crosses it.
    """
    i = (len(text) if hi is None else min(hi, len(text))) - 1
    while i >= lo:
        j = max(text.rfind(" ", lo, i + 1), text.rfind("\n", lo, i + 1))
        if j < lo:
            return 0
        if not text[j - 1].isspace():
            return j
        i = j - 1
    return 0


class SafePieces:
    """Takes text piece by piece and hands `sink` the longest prefix that can be cut safely, in pieces of at most
    `max_chars` characters where a cut allows; a stretch with no cut at all is held until one comes."""

    def __init__(self, sink: Callable[[str], None], max_chars: int, warn: Callable[[int], None] | None = None) -> None:
        self.sink, self.max_chars, self.warn = sink, max_chars, warn
        self.pending = ""
        self.searched = 0  # pending[:searched] holds no safe cut (a very long line of text without spaces)
        self.warned = False

    def push(self, text: str) -> None:
        self.pending += text
        start = 0
        while len(self.pending) - start >= self.max_chars:
            cut = safe_cut(self.pending, start + 1, start + self.max_chars + 1)
            if cut == 0:  # none in the window: the last one anywhere, unless this stretch was searched already
                cut = safe_cut(self.pending, max(start + 1, self.searched))
            if cut == 0:
                self.searched = len(self.pending)
                if self.searched - start > 64 * self.max_chars and not self.warned and self.warn is not None:
                    self.warned = True
                    self.warn(self.searched - start)
                break
            self.sink(self.pending[start:cut])
            start = cut
        if start:
            self.pending = self.pending[start:]
            self.searched = max(0, self.searched - start)

    def finish(self) -> None:
        if self.pending:
            self.sink(self.pending)
        self.pending, self.searched = "", 0


def safe_pieces(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """The text of `texts` again, in pieces that end at safe cuts (a pull-based SafePieces)."""
    out: list[str] = []
    cutter = SafePieces(out.append, max_chars)
    for text in texts:
        cutter.push(text)
        yield from out
        out.clear()
    cutter.finish()
    yield from out


@dataclass
class TextStats:
    """What lm-eval counts over the text itself: UTF-8 bytes, and words as len(re.split(r"\\s+", text))."""

    bytes: int = 0
    whitespace_runs: int = 0
    bytes_read: int = 0  # progress: bytes of the file read so far
    texts: int = 1  # documents counted: each has one word more than whitespace runs

    @property
    def words(self) -> int:
        return self.whitespace_runs + self.texts

    def count(self, piece: str) -> None:
        """Add a piece that ends at a safe cut (no whitespace run crosses it, so the counts add up)."""
        self.bytes += len(piece.encode("utf-8"))
        self.whitespace_runs += sum(1 for _ in _WHITESPACE_RUN.finditer(piece))


def read_text_pieces(
    path: str | os.PathLike[str], stats: TextStats | None = None, block: int = READ_BYTES, label: str | None = None
) -> Iterator[str]:
    """The UTF-8 text of `path` in pieces of about `block` characters that encode separately to the tokens of the
    whole, counted into `stats` as they go."""
    stats = stats if stats is not None else TextStats()

    def read(b: bytes) -> None:
        stats.bytes_read += len(b)

    for piece in safe_pieces(read_utf8(path, label or f"--text {path}", block, read), block):
        stats.count(piece)
        yield piece
