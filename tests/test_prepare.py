"""gpt2-port prepare: nanoGPT's .bin format and counts, streamed encoding equal to encoding the whole text, the split by
documents, and nothing half-written."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from gpt2_port.cli import main
from gpt2_port.errors import UsageError
from gpt2_port.io.text import safe_cut
from gpt2_port.io.tokenizer import EOT_ID, Tokenizer, load_tokenizer
from gpt2_port.train.prepare import StreamEncoder, encode_stream, prepare

# nanoGPT's data/shakespeare/readme.md (and the comment closing its prepare.py), for this exact input.txt
NANOGPT_TRAIN_TOKENS = 301_966
NANOGPT_VAL_TOKENS = 36_059
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def shakespeare(tokenizer_dir: Path) -> Path:
    p = tokenizer_dir.parent / "data" / "tinyshakespeare" / "input.txt"
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing: the tests need ../shared/data/tinyshakespeare beside the repo")
    return p


def ids(path: Path) -> np.ndarray:
    """Read a .bin as nanoGPT's train.py does."""
    return np.array(np.memmap(path, dtype=np.uint16, mode="r"))


def test_shakespeare_gives_nanogpts_published_counts_and_ids(
    shakespeare: Path, tokenizer_dir: Path, tok: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "data" / "shakespeare"
    rc = main(["prepare", str(shakespeare), "--out", str(out), "--tokenizer", str(tokenizer_dir)])
    assert rc == 0
    said = capsys.readouterr()
    assert "301,966 tokens" in said.out and "from 1 file, 1.1 MB (split at character 1,003,854)" in said.out
    assert "note:" not in said.err  # both splits hold many 1024-token windows
    train, val = ids(out / "train.bin"), ids(out / "val.bin")
    assert (len(train), len(val)) == (NANOGPT_TRAIN_TOKENS, NANOGPT_VAL_TOKENS)
    assert (out / "train.bin").stat().st_size == 2 * NANOGPT_TRAIN_TOKENS  # no header
    # nanoGPT's prepare.py, step by step: the 90% character split, each part encoded on its own
    text = shakespeare.read_text(encoding="utf-8")
    n = len(text)
    assert train.tolist() == tok.enc.encode_ordinary(text[: int(n * 0.9)])
    assert val.tolist() == tok.enc.encode_ordinary(text[int(n * 0.9) :])
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["train_tokens"], meta["val_tokens"]) == (NANOGPT_TRAIN_TOKENS, NANOGPT_VAL_TOKENS)
    assert (meta["dtype"], meta["vocab_size"], meta["eot_token"]) == ("uint16", 50257, 50256)
    assert meta["sources"] == [
        {"path": str(shakespeare), "bytes": 1_115_394, "sha256": SHAKESPEARE_SHA256, "chars": n, "split": "train+val"}
    ]
    assert meta["split"] == {"rule": "characters", "val_fraction": 0.1, "train_chars": int(n * 0.9),
                             "val_chars": n - int(n * 0.9)}  # fmt: skip
    assert meta["tokenizer"]["files_sha256"] == {
        "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
        "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    }
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]  # no temporary left


def test_meta_names_the_shipped_tokenizer_files_by_their_sha256(shakespeare: Path, tmp_path: Path) -> None:
    """Without --tokenizer the shipped BPE encodes; meta.json holds its files' sha256 (OpenAI's, checked at load)."""
    from gpt2_port.io.tokenizer import SHIPPED_SHA256, shipped_tokenizer

    f = tmp_path / "t.txt"
    f.write_bytes(shakespeare.read_bytes()[:4000])
    meta = prepare([f], tmp_path / "out", shipped_tokenizer())
    assert meta["tokenizer"]["files_sha256"] == SHIPPED_SHA256 and meta["tokenizer"]["vocab_sha256"]


