"""GPT-2's byte-level BPE through tiktoken, built from the two tokenizer files read directly (never a download).

The files come from `--tokenizer DIR`, else the checkpoint (vocab.json + merges.txt, or OpenAI's encoder.json +
vocab.bpe), else the copy shipped inside this package (gpt2_port/gpt2_bpe, OpenAI's files with their licence, checked
against their sha256 at load). The ranks are computed here from the files on every load: tiktoken's own loader caches
files by path in a directory that grows and serves a stale copy when a file changes, so it is not used.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError, UsageError

if TYPE_CHECKING:
    import tiktoken

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
EOT_ID = 50256
N_VOCAB = 50257

# The two spellings of the tokenizer files: a Hugging Face snapshot's, and OpenAI's (same bytes).
TOKENIZER_FILE_PAIRS = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))
SHIPPED_DIR = Path(__file__).with_name("gpt2_bpe")
# sha256 of OpenAI's files (the hashes tiktoken checks for its "gpt2" encoding)
SHIPPED_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


class Tokenizer:
    """encode/decode identical to transformers' GPT2Tokenizer; `<|endoftext|>` in text encodes to 50256."""

    def __init__(self, enc: tiktoken.Encoding, source: str, files: tuple[Path, ...] = ()) -> None:
        self.enc = enc
        self.source = source
        self.files = files  # what it was read from (vocab.json + merges.txt, or the shipped pair)
        self.eot_id = EOT_ID
        self.n_vocab = enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode special-token text ("<|endoftext|>") as ordinary text, as nanoGPT's prepare scripts do."""
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids, errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.enc.decode_bytes(ids)

    def stream_decoder(self) -> StreamDecoder:
        """A decoder for ids that arrive one at a time (see StreamDecoder)."""
        return StreamDecoder(self)


class StreamDecoder:
    """Decodes ids as they arrive without ever showing half a UTF-8 character.

    A token can end in the middle of a character (an emoji or a CJK character often spans two or three tokens); its
    bytes are held back until the character is whole. The concatenation of everything `push` and `flush` return is
    exactly `tokenizer.decode(all_ids)`: invalid bytes become U+FFFD the same way, and `flush` turns bytes still held
    at the end into U+FFFD as a one-shot decode would.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: int | Iterable[int]) -> str:
        """Add one id (or several); return the text that is now complete (possibly "")."""
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self._utf8.decode(self.tokenizer.decode_bytes(ids), final=False)

    def flush(self) -> str:
        """End of stream: return what is held back (incomplete bytes as U+FFFD), and start afresh."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending(self) -> bytes:
        """The bytes held back because they do not yet form a whole character."""
        return self._utf8.getstate()[0]


def _gpt2_pattern() -> str:
    from tiktoken_ext.openai_public import r50k_pat_str

    return r50k_pat_str


def _byte_of_char() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (its bytes_to_unicode table, inverted): printable bytes stand for
    themselves, the other 68 are shifted to U+0100 and up, in byte order."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + n)] = b
            n += 1
    return table


def mergeable_ranks(vocab_json: Path, merges_txt: Path) -> dict[bytes, int]:
    """The BPE ranks tiktoken needs, computed from the files (the 256 bytes, then one rank per merge, in file order),
    and checked against vocab.json: tiktoken assumes a token's id is its merge priority."""
    byte_of = _byte_of_char()

    def to_bytes(s: str) -> bytes:
        return bytes(byte_of[c] for c in s)

    merges_text = merges_txt.read_bytes().decode("utf-8")
    merges = [line.split() for line in merges_text.split("\n")[1:-1]]  # line 0: "#version: 0.2"
    ranks: dict[bytes, int] = {}
    for b in byte_of.values():  # insertion order: printable bytes first, then the shifted ones (ranks 0..255)
        ranks[bytes([b])] = len(ranks)
    for i, m in enumerate(merges):
        if len(m) != 2:
            raise CheckpointError(f"{merges_txt}: line {i + 2}: expected two tokens, got {len(m)}")
        ranks[to_bytes(m[0]) + to_bytes(m[1])] = len(ranks)
    vocab = json.loads(vocab_json.read_bytes().decode("utf-8"))
    if not isinstance(vocab, dict):
        raise CheckpointError(f"{vocab_json}: expected a JSON object of token -> id, got {type(vocab).__name__}")
    ids = {to_bytes(k): v for k, v in vocab.items() if k not in (EOT, "<|startoftext|>")}
    if ids != ranks:
        raise CheckpointError(
            f"{vocab_json} / {merges_txt}: not GPT-2 tokenizer files ({vocab_json.name} does not match "
            f"{merges_txt.name}: the ids are not the merge order)"
        )
    return ranks


