"""The tokenizer: tiktoken built offline from GPT-2's files, byte-identical to transformers' GPT2Tokenizer, and a
streaming decoder that never shows half a UTF-8 character."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from gpt2_port.errors import CheckpointError, UsageError
from gpt2_port.io.tokenizer import (
    EOT_ID,
    SHIPPED_DIR,
    SHIPPED_SHA256,
    load_tokenizer,
    mergeable_ranks,
    shipped_tokenizer,
)

CORPUS = [
    "The students opened their books",
    "Hello, world! Plain ASCII with punctuation: (a) [b] {c} <d> ~e~ @f #g $h %i ^j &k *l",
    "Accents: café, naïve, façade, Ångström, São Paulo, Dvořák, İstanbul, crème brûlée",
    "CJK: 日本語のテキスト、中文文本，한국어 텍스트。",
    "Emoji: 🎉🚀 👩‍👩‍👧‍👦 🇫🇷 ❤️ 👍🏽",
    "runs of spaces:  two   three    four          ten",
    "\ttabs\t\tand\t\t\tmore\t",
    "newlines\n\nblank\n\n\n\nlines\r\nwindows\r\n",
    "  leading and trailing spaces  ",
    "Contractions: don't, I'm, we've, they'll, she'd, it's, y'all, DON'T, O'Neil",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1,000,000 2024-01-01 0x1F 1e-9",
    "before<|endoftext|>after",
    "<|endoftext|>",
    "two <|endoftext|> <|endoftext|>in a row<|endoftext|>",
    "mixed: Zürich 東京 🎌 don't  \t 42\n",
    "",
    " ",
    "a" * 300,
    "\u00a0non-breaking\u2003em space\u200bzero-width",
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """transformers' GPT2Tokenizer read from a snapshot-style directory (vocab.json + merges.txt)."""
    from transformers import GPT2Tokenizer

    d = tmp_path_factory.mktemp("hf_tok")
    shutil.copyfile(tokenizer_dir / "encoder.json", d / "vocab.json")
    shutil.copyfile(tokenizer_dir / "vocab.bpe", d / "merges.txt")
    return GPT2Tokenizer.from_pretrained(d)


def test_known_ids_and_eot(tok) -> None:
    assert tok.encode("The students opened their books") == [464, 2444, 4721, 511, 3835]
    assert tok.encode("<|endoftext|>") == [EOT_ID] == [50256]
    assert tok.decode([EOT_ID]) == "<|endoftext|>"
    assert tok.n_vocab == 50257


