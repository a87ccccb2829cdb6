"""Text corpus -> nanoGPT's `train.bin` / `val.bin` (little-endian uint16 GPT-2 token ids, no header) + `meta.json`.

Streamed: files are read in chunks of `read_bytes` and encoded in pieces of about `encode_chars` characters, so memory
stays flat whatever the corpus size. A piece is only cut where GPT-2's pre-tokenizer regex cannot join across the
cut (io/text.py's `safe_cut`, shared with eval), so the ids equal those of encoding the whole text at once.

- One file: its text is split at int(n * (1 - val_fraction)) of its n characters and each part is encoded on its own,
  exactly as nanoGPT's data/shakespeare/prepare.py does (tiny shakespeare: 301,966 train and 36,059 val tokens).
- Several files: each file is one document; documents within a split are separated by <|endoftext|> (50256). The last
  round(n_docs * val_fraction) documents (round half up, in the order given) go to val.bin; a split that would be
  empty is an error. Empty files among several are skipped with a warning.

Text is encoded with `encode_ordinary`: "<|endoftext|>" written in the corpus is ordinary text, never id 50256.
Nothing is printed: progress goes to a callback, notes to `logging`.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..files import PendingFile, atomic_write_text, make_dirs, remove_dirs
from ..io.text import READ_BYTES, SafePieces, TextStats, read_utf8, safe_pieces
from ..io.tokenizer import EOT_ID, Tokenizer, find_files

log = logging.getLogger(__name__)

ENCODE_CHARS = 1 << 18  # encode pieces of about 256k characters (~70k ids: ~2.5 MB as a list of Python ints)
DTYPE = np.dtype("<u2")  # nanoGPT's np.uint16 on a little-endian machine, spelled out so it holds everywhere
VOCAB_SIZE = 50257

# progress(phase, done_bytes, total_bytes): phase "scan" (hashing and checking UTF-8) or "encode"
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Source:
    """One input file as the first pass saw it."""

    path: str
    bytes: int
    sha256: str
    chars: int


# -- pass 1: check and hash -----------------------------------------------------------------------------------------
def check_input(path: str | os.PathLike[str]) -> Path:
    """A readable regular file, or a UsageError naming it (missing, a directory, unreadable)."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p}: no such file (expected a UTF-8 text file)")
    if p.is_dir():
        raise UsageError(f"{p}: is a directory (expected a UTF-8 text file; pass the files inside it)")
    if not p.is_file():  # a pipe (<(zcat ...)), a device: both passes need to read it, and its size is unknown
        raise UsageError(f"{p}: not a regular file (a pipe or a device?); expected a text file, which is read twice")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{p}: not readable (permission denied)")
    return p


def scan(
    path: str | os.PathLike[str],
    read_bytes: int = READ_BYTES,
    progress: Progress | None = None,
    done: int = 0,
    total: int = 0,
) -> Source:
    """First pass over one file: size, sha256, character count, and a strict UTF-8 check (before anything is encoded).

    `done` and `total` place this file's bytes in the whole corpus for `progress`."""
    p = check_input(path)
    h = hashlib.sha256()
    n_bytes = n_chars = crlf = 0
    head, last = b"", b""  # the file's first bytes (a byte-order mark?), the block's last one

    def on_block(block: bytes) -> None:
        nonlocal n_bytes, crlf, head, last
        h.update(block)
        head = (head + block[:3])[:3]
        crlf += (last + block[:1]).count(b"\r\n") + block.count(b"\r\n")  # one cut by the block counted once
        last = block[-1:]
        n_bytes += len(block)
        if progress is not None:
            progress("scan", done + n_bytes, total)

    for text in read_utf8(p, str(p), read_bytes, on_block):
        n_chars += len(text)
    _warn_text_form(p, head == codecs.BOM_UTF8, crlf)
    return Source(str(path), n_bytes, h.hexdigest(), n_chars)


def _warn_text_form(p: Path, bom: bool, crlf: int) -> None:
    """What would be encoded as text but is not: a byte-order mark, Windows line endings, a JSON-lines file. Nothing
    is changed (the tokens stay those of the file, as nanoGPT's prepare gives them); each is named once."""
    if bom:
        log.warning(
            "%s: starts with a UTF-8 byte-order mark (U+FEFF), which is encoded as text before the first word", p
        )
    if crlf:
        log.warning(
            "%s: %s Windows line ending(s) (\\r\\n): each \\r is encoded as text (GPT-2 saw \\n only); convert the "
            "file (dos2unix) unless that is wanted",
            p,
            f"{crlf:,}",
        )
    if p.suffix.lower() in (".jsonl", ".json", ".ndjson"):
        log.warning(
            "%s: encoded as plain text, JSON syntax and keys included (prepare reads text files: extract the text "
            "field first)",
            p,
        )


