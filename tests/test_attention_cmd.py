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
            "2",
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
    ],
)
def test_bad_layer_or_head(tiny_official: Path, tmp_path: Path, args, msg, capsys):
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