def test_built_offline_from_files(tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both file spellings build the encoding without tiktoken's download (which is made to fail here)."""
    import tiktoken

    def no_download(name: str):
        raise AssertionError(f"tiktoken.get_encoding({name!r}) called: the tokenizer should be built from files")

    monkeypatch.setattr(tiktoken, "get_encoding", no_download)
    shutil.copyfile(tokenizer_dir / "encoder.json", tmp_path / "vocab.json")
    shutil.copyfile(tokenizer_dir / "vocab.bpe", tmp_path / "merges.txt")
    for d in (tokenizer_dir, tmp_path):
        t = load_tokenizer(d)
        assert "vocab.json + merges.txt" in t.source
        assert t.encode("The students opened their books") == [464, 2444, 4721, 511, 3835]


def test_no_tokenizer_files_falls_back_to_the_shipped_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory without the files (a checkpoint written without them) gets the BPE shipped in the package; the
    network and tiktoken's downloads and file cache are never used."""
    import tiktoken
    import tiktoken.load

    def no_fetch(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("tiktoken fetched or cached a file: the tokenizer must read its files directly")

    monkeypatch.setattr(tiktoken, "get_encoding", no_fetch)
    monkeypatch.setattr(tiktoken.load, "read_file_cached", no_fetch)
    monkeypatch.setattr(tiktoken.load, "read_file", no_fetch)
    t = load_tokenizer(tmp_path)
    assert "shipped with gpt2-port" in t.source and str(SHIPPED_DIR) in t.source
    assert t.encode("The students opened their books") == [464, 2444, 4721, 511, 3835]
    assert "shipped" in load_tokenizer(None).source


def test_encode_decode_match_transformers(tok, hf_tok) -> None:
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.decode(ids) == hf_tok.decode(ids) == text, text


def test_decode_of_arbitrary_ids_matches_transformers(tok, hf_tok) -> None:
    """Random id sequences (many end or start mid-character) decode to the same string, U+FFFD included."""
    rng = random.Random(0)
    byte_tokens = [i for i in range(50257) if len(tok.decode_bytes([i])) == 1 and tok.decode_bytes([i])[0] >= 0x80]
    assert len(byte_tokens) > 60
    for _ in range(200):
        ids = [
            rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(50257) for _ in range(rng.randrange(1, 12))
        ]
        assert tok.decode(ids) == hf_tok.decode(ids), ids


def _stream(tok, ids: list[int]) -> list[str]:
    d = tok.stream_decoder()
    return [d.push(i) for i in ids] + [d.flush()]


def test_stream_decoder_never_splits_a_character(tok) -> None:
    for text in CORPUS:
        ids = tok.encode(text)
        chunks = _stream(tok, ids)
        assert "".join(chunks) == text, text
        assert all("\ufffd" not in c for c in chunks), text  # no replacement character from a split byte sequence
    # an emoji spread over several tokens shows up whole, at its last token, with nothing before it
    ids = tok.encode(" 🎉")
    assert len(ids) > 1
    chunks = _stream(tok, ids)
    assert "".join(chunks[:-2]) == " "  # the space may show early, no byte of the emoji does
    assert chunks[-2:] == ["🎉", ""]


def test_stream_decoder_holds_back_partial_bytes(tok) -> None:
    ids = tok.encode("語")
    assert len(ids) >= 2  # this character spans tokens
    d = tok.stream_decoder()
    assert d.push(ids[0]) == ""
    assert d.pending == tok.decode_bytes(ids[:1])
    assert "".join(d.push(i) for i in ids[1:]) == "語"
    assert d.pending == b""


def test_stream_decoder_matches_decode_on_random_ids(tok) -> None:
    """Whatever the ids, the streamed text is exactly decode(ids), invalid bytes included."""
    rng = random.Random(1)
    for _ in range(200):
        ids = [
            rng.randrange(50257) if rng.random() < 0.5 else rng.randrange(128, 256) for _ in range(rng.randrange(1, 15))
        ]
        assert "".join(_stream(tok, ids)) == tok.decode(ids), ids
    d = tok.stream_decoder()  # a truncated character at the end becomes one U+FFFD at flush, as decode gives
    ids = tok.encode("🎉")[:-1]
    assert "".join(d.push(i) for i in ids) == ""
    assert d.flush() == tok.decode(ids) == "\ufffd"


# -- files read directly, the shipped copy, and what a missing or changed file does ---------------------------------


def test_shipped_files_are_openais_with_their_licence(tokenizer_dir: Path) -> None:
    import hashlib

    for name, sha in SHIPPED_SHA256.items():
        data = (SHIPPED_DIR / name).read_bytes()
        assert data == (tokenizer_dir / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha
    lic = (SHIPPED_DIR / "LICENSE").read_text(encoding="utf-8")
    assert "Modified MIT License" in lic and "Copyright (c) 2019 OpenAI" in lic


def test_ranks_and_encodings_identical_to_tiktokens_loader(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks computed here equal tiktoken's data-gym loader's (same order too), and the whole tiny shakespeare
    corpus encodes to the same ids as through tiktoken's loader."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    from gpt2_port.io.tokenizer import _gpt2_pattern

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))  # its cache stays in the test's directory
    ref_ranks = data_gym_to_mergeable_bpe_ranks(str(tokenizer_dir / "vocab.bpe"), str(tokenizer_dir / "encoder.json"))
    ours = mergeable_ranks(SHIPPED_DIR / "encoder.json", SHIPPED_DIR / "vocab.bpe")
    assert list(ours.items()) == list(ref_ranks.items())
    ref = tiktoken.Encoding(
        name="gpt2", pat_str=_gpt2_pattern(), mergeable_ranks=ref_ranks, special_tokens={"<|endoftext|>": 50256}
    )
    text = (tokenizer_dir.parent / "data" / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    ids = shipped_tokenizer().encode(text)
    assert ids == ref.encode(text, allowed_special="all") and len(ids) == 338025


def test_a_changed_file_is_never_ignored(tokenizer_dir: Path, tmp_path: Path) -> None:
    """The files are read on every load: a file overwritten at the same path is what the next load sees."""
    shutil.copyfile(tokenizer_dir / "encoder.json", tmp_path / "vocab.json")
    shutil.copyfile(tokenizer_dir / "vocab.bpe", tmp_path / "merges.txt")
    assert load_tokenizer(tmp_path).encode("Hello") == [15496]
    (tmp_path / "vocab.json").write_text('{"garbage": 1}')
    with pytest.raises(CheckpointError, match=r"vocab.json / .*merges.txt: not GPT-2 tokenizer files"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.json").write_text("not json")
    with pytest.raises(CheckpointError, match="not GPT-2 tokenizer files"):
        load_tokenizer(tmp_path)


def test_explicit_directory_without_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(UsageError) as e:
        load_tokenizer(tmp_path, strict=True)
    assert str(e.value) == f"--tokenizer {tmp_path}: missing merges.txt (OpenAI's encoder.json + vocab.bpe also do)"
    with pytest.raises(UsageError, match="not a directory"):
        load_tokenizer(tmp_path / "nope", strict=True)


def test_damaged_shipped_copy_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gpt2_port.io.tokenizer as tokenizer

    for name in SHIPPED_SHA256:
        shutil.copyfile(SHIPPED_DIR / name, tmp_path / name)
    with open(tmp_path / "vocab.bpe", "ab") as f:
        f.write(b"\n")
    monkeypatch.setattr(tokenizer, "SHIPPED_DIR", tmp_path)
    with pytest.raises(CheckpointError, match=r"vocab.bpe: sha256 .* is not that of GPT-2's vocab.bpe .*reinstall"):
        shipped_tokenizer()