def test_small_chunks_give_the_same_ids_as_encoding_whole_parts(
    shakespeare: Path, tok: Tokenizer, tmp_path: Path
) -> None:
    """1.5 kB reads and pieces of 1000 to 2500 characters, cut anywhere but at a line end, give the same files."""
    calls: list[int] = []
    orig = tok.encode_ordinary

    class Counting(Tokenizer):
        def encode_ordinary(self, text: str) -> list[int]:
            calls.append(len(text))
            return orig(text)

    counting = Counting(tok.enc, tok.source)
    prepare([shakespeare], tmp_path / "a", counting, read_bytes=1499, encode_chars=1000)
    assert len(calls) > 700 and max(calls) < 2500  # it did encode in small pieces
    prepare([shakespeare], tmp_path / "b", tok)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert len(ids(tmp_path / "a" / "train.bin")) == NANOGPT_TRAIN_TOKENS


def test_streamed_encoding_of_shakespeare_equals_encoding_it_whole(shakespeare: Path, tok: Tokenizer) -> None:
    text = shakespeare.read_text(encoding="utf-8")
    pieces = (text[i : i + 777] for i in range(0, len(text), 777))
    assert list(encode_stream(tok, pieces, encode_chars=500)) == tok.enc.encode_ordinary(text)


# Pieces chosen to tempt a wrong cut: runs of whitespace (the pre-tokenizer's \s+(?!\S) keeps the last space for the
# next word), Unicode spaces, contractions, digits, punctuation, multi-byte characters and the special-token text.
HOSTILE = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "\u2028", "\x1c", "\x85", "'s", "'ll", "'",
           "a", "Word", "123", "4", "!!", ".", "é", "日本", "🙂", "<|endoftext|>", "x y", " z"]  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_streamed_encoding_of_hostile_text_equals_encoding_it_whole(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(HOSTILE) for _ in range(3000))
    whole = tok.enc.encode_ordinary(text)
    for encode_chars in (1, 2, 7, 64):
        pos, pieces = 0, []
        while pos < len(text):
            n = rng.randint(1, 40)
            pieces.append(text[pos : pos + n])
            pos += n
        assert list(encode_stream(tok, iter(pieces), encode_chars)) == whole, (seed, encode_chars)


def test_long_stretches_without_a_cut_are_held_and_encoded_whole(tok: Tokenizer) -> None:
    text = "a" * 3000 + " b" + "日" * 2500 + "\n\n" + "c" * 10 + " d" * 50
    pieces = [text[i : i + 37] for i in range(0, len(text), 37)]
    assert list(encode_stream(tok, iter(pieces), encode_chars=100)) == tok.enc.encode_ordinary(text)


def test_reads_that_split_utf8_characters_give_the_whole_texts_ids(tok: Tokenizer, tmp_path: Path) -> None:
    rng = random.Random(7)
    docs = ["".join(rng.choice(HOSTILE) for _ in range(800)) for _ in range(3)]
    files = []
    for i, d in enumerate(docs):
        files.append(tmp_path / f"d{i}.txt")
        files[-1].write_text(d, encoding="utf-8", newline="")
    prepare(files, tmp_path / "out", tok, val_fraction=0.34, read_bytes=3, encode_chars=5)
    expect_train = tok.enc.encode_ordinary(docs[0]) + [EOT_ID] + tok.enc.encode_ordinary(docs[1])
    assert ids(tmp_path / "out" / "train.bin").tolist() == expect_train
    assert ids(tmp_path / "out" / "val.bin").tolist() == tok.enc.encode_ordinary(docs[2])


def test_safe_cut_is_after_a_non_space_and_before_a_space_or_newline() -> None:
    assert safe_cut("ab\n\ncd") == 2  # before the whitespace run, never inside it
    assert safe_cut("ab cd ef") == 5
    assert safe_cut("ab  \n") == 2
    assert safe_cut("abcdef") == 0
    assert safe_cut("  \n\n") == 0
    assert safe_cut("a\u00a0 b") == 0  # U+00A0 is whitespace to the regex: the space after it is no boundary


