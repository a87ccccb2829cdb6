"""GPT-2's byte-level BPE through tiktoken, built offline from a snapshot's vocab.json + merges.txt when present."""

from __future__ import annotations

import codecs
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import tiktoken

from .errors import CheckpointError

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
EOT_ID = 50256


class Tokenizer:
    """encode/decode identical to transformers' GPT2Tokenizer; `<|endoftext|>` in text encodes to 50256."""

    def __init__(self, enc: tiktoken.Encoding, source: str) -> None:
        self.enc = enc
        self.source = source
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


def from_files(vocab_json: str | os.PathLike[str], merges_txt: str | os.PathLike[str]) -> Tokenizer:
    """Build GPT-2's encoding from vocab.json (encoder.json) and merges.txt (vocab.bpe), with no download."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    try:
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=os.fspath(merges_txt), encoder_json_file=os.fspath(vocab_json)
        )
    except Exception as e:  # tiktoken raises plain ValueError/AssertionError/KeyError on bad files
        raise CheckpointError(
            f"{vocab_json} / {merges_txt}: not GPT-2 tokenizer files ({e.__class__.__name__}: {e})"
        ) from None
    enc = tiktoken.Encoding(
        name="gpt2",
        pat_str=_gpt2_pattern(),
        mergeable_ranks=ranks,
        special_tokens={EOT: EOT_ID},
        explicit_n_vocab=50257,
    )
    return Tokenizer(enc, f"{Path(vocab_json).parent} (vocab.json + merges.txt)")


def load_tokenizer(directory: str | os.PathLike[str] | None = None) -> Tokenizer:
    """From `directory` (vocab.json + merges.txt, or OpenAI's encoder.json + vocab.bpe), else tiktoken's 'gpt2'."""
    if directory is not None:
        d = Path(directory)
        for v, m in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
            if (d / v).is_file() and (d / m).is_file():
                return from_files(d / v, d / m)
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:
        where = f"{directory} has no vocab.json + merges.txt, and " if directory is not None else ""
        raise CheckpointError(
            f"no tokenizer: {where}tiktoken could not fetch its 'gpt2' encoding "
            f"({e.__class__.__name__}); pass --tokenizer DIR with vocab.json and merges.txt"
        ) from None
    return Tokenizer(enc, "tiktoken gpt2")
