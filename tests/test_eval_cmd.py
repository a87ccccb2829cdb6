"""`gpt2-port eval`: the JSON keys, --json -, --markdown, --check, published figures, the progress bar."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from gpt2_port.cli import main

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"
TEXT_KEYS = {"tokens", "nll", "perplexity", "bytes", "bits_per_byte", "byte_perplexity", "words", "word_perplexity"}


@pytest.fixture()
def text(tmp_path: Path) -> Path:
    f = tmp_path / "t.txt"
    f.write_text(SHAKESPEARE.read_text()[:1500])
    return f


@pytest.fixture()
def lambada(tmp_path: Path) -> Path:
    f = tmp_path / "l.jsonl"
    lines = ["The cat sat on the mat and then the cat", "She opened the door and said goodbye", "One two three four"]
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return f


@pytest.fixture()
def choices(tmp_path: Path) -> Path:
    f = tmp_path / "c.jsonl"
    docs = [
        {"ctx": "A man is sitting on a roof. He", "endings": ["starts pulling up roofing.", "is", "eats"], "label": 0},
        {"ctx": "The chef", "endings": ["cooks dinner.", "sleeps"], "label": 1},
    ]
    f.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return f


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["eval", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_text_json_has_every_key_and_lm_eval_formulas(tiny_official: Path, text: Path, tmp_path: Path, capsys) -> None:
    out_json = tmp_path / "r.json"
    rc, out, _ = run(capsys, str(tiny_official), "--text", str(text), "--json", str(out_json), "--max-length", "64")
    assert rc == 0
    d = json.loads(out_json.read_text())
    assert TEXT_KEYS <= set(d) and d["method"].startswith("rolling") and d["max_length"] == 64
    assert d["bytes"] == len(text.read_bytes()) and d["windows"] == math.ceil(d["tokens"] / 64)
    assert math.isclose(d["perplexity"], math.exp(d["nll"] / d["tokens"]))
    assert math.isclose(d["bits_per_byte"], d["nll"] / d["bytes"] / math.log(2))
    assert math.isclose(d["word_perplexity"], math.exp(d["nll"] / d["words"]))
    assert f"perplexity           {d['perplexity']:.6g}" in out
    assert d["published"] == [] and "Published" not in out  # a local path: no published figures
    assert out.splitlines()[-1] == f"wrote {out_json}"  # as every command says of each file it writes


def test_json_to_stdout_is_only_json(tiny_official: Path, text: Path, capsys) -> None:
    rc, out, err = run(capsys, str(tiny_official), "--text", str(text), "--json", "-", "--stride", "32")
    assert rc == 0
    d = json.loads(out)
    assert d["stride"] == 32 and d["method"] == "strided (stride 32)" and TEXT_KEYS <= set(d)
    assert "scored in" in err


def test_markdown_table(tiny_official: Path, lambada: Path, tmp_path: Path, capsys) -> None:
    md = tmp_path / "r.md"
    rc, out, _ = run(capsys, str(tiny_official), "--lambada", str(lambada), "--markdown", str(md))
    assert rc == 0 and out.splitlines()[-1] == f"wrote {md}"
    lines = md.read_text().splitlines()
    assert "| metric | value |" in lines and any(ln.startswith("| accuracy | ") for ln in lines)
    assert any(ln.startswith("| n | 3 |") for ln in lines)


def test_lambada_and_choices_json_keys(tiny_official: Path, lambada: Path, choices: Path, capsys) -> None:
    rc, out, _ = run(capsys, str(tiny_official), "--lambada", str(lambada), "--json", "-")
    d = json.loads(out)
    assert rc == 0 and d["n"] == 3 and 0 <= d["accuracy"] <= 1 and d["perplexity"] > 1
    rc, out, _ = run(capsys, str(tiny_official), "--choices", str(choices), "--json", "-", "--batch-size", "2")
    d = json.loads(out)
    assert rc == 0 and d["n"] == 2 and d["normalisation"] == "characters"
    assert d["acc"] in (0, 0.5, 1) and d["acc_norm"] in (0, 0.5, 1)


def test_check_reports_parity_and_fails_with_exit_1(
    tiny_official: Path, text: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    md = tmp_path / "r.md"
    rc, out, _ = run(capsys, str(tiny_official), "--text", str(text), "--check", "--markdown", str(md))
    assert rc == 0, out
    lines = md.read_text().splitlines()  # the check's table and verdicts in the Markdown too
    assert "## parity against transformers (float32, same windows, same batches)" in lines
    assert "| quantity | gpt2_port | transformers | diff | tol | floor | vs floor | result |" in lines
    assert any(ln.startswith("- as close to sdpa transformers (float32)") for ln in lines) and lines[-1] == "- PASS"
    assert "parity against transformers (float32" in out and "PASS" in out
    # the reference's own noise floor beside each difference, by default: eager against sdpa transformers
    assert re.search(r"\bfloor +vs floor +result\n", out) and "noise floor: transformers' own eager attention" in out
    assert "as close to sdpa transformers (float32) as transformers' own eager attention is: YES" in out
    rc, out, _ = run(capsys, str(tiny_official), "--choices", str(text.parent / "missing.jsonl"))
    assert rc == 2

    import gpt2_port_checks.evaluation as ev

    real = ev.reference_scorer

    def off_by_a_bit(*a, **k):  # noqa: ANN002, ANN003, ANN202
        s = real(*a, **k)
        head = s.head
        s.head = lambda h: head(h) * 1.001
        return s

    monkeypatch.setattr(ev, "reference_scorer", off_by_a_bit)
    # without the floor (only the sdpa reference loaded: the rows above the floor are tests/test_evaluate.py's)
    rc, out, _ = run(capsys, str(tiny_official), "--text", str(text), "--check", "--no-noise-floor", "--json", "-")
    d = json.loads(out)
    assert rc == 1 and d["check"]["passed"] is False
    rows = {r["quantity"]: r for r in d["check"]["rows"]}
    assert not rows["total nll"]["passed"]
    assert d["check"]["noise_floor"] is None and d["check"]["as_close_as_reference"] is None
    assert all(r["floor"] is None and r["within_noise"] is None for r in d["check"]["rows"])


def test_check_on_lambada_and_choices(tiny_official: Path, lambada: Path, choices: Path, capsys) -> None:
    for flag, f, acc in (("--lambada", lambada, "accuracy"), ("--choices", choices, "acc_norm")):
        rc, out, _ = run(capsys, str(tiny_official), flag, str(f), "--check", "--json", "-")
        d = json.loads(out)
        assert rc == 0 and d["check"]["passed"] is True, d["check"]
        assert d["check"]["as_close_as_reference"] is True and d["check"]["noise_floor"].startswith("transformers'")
        rows = {r["quantity"].split(" (")[0]: r for r in d["check"]["rows"]}
        assert rows[acc]["diff"] == 0 and rows["total nll"]["diff"] <= 1e-6
        assert rows["total nll"]["within_noise"] is True and rows["total nll"]["noise_verdict"] == "within noise"
        assert all(r["floor"] is not None and r["noise_verdict"] for r in d["check"]["rows"])
        assert any(q.startswith("worst ") for q in rows)


def test_official_id_prints_the_published_figures(
    tiny_official: Path, lambada: Path, capsys, monkeypatch, tmp_path: Path
) -> None:
    """Hub ids (served by a local fake of the Hub: the real weights are not here) get the published figures beside
    this run's; a local directory that happens to be named gpt2 does not (it is read first, and is not those files)."""
    from fakehub import FakeHub, read_dir

    hub = FakeHub()
    for repo in ("openai-community/gpt2", "openai-community/gpt2-xl"):
        hub.add_repo(repo, read_dir(tiny_official))
    with hub:
        hub.patch(monkeypatch, tmp_path / "cache")
        rc, out, _ = run(capsys, "openai-community/gpt2", "--lambada", str(lambada))
        assert rc == 0 and "Published figures" in out
        assert "35.13" in out and "0.4599" in out and "Radford et al. 2019" in out  # the paper's LAMBADA
        assert "40.0554" in out and "issue #2159" in out  # lm-eval's, for gpt2
        rc, out, _ = run(capsys, "gpt2-xl", "--lambada", str(lambada), "--json", "-")
        pub = {(p["metric"], p["value"]) for p in json.loads(out)["published"]}
        assert pub == {("perplexity", 8.63), ("accuracy", 0.6324), ("perplexity", 10.63)}
        (tmp_path / "here").mkdir()
        (tmp_path / "here" / "gpt2").symlink_to(tiny_official)
        monkeypatch.chdir(tmp_path / "here")
        asked = len(hub.requests)
        rc, out, _ = run(capsys, "gpt2", "--lambada", str(lambada), "--json", "-")
        assert rc == 0 and json.loads(out)["published"] == [] and len(hub.requests) == asked  # the Hub not asked