def test_isspace_covers_every_character_the_pretokenizers_whitespace_matches(tok: Tokenizer) -> None:
    """safe_cut relies on it: tiktoken's regex \\s is Unicode White_Space; str.isspace must be true for each of them."""
    import regex  # the `regex` package (a transformers dependency) knows Unicode properties; Rust's \s is White_Space

    every = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    white = regex.findall(r"\p{White_Space}", every)
    assert len(white) == 25 and all(c.isspace() for c in white)
    for w in white:  # and cutting before a space after a non-space holds next to each of them
        text = f"a{w} b{w}{w} c {w}d"
        assert list(encode_stream(tok, iter(text), encode_chars=1)) == tok.enc.encode_ordinary(text), repr(w)


def test_pending_text_stays_bounded_by_the_piece_size(shakespeare: Path, tok: Tokenizer) -> None:
    """Memory is flat: after each push the encoder holds less than one piece of text."""
    held = []
    enc = StreamEncoder(tok, lambda ids: None, encode_chars=2000)
    text = shakespeare.read_text(encoding="utf-8")
    for i in range(0, len(text), 4096):
        enc.push(text[i : i + 4096])
        held.append(len(enc.pending))
    assert max(held) < 2000  # encoded in pieces of at most encode_chars, the rest held


def test_endoftext_written_in_a_file_is_ordinary_text(tok: Tokenizer, tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("one <|endoftext|> two\n" * 50)
    prepare([f], tmp_path / "out", tok)
    both = np.concatenate([ids(tmp_path / "out" / "train.bin"), ids(tmp_path / "out" / "val.bin")])
    assert EOT_ID not in both.tolist()
    assert "<|endoftext|>" in tok.decode(both.tolist())


def test_several_files_are_documents_split_by_document_with_eot_between(tok: Tokenizer, tmp_path: Path) -> None:
    texts = [f"Document {i}: {'word ' * (i + 1)}\n" for i in range(10)]
    files = []
    for i, t in enumerate(texts):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(t)
    meta = prepare(files, tmp_path / "out", tok, val_fraction=0.2)
    enc = [tok.enc.encode_ordinary(t) for t in texts]

    def joined(docs: list[list[int]]) -> list[int]:
        out: list[int] = []
        for n, d in enumerate(docs):
            out += ([EOT_ID] if n else []) + d
        return out

    assert ids(tmp_path / "out" / "train.bin").tolist() == joined(enc[:8])
    assert ids(tmp_path / "out" / "val.bin").tolist() == joined(enc[8:])  # the last round(10 * 0.2) files
    assert meta["split"]["rule"] == "documents"
    assert meta["split"]["val_sources"] == [str(files[8]), str(files[9])]
    assert [s["split"] for s in meta["sources"]] == ["train"] * 8 + ["val"] * 2
    assert [s["bytes"] for s in meta["sources"]] == [len(t.encode()) for t in texts]
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta


def test_val_share_of_documents_rounds_half_up_and_an_empty_split_is_an_error(tok: Tokenizer, tmp_path: Path) -> None:
    files = []
    for i in range(4):
        files.append(tmp_path / f"d{i}.txt")
        files[-1].write_text(f"text {i}\n")
    assert prepare(files, tmp_path / "o1", tok, val_fraction=0.125)["split"]["val_documents"] == 1  # 0.5 -> 1
    assert prepare(files, tmp_path / "o2", tok, val_fraction=0.5)["split"]["val_documents"] == 2
    with pytest.raises(UsageError, match=r"--val-fraction 0.1 of 4 documents .* none in val.bin.*>= 0.125"):
        prepare(files, tmp_path / "o3", tok, val_fraction=0.1)
    with pytest.raises(UsageError, match=r"all of them in val.bin"):
        prepare(files, tmp_path / "o4", tok, val_fraction=0.9)
    assert not (tmp_path / "o3").exists() and not (tmp_path / "o4").exists()


def test_an_empty_file_among_several_is_skipped_with_a_warning(
    tok: Tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    names = ["a", "empty", "b", "c"]
    for n in names:
        (tmp_path / n).write_text("" if n == "empty" else f"text {n}\n")
    meta = prepare([tmp_path / n for n in names], tmp_path / "out", tok, val_fraction=0.34)
    assert "empty: empty file, skipped" in caplog.text
    assert [s["split"] for s in meta["sources"]] == ["train", "skipped (empty)", "train", "val"]
    assert EOT_ID in ids(tmp_path / "out" / "train.bin").tolist()
    assert ids(tmp_path / "out" / "train.bin").tolist().count(EOT_ID) == 1


@pytest.mark.parametrize("read_bytes", [1, 7, 1 << 20])
def test_a_byte_order_mark_windows_line_endings_and_json_lines_are_named_and_kept(
    tok: Tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture, read_bytes: int
) -> None:
    """Each is encoded as the file has it (nanoGPT's tokens), and named once: BOM, the count of \\r\\n (a pair cut by
    a read counted once), a .jsonl suffix."""
    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    a.write_bytes(b"\xef\xbb\xbfOne line.\r\nTwo lines.\r\nThree\r\n")
    b.write_text('{"text": "plain"}\n')
    meta = prepare([a, b], tmp_path / "out", tok, val_fraction=0.5, read_bytes=read_bytes)
    assert caplog.text.count("byte-order mark") == 1 and "a.txt: 3 Windows line ending(s)" in caplog.text
    assert "b.jsonl: encoded as plain text" in caplog.text and "b.jsonl: starts" not in caplog.text
    assert ids(tmp_path / "out" / "train.bin").tolist() == tok.encode(a.read_bytes().decode("utf-8"))
    assert meta["train_tokens"] > 0
    caplog.clear()
    c = tmp_path / "c.txt"
    c.write_text("plain\ntext \r here\n")
    prepare([c], tmp_path / "out2", tok, val_fraction=0.5, read_bytes=read_bytes)
    assert "WARNING" not in caplog.text and not caplog.records


class Interrupting(Tokenizer):
    """Raises KeyboardInterrupt (Ctrl-C) on the n-th encode call."""

    def __init__(self, tok: Tokenizer, n: int) -> None:
        super().__init__(tok.enc, tok.source)
        self.n = n

    def encode_ordinary(self, text: str) -> list[int]:
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt
        return self.enc.encode_ordinary(text)


def test_ctrl_c_leaves_nothing_half_written_and_old_outputs_untouched(
    shakespeare: Path, tok: Tokenizer, tmp_path: Path
) -> None:
    new = tmp_path / "new" / "dir"
    with pytest.raises(KeyboardInterrupt):
        prepare([shakespeare], new, Interrupting(tok, 5), read_bytes=10_000, encode_chars=10_000)
    assert not (tmp_path / "new").exists()  # the directories it created are gone too
    old = tmp_path / "old"
    old.mkdir()
    (old / "train.bin").write_bytes(b"old")
    (old / "meta.json").write_text("{}")
    with pytest.raises(KeyboardInterrupt):
        prepare([shakespeare], old, Interrupting(tok, 5), read_bytes=10_000, encode_chars=10_000)
    assert sorted(p.name for p in old.iterdir()) == ["meta.json", "train.bin"]
    assert (old / "train.bin").read_bytes() == b"old"


@pytest.mark.parametrize("read_bytes", [1, 5, 4096])
def test_a_bad_byte_is_reported_with_its_file_offset(tok: Tokenizer, tmp_path: Path, read_bytes: int) -> None:
    data = ("héllo wörld 🙂\n" * 40).encode()
    f = tmp_path / "latin1.txt"
    f.write_bytes(data[:333] + b"\xe9t\xe9" + data[333:])  # Latin-1 "été" inside UTF-8 text
    expect = _first_bad(f.read_bytes())  # Python's own decoder says where the first bad byte is
    assert 300 < expect <= 333
    with pytest.raises(UsageError) as e:
        prepare([f], tmp_path / "out", tok, read_bytes=read_bytes)
    bad = f.read_bytes()[expect]
    assert f"{f}: not UTF-8 text: invalid byte 0x{bad:02x} at byte offset {expect}; expected UTF-8" == str(e.value)
    assert not (tmp_path / "out").exists()


def _first_bad(b: bytes) -> int:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start
    raise AssertionError("valid")


def test_a_file_cut_inside_a_character_is_reported(tok: Tokenizer, tmp_path: Path) -> None:
    f = tmp_path / "cut.txt"
    f.write_bytes("abc 🙂".encode()[:-2])
    with pytest.raises(UsageError, match=r"cut.txt: not UTF-8 text: the file ends inside a character .* offset 4"):
        prepare([f], tmp_path / "out", tok, read_bytes=2)


def test_progress_reports_scan_then_encode_up_to_the_total(shakespeare: Path, tok: Tokenizer, tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    prepare([shakespeare], tmp_path / "out", tok, progress=lambda *a: seen.append(a), read_bytes=100_000)
    total = shakespeare.stat().st_size
    phases = [p for p, _, _ in seen]
    assert phases == sorted(phases, key=["scan", "encode"].index)
    for phase in ("scan", "encode"):
        done = [d for p, d, t in seen if p == phase]
        assert done == sorted(done) and done[-1] == total and len(done) == 12
    assert all(t == total for _, _, t in seen)


def test_cli_shows_progress_as_plain_lines_when_stderr_is_not_a_terminal(
    shakespeare: Path, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    argv = ["prepare", str(shakespeare), "--out", str(tmp_path / "o"), "--tokenizer", str(tokenizer_dir)]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # a second's work writes no progress line to a log
    monkeypatch.setenv("GPT2_PORT_PROGRESS_SECONDS", "0")  # as if every read took the interval
    assert main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert main(argv) == 0  # pytest's stderr is not a terminal: whole lines, no carriage returns
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n")
    lines = err.splitlines()
    assert any(ln.startswith("scan") and "100%" in ln for ln in lines)
    assert any(ln.startswith("encode") and "100%" in ln and "1.1 MB/1.1 MB" in ln for ln in lines)


def test_cli_shows_the_bar_when_stderr_is_a_terminal(
    shakespeare: Path,
    tokenizer_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["prepare", str(shakespeare), "--out", str(tmp_path / "o"), "--tokenizer", str(tokenizer_dir)]) == 0
    err = capsys.readouterr().err
    assert "\rencode [" in err and "100%" in err


def test_a_split_shorter_than_one_window_is_named_with_its_ways_out(
    shakespeare: Path, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A small corpus prepares, but train would refuse a split shorter than its default window (GPT-2's 1024
    tokens + 1): said at once, with the --block-size that fits, for each split that is short."""
    text = tmp_path / "t.txt"
    text.write_text(shakespeare.read_text(encoding="utf-8")[:30_000], encoding="utf-8")
    assert main(["prepare", str(text), "--out", str(tmp_path / "o"), "--tokenizer", str(tokenizer_dir)]) == 0
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["train_tokens"] > 1024 >= meta["val_tokens"] > 1
    said = capsys.readouterr()
    assert "from 1 file, 30.0 kB" in said.out
    n = meta["val_tokens"]
    assert said.err.splitlines() == [
        f"note: val.bin holds {n:,} tokens, fewer than the 1,025 train's default window needs (GPT-2's 1024-token "
        f"context + 1): train with --block-size {n - 1} or less, without validation (remove val.bin), or prepare "
        "more text"
    ]