# -- streamed encoding ----------------------------------------------------------------------------------------------
class StreamEncoder(SafePieces):
    """Takes text piece by piece and hands `sink` the ids of the longest prefix that can be encoded safely, encoded
    in pieces of at most `encode_chars` characters (io/text.py's one cut rule)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        sink: Callable[[list[int]], None],
        encode_chars: int,
        stats: TextStats | None = None,
    ) -> None:
        def warn(held: int) -> None:
            log.warning("%d characters without a space or newline: held until one comes", held)

        def piece(text: str) -> None:
            if stats is not None:
                stats.count(text)
            sink(tokenizer.encode_ordinary(text))

        super().__init__(piece, encode_chars, warn)


def encode_stream(tokenizer: Tokenizer, pieces: Iterator[str], encode_chars: int = ENCODE_CHARS) -> Iterator[int]:
    """All ids of the text `pieces` make, streamed (a convenience for tests and small callers)."""
    for piece in safe_pieces(pieces, encode_chars):
        yield from tokenizer.encode_ordinary(piece)


class BinWriter:
    """Appends ids as little-endian uint16 to a hidden temporary file beside `path` (files.PendingFile); `commit`
    flushes it and renames it into place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = PendingFile(path)
        self.tokens = 0
        self.stats = TextStats(texts=0)  # the text's UTF-8 bytes and words, for evaluation's byte-level figures

    def encoder(self, tokenizer: Tokenizer, encode_chars: int) -> StreamEncoder:
        """An encoder for one more document (text) of this file."""
        self.stats.texts += 1
        return StreamEncoder(tokenizer, self.write, encode_chars, self.stats)

    def write(self, ids: Sequence[int]) -> None:
        if ids:
            np.asarray(ids, dtype=DTYPE).tofile(self.file.f)
            self.tokens += len(ids)

    def commit(self) -> None:
        self.file.commit()

    def discard(self) -> None:
        self.file.discard()


