"""Every command works on a checkpoint without tokenizer files, with no network and HF_HUB_OFFLINE set; an explicit
--tokenizer without the files is a one-line error before the load; inspect says whether tokenizer files are there."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

import pytest

from gpt2_port.cli import main
from gpt2_port.config import GPT2Config
from gpt2_port.io.demo import write_demo_checkpoint

CFG = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64)


@pytest.fixture(scope="module")
def no_tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint as demo-checkpoint writes it without --tokenizer-from: config.json + model.safetensors only."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("no_tok"), config=CFG, seed=1)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Any connection attempt fails the test; HF_HUB_OFFLINE is set; the temporary directory is private (so a
    cache that tiktoken might create would show)."""

    def refuse(self, *a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError(f"network used: connect{a}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = tmp_path / "systmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def test_generate_offline_without_tokenizer_files(
    no_tok: Path, no_network: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "g.json"
    argv = ["generate", str(no_tok), "The students opened their books", "--greedy", "--max-new-tokens", "3"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["prompt_ids"] == [464, 2444, 4721, 511, 3835]  # the shipped GPT-2 BPE
    assert list(no_network.iterdir()) == []  # no data-gym-cache or anything else grew
    assert capsys.readouterr().out.startswith("The students opened their books")


def test_attention_offline_without_tokenizer_files(
    no_tok: Path, no_network: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "a.png"
    assert main(["attention", str(no_tok), "Hello world", "--layer", "0", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "attention"])
def test_explicit_tokenizer_without_files_fails_before_the_load(
    command: str, no_tok: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpt2_port.model as load

    def no_load(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("loaded the model before checking --tokenizer")

    monkeypatch.setattr(load, "from_pretrained", no_load)
    empty = tmp_path / "tok"
    empty.mkdir()
    extra = ["--layer", "0", "--png", str(tmp_path / "a.png")] if command == "attention" else []
    rc = main([command, str(no_tok), "Hello", *extra, "--tokenizer", str(empty)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"--tokenizer {empty}: missing vocab.json and merges.txt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


def test_inspect_says_whether_tokenizer_files_are_there(
    no_tok: Path, tiny_official: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(no_tok), "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "tokenizer none in the checkpoint (commands use the GPT-2 BPE shipped with gpt2-port)" in out
    assert json.loads((tmp_path / "a.json").read_text())["tokenizer_files"] is None
    assert main(["inspect", str(tiny_official), "--json", str(tmp_path / "b.json")]) == 0
    assert "tokenizer vocab.json + merges.txt" in capsys.readouterr().out
    files = json.loads((tmp_path / "b.json").read_text())["tokenizer_files"]
    assert [os.path.basename(f) for f in files] == ["vocab.json", "merges.txt"]