def from_files(vocab_json: str | os.PathLike[str], merges_txt: str | os.PathLike[str], source: str = "") -> Tokenizer:
    """Build GPT-2's encoding from vocab.json (encoder.json) and merges.txt (vocab.bpe), read now, with no download."""
    import tiktoken

    v, m = Path(vocab_json), Path(merges_txt)
    try:
        ranks = mergeable_ranks(v, m)
        enc = tiktoken.Encoding(
            name="gpt2",
            pat_str=_gpt2_pattern(),
            mergeable_ranks=ranks,
            special_tokens={EOT: EOT_ID},
            explicit_n_vocab=N_VOCAB,
        )
    except OSError as e:
        raise CheckpointError(f"{e.filename or v}: cannot read ({e.strerror or e})") from None
    except (ValueError, KeyError, AssertionError, UnicodeDecodeError) as e:  # bad JSON, unknown characters, size
        raise CheckpointError(
            f"{v} / {m}: not GPT-2 tokenizer files ({e.__class__.__name__}: {str(e)[:200]})"
        ) from None
    if not source:
        spelled = "" if (v.name, m.name) == TOKENIZER_FILE_PAIRS[0] else f" as {v.name} + {m.name}"
        source = f"{v.parent} (vocab.json + merges.txt{spelled})"
    return Tokenizer(enc, source, (v, m))


def find_files(directory: str | os.PathLike[str]) -> tuple[Path, Path] | None:
    """The directory's vocab.json + merges.txt (or encoder.json + vocab.bpe), if both are there."""
    d = Path(directory)
    for v, m in TOKENIZER_FILE_PAIRS:
        if (d / v).is_file() and (d / m).is_file():
            return d / v, d / m
    return None


def shipped_tokenizer() -> Tokenizer:
    """The GPT-2 BPE shipped with the package, checked against OpenAI's sha256 (a mismatch is a broken install)."""
    files = [SHIPPED_DIR / name for name in SHIPPED_SHA256]
    for f in files:
        try:
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
        except OSError as e:
            raise CheckpointError(
                f"{f}: cannot read the shipped tokenizer ({e.strerror or e}): reinstall gpt2-port"
            ) from None
        if digest != SHIPPED_SHA256[f.name]:
            raise CheckpointError(
                f"{f}: sha256 {digest[:12]}... is not that of GPT-2's {f.name} ({SHIPPED_SHA256[f.name][:12]}...): "
                "the installed package is damaged, reinstall gpt2-port"
            )
    return from_files(files[0], files[1], f"GPT-2 BPE shipped with gpt2-port ({SHIPPED_DIR})")


def check_tokenizer_dir(directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The files of a directory the user named (--tokenizer DIR); UsageError naming it and what is missing."""
    found = find_files(directory)
    if found is not None:
        return found
    d = Path(directory)
    if not d.is_dir():
        raise UsageError(f"--tokenizer {d}: not a directory (expected one holding vocab.json and merges.txt)")
    missing = [n for n in TOKENIZER_FILE_PAIRS[0] if not (d / n).is_file()]
    raise UsageError(f"--tokenizer {d}: missing {' and '.join(missing)} (OpenAI's encoder.json + vocab.bpe also do)")


def load_tokenizer(directory: str | os.PathLike[str] | None = None, *, strict: bool = False) -> Tokenizer:
    """GPT-2's BPE from `directory`'s files; without them (or with no directory), the copy shipped with the package.

    strict: the directory was named by the user (--tokenizer), so lacking the files is a UsageError naming the
    directory and the missing files, never a silent fallback.
    """
    if directory is not None:
        found = check_tokenizer_dir(directory) if strict else find_files(directory)
        if found is not None:
            return from_files(*found)
        log.info("%s has no tokenizer files: using the GPT-2 BPE shipped with gpt2-port", directory)
    return shipped_tokenizer()


def tokenizer_for(
    checkpoint_root: str | os.PathLike[str] | None, tokenizer_dir: str | os.PathLike[str] | None = None
) -> Tokenizer:
    """The tokenizer a command uses: --tokenizer DIR if given (its files must be there), else the checkpoint's files,
    else the shipped GPT-2 BPE. Never the network."""
    if tokenizer_dir is not None:
        return load_tokenizer(tokenizer_dir, strict=True)
    return load_tokenizer(checkpoint_root)