def tokenizer_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The directory's vocab.json + merges.txt (or OpenAI's encoder.json + vocab.bpe); [] unless both are there."""
    found = find_files(directory)
    return list(found) if found is not None else []


def tokenizer_info(tokenizer: Tokenizer, directory: str | os.PathLike[str] | None) -> dict:
    """meta.json's tokenizer entry: its name and source, the sha256 of the files it was read from (the shipped pair
    too), and a sha256 of the 50257 tokens' bytes in id order, which identifies the vocabulary whatever files it
    came from."""
    files = list(tokenizer.files) or (tokenizer_files(directory) if directory is not None else [])
    h = hashlib.sha256()
    for i in range(tokenizer.n_vocab):
        b = tokenizer.decode_bytes([i])
        h.update(len(b).to_bytes(4, "little") + b)
    return {
        "name": "gpt2",
        "encode": "encode_ordinary",
        "source": tokenizer.source,
        "files_sha256": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
        "vocab_sha256": h.hexdigest(),
    }


# -- the whole job --------------------------------------------------------------------------------------------------
def val_document_count(n_docs: int, val_fraction: float) -> int:
    """round(n_docs * val_fraction), halves rounded up; a split left empty is a UsageError that says what would do."""
    k = math.floor(n_docs * val_fraction + 0.5)
    if k == 0:
        need = 0.5 / n_docs
        raise UsageError(
            f"--val-fraction {val_fraction} of {n_docs} documents (files) puts none in val.bin; "
            f"expected --val-fraction >= {need:.3g} or at least {math.ceil(0.5 / val_fraction)} files"
        )
    if k == n_docs:
        raise UsageError(
            f"--val-fraction {val_fraction} of {n_docs} documents (files) puts all of them in val.bin and none in "
            f"train.bin; expected a smaller --val-fraction or more files"
        )
    return k


def check_val_fraction(val_fraction: float) -> None:
    if not (0.0 < val_fraction < 1.0) or math.isnan(val_fraction):
        raise UsageError(f"--val-fraction must be in (0, 1), got {val_fraction}")


def prepare(
    paths: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    tokenizer: Tokenizer,
    *,
    val_fraction: float = 0.1,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    read_bytes: int = READ_BYTES,
    encode_chars: int = ENCODE_CHARS,
) -> dict:
    """Encode `paths` into out_dir/train.bin, val.bin and meta.json (returned as a dict). See the module docstring.

    Nothing is left half-written: the .bin files grow as hidden temporary files renamed into place at the end, and on
    any error or Ctrl-C they are removed, along with the directories this call created.
    """
    check_val_fraction(val_fraction)
    if not paths:
        raise UsageError("no TEXT_FILE given (expected one or more UTF-8 text files)")
    files = [check_input(p) for p in paths]
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        names = ", ".join(str(p) for p in paths)
        raise UsageError(f"{names}: empty corpus (0 bytes of text); expected UTF-8 text to encode")

    out = Path(out_dir)
    created = make_dirs(out, "--out")
    writers: list[BinWriter] = []
    try:
        for name in ("train.bin", "val.bin"):
            writers.append(BinWriter(out / name))
    except OSError as e:
        for w in writers:
            w.discard()
        remove_dirs(created)
        raise UsageError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    train, val = writers

    try:
        sources, done = [], 0
        for p in paths:
            sources.append(scan(p, read_bytes, progress, done, total))
            done += sources[-1].bytes
        if sum(s.chars for s in sources) == 0:  # files that changed size since stat
            raise UsageError(f"{', '.join(map(str, paths))}: empty corpus (0 characters); expected text to encode")

        encoded = 0

        def on_block(block: bytes) -> None:
            nonlocal encoded
            encoded += len(block)
            if progress is not None:
                progress("encode", encoded, total)

        how = Reading(tokenizer, read_bytes, encode_chars, on_block)
        if len(files) == 1:
            split, source_split = _split_one(files[0], sources[0], train, val, how, val_fraction)
        else:
            split, source_split = _split_documents(files, sources, train, val, how, val_fraction)
        if train.tokens == 0 or val.tokens == 0:
            empty = "train.bin" if train.tokens == 0 else "val.bin"
            raise UsageError(f"{empty} would be empty (corpus too small for --val-fraction {val_fraction})")

        meta = {
            "format": "nanoGPT .bin: little-endian uint16 token ids, no header",
            "dtype": "uint16",
            "vocab_size": VOCAB_SIZE,
            "eot_token": EOT_ID,
            "train_tokens": train.tokens,
            "val_tokens": val.tokens,
            # the text behind each file (lm-eval's counts: UTF-8 bytes, words as len(re.split(r"\s+", doc)) summed
            # over documents), for `gpt2-port eval --data`'s bits per byte and word perplexity
            "train_bytes": train.stats.bytes,
            "val_bytes": val.stats.bytes,
            "train_words": train.stats.words,
            "val_words": val.stats.words,
            "split": split,
            "sources": [{**asdict(s), "split": source_split[i]} for i, s in enumerate(sources)],
            "tokenizer": tokenizer_info(tokenizer, tokenizer_dir),
            "created_by": "gpt2-port prepare",
        }
        train.commit()
        val.commit()
        atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
        return meta
    except BaseException:
        for w in writers:
            w.discard()
        remove_dirs(created)
        raise


@dataclass(frozen=True)
class Reading:
    """How the second pass reads and encodes each file."""

    tokenizer: Tokenizer
    read_bytes: int
    encode_chars: int
    on_block: Callable[[bytes], None]  # sees every block read (progress)

    def text(self, path: Path) -> Iterator[str]:
        return read_utf8(path, str(path), self.read_bytes, self.on_block)

    def encoder(self, writer: BinWriter) -> StreamEncoder:
        return writer.encoder(self.tokenizer, self.encode_chars)


def _split_one(
    path: Path, source: Source, train: BinWriter, val: BinWriter, how: Reading, val_fraction: float
) -> tuple[dict, list[str]]:
    """nanoGPT's rule: characters [0, k) to train and [k, n) to val, k = int(n * (1 - val_fraction)), each encoded
    on its own (the cut at k is not moved to a safe place, so the counts equal nanoGPT's)."""
    k = int(source.chars * (1 - val_fraction))
    if k == 0 or k == source.chars:
        empty = "train.bin" if k == 0 else "val.bin"
        raise UsageError(
            f"{path}: too few characters ({source.chars}) to split at --val-fraction {val_fraction}: {empty} would be "
            "empty; expected a longer text"
        )
    enc_train, enc_val = how.encoder(train), how.encoder(val)
    seen = 0
    for text in how.text(path):
        if seen + len(text) <= k:
            enc_train.push(text)
        elif seen >= k:
            enc_val.push(text)
        else:
            enc_train.push(text[: k - seen])
            enc_train.finish()
            enc_val.push(text[k - seen :])
        seen += len(text)
    enc_train.finish()
    enc_val.finish()
    split = {"rule": "characters", "val_fraction": val_fraction, "train_chars": k, "val_chars": source.chars - k}
    return split, ["train+val"]


def _split_documents(
    paths: list[Path], sources: list[Source], train: BinWriter, val: BinWriter, how: Reading, val_fraction: float
) -> tuple[dict, list[str]]:
    """Each non-empty file is a document; the last k in the order given go to val; <|endoftext|> between documents."""
    docs = [i for i, s in enumerate(sources) if s.chars > 0]
    for s in sources:
        if s.chars == 0:
            log.warning("%s: empty file, skipped (not a document)", s.path)
    if len(docs) < 2:
        raise UsageError(
            f"{len(docs)} non-empty file(s) among {len(sources)}: a split by documents needs at least 2; "
            "pass one file to split it by characters"
        )
    k = val_document_count(len(docs), val_fraction)
    val_docs = set(docs[len(docs) - k :])
    source_split = ["skipped (empty)"] * len(sources)
    for writer, chosen in ((train, docs[: len(docs) - k]), (val, docs[len(docs) - k :])):
        for n, i in enumerate(chosen):
            if n:
                writer.write([EOT_ID])
            enc = how.encoder(writer)
            for text in how.text(paths[i]):
                enc.push(text)
            enc.finish()
            source_split[i] = "val" if i in val_docs else "train"
    split = {
        "rule": "documents",
        "val_fraction": val_fraction,
        "separator": "eot between documents",
        "train_documents": len(docs) - k,
        "val_documents": k,
        "val_sources": [sources[i].path for i in sorted(val_docs)],
    }
    return split, source_split
