"""`gpt2-port attention`: heatmaps of the scratch model's attention, and --compare against transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2_port.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def test_all_heads_png(tiny_official: Path, tmp_path: Path, capsys):
    out = tmp_path / "att.png"
    assert main(["attention", str(tiny_official), "The cat chased the mouse", "--layer", "1", "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    assert "all heads" in capsys.readouterr().out


def test_compare_matches_transformers(tiny_hf: Path, tmp_path: Path, capsys):
    """The scratch model's probabilities (manual path) equal transformers' eager ones; the diff is drawn."""
    out = tmp_path / "cmp.png"
    rc = main(
        [
            "attention",
            str(tiny_hf),
            "The cat chased the mouse",
            "--layer",
            "-1",
            "--head",
            "-2",  # of 4: head 2, counted from the end as --layer -1 is
            "--compare",
            "--png",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0 and out.read_bytes()[:8] == PNG
    assert "layer 1, head 2" in text
    assert "head  2: max |scratch - transformers| 0.000e+00" in text


def test_reference_probs_are_the_attention_probabilities(tiny_hf: Path):
    """The hook really captures probabilities: causal, rows summing to 1 (so a zero diff is not trivially zero)."""
    from gpt2_port.model import from_pretrained
    from gpt2_port_checks.attention_maps import reference_probs

    _, rep = from_pretrained(str(tiny_hf))
    ids = torch.tensor([[464, 3797, 26172, 262, 10211]])
    p = reference_probs(str(tiny_hf), None, rep.config, ids, 0, torch.float32, torch.device("cpu"))
    assert p.shape == (4, 5, 5)
    assert torch.allclose(p.sum(-1), torch.ones(4, 5)) and float(p.triu(1).abs().max()) == 0.0


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--layer", "2"], "--layer 2: the model has 2 layers"),
        (["--layer", "0", "--head", "4"], "--head 4: the model has 4 heads"),
        (["--layer", "0", "--head", "-5"], "--head -5: the model has 4 heads"),
    ],
)
def test_bad_layer_or_head(tiny_official: Path, tmp_path: Path, args, msg, capsys, monkeypatch):
    """Refused from the checkpoint's config before the model loads (seconds at 1.5B, more onto a GPU)."""
    import gpt2_port.model

    def no_load(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded before --layer/--head were checked")

    monkeypatch.setattr(gpt2_port.model, "from_pretrained", no_load)
    assert main(["attention", str(tiny_official), "Hi", *args, "--png", str(tmp_path / "a.png")]) == 2
    assert msg in capsys.readouterr().err


def test_without_matplotlib_one_line_hint(tiny_official: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["attention", str(tiny_official), "Hi", "--layer", "0", "--png", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'gpt2-port[plot]'" in err and len(err.splitlines()) == 1


def test_command_does_not_import_transformers(tiny_official: Path, tmp_path: Path):
    """Drawing the scratch model's attention needs no transformers (only --compare does)."""
    code = (
        "import sys; from gpt2_port.cli import main; "
        f"rc = main(['attention', {str(tiny_official)!r}, 'Hi there', '--layer', '0', '--png', "
        f"{str(tmp_path / 'a.png')!r}]); "
        "assert rc == 0, rc; assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=300)


def test_a_long_text_draws_a_bounded_canvas(tiny_official: Path, tmp_path: Path, capsys):
    """A heatmap's side is capped (MAX_CELL_INCHES) and the tokens labelled every k-th past MAX_LABELS: uncapped, 120
    tokens make a 35-inch (4,200 px) map, and 1024 tokens of all 12 heads some 200 GB of memory."""
    out = tmp_path / "long.png"
    text = " ".join(["word"] * 120)
    assert main(["attention", str(tiny_official), text, "--layer", "0", "--head", "0", "--png", str(out)]) == 0
    head = out.read_bytes()
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")  # the PNG's IHDR
    assert max(width, height) <= 13 * 120, (width, height)  # 12 inches at 120 dpi, and the margins
    assert "120 tokens" in capsys.readouterr().out


def test_ids_outside_the_models_vocabulary_are_refused_before_the_forward(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """GPT-2's tokenizer on a model of 512 tokens: one line naming the id. On a GPU the forward does not read the ids
    back to check them (an out-of-range one is a device-side assert there): its check is turned off here as there."""
    import gpt2_port.model.gpt2
    from gpt2_port.config import GPT2Config
    from gpt2_port.io.demo import write_demo_checkpoint

    monkeypatch.setattr(gpt2_port.model.gpt2, "host_readable", lambda t: False)

    small = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=512)
    ck = write_demo_checkpoint(tmp_path / "ck", config=small, tokenizer_dir=tokenizer_dir)
    assert main(["attention", str(ck), "Hello world", "--layer", "0", "--png", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err
    assert "TEXT: token id 15496 is out of range for the model's vocabulary of 512" in err, err
    assert not (tmp_path / "a.png").exists()