def test_progress_counts_the_scored_tokens(tiny_official: Path, text: Path, capsys, monkeypatch) -> None:
    """The bar counts what takes the time (scored tokens, their total known before scoring starts), redrawn on a
    terminal; in a log, plain lines (here one per batch, as if each took the whole interval); none with
    --no-progress."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    rc, out, err = run(capsys, str(tiny_official), "--text", str(text), "--max-length", "32")
    n = int(next(ln for ln in out.splitlines() if ln.strip().startswith("tokens")).split()[1])
    assert rc == 0 and err.startswith("\reval [") and f"100% {n:,}/{n:,} tokens" in err and "tokens/s" in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    monkeypatch.setenv("GPT2_PORT_PROGRESS_SECONDS", "0")
    rc, _, err = run(capsys, str(tiny_official), "--text", str(text), "--max-length", "32", "--batch-size", "2")
    lines = [ln for ln in err.splitlines() if ln.startswith("eval [")]
    assert "\r" not in err and len(lines) > 2 and f"{n:,}/{n:,} tokens" in lines[-1]
    rc, _, err = run(capsys, str(tiny_official), "--text", str(text), "--max-length", "32", "--no-progress")
    assert "eval [" not in err


def test_data_scores_what_prepare_made_as_the_hand_cut_text_scores(tiny_official: Path, tmp_path: Path, capsys) -> None:
    """`eval --data DIR` scores val.bin's tokens with the same windows as `--text` on the same text, and takes the
    byte and word counts from the meta.json prepare wrote: every figure equals the hand-cut text's (the cut a user
    had to find before: the character where prepare's 90/10 split falls)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SHAKESPEARE.read_text()[:6000])
    data = tmp_path / "data"
    assert main(["prepare", str(corpus), "--out", str(data), "--no-progress"]) == 0
    meta = json.loads((data / "meta.json").read_text())
    val_text = tmp_path / "val.txt"
    val_text.write_text(corpus.read_text()[meta["split"]["train_chars"] :])
    assert meta["val_bytes"] == len(val_text.read_bytes())
    res = {}
    for name, flag in (("data", ["--data", str(data)]), ("text", ["--text", str(val_text)])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", str(tiny_official), *flag, "--max-length", "64", "--json", str(out)]) == 0
        res[name] = json.loads(out.read_text())
    for key in ("tokens", "nll", "perplexity", "bytes", "bits_per_byte", "words", "word_perplexity"):
        assert res["data"][key] == res["text"][key], key
    assert res["data"]["task"] == "data" and "val.bin" in res["data"]["method"]
    assert res["data"]["tokens"] == meta["val_tokens"]


def test_data_without_byte_counts_gives_the_token_figures_alone(tiny_official: Path, tmp_path: Path, capsys) -> None:
    import numpy as np

    d = tmp_path / "data"
    d.mkdir()
    np.arange(300, dtype="<u2").tofile(d / "val.bin")  # nanoGPT's prepare writes no meta.json
    argv = ["eval", str(tiny_official), "--data", str(d), "--max-length", "32", "--json", str(tmp_path / "r")]
    assert main(argv) == 0
    r = json.loads((tmp_path / "r").read_text())
    assert r["tokens"] == 300 and r["perplexity"] > 1
    assert r["bytes"] is None and r["bits_per_byte"] is None and r["word_perplexity"] is None
    assert "rerun gpt2-port prepare" in capsys.readouterr().out


def test_out_of_memory_is_one_line_naming_the_batch_size(
    tiny_official: Path, lambada: Path, capsys, monkeypatch
) -> None:
    """A batch that does not fit the GPU (torch's OutOfMemoryError, raised here by a stand-in model) ends in one line
    naming --batch-size, exit 2, no traceback and no half-written --json."""
    from gpt2_port.model import GPT2

    def oom(*_a, **_k) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.07 GiB")

    monkeypatch.setattr(GPT2, "forward", oom)
    out_json = lambada.parent / "e.json"
    rc, out, err = run(
        capsys, str(tiny_official), "--lambada", str(lambada), "--batch-size", "64", "--json", str(out_json)
    )
    assert rc == 2 and not out_json.exists()
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "error: CUDA out of memory. Tried to allocate 3.07 GiB scoring --batch-size 64 windows of" in err
    assert err.rstrip().endswith(
        ": a smaller --batch-size (or --max-length; with --check, --no-noise-floor loads one model fewer)"
    )
