"""The README's quickstart: every command in it parses, and the CPU sequence runs end to end on a tiny checkpoint
(prepare -> train -> eval --data -> generate -> parity), each step reading what the one before wrote."""

from __future__ import annotations

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import TINY

from gpt2_port.cli import main
from gpt2_port.cli.main import build_parser
from gpt2_port.io.demo import write_demo_checkpoint

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def quickstart_commands() -> list[list[list[str]]]:
    """The `$G ...` command lines of each bash block in the README's quickstart section, continuations joined."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    out = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        lines = [ln.split("#", 1)[0].strip() for ln in joined.splitlines()]
        out.append([shlex.split(ln)[1:] for ln in lines if ln.startswith("$G ")])
    return out


def test_the_readme_quickstart_has_the_cpu_and_the_gpu_sequences() -> None:
    cpu, gpu = quickstart_commands()
    assert [c[0] for c in cpu] == ["prepare", "train", "eval", "generate", "parity"]
    assert [c[0] for c in gpu] == ["train", "generate", "parity"]


@pytest.mark.parametrize("argv", [c for block in quickstart_commands() for c in block], ids=lambda a: a[0])
def test_every_quickstart_command_parses(argv: list[str]) -> None:
    """A flag renamed or removed makes argparse exit 2 here, before anyone copies the README."""
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]


def test_the_quickstart_runs_end_to_end_on_a_tiny_checkpoint(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The README's CPU commands as written, with the tiny checkpoint in place of weights/gpt2-random."""
    cpu, _ = quickstart_commands()
    write_demo_checkpoint(tmp_path / "weights" / "gpt2-random", config=TINY, seed=5, tokenizer_dir=tokenizer_dir)
    monkeypatch.chdir(tmp_path)
    shared = str(SHARED)
    outputs = {}
    for argv in cpu:
        argv = [a.replace("../shared", shared) for a in argv]
        rc = main([*argv, "--device", "cpu"] if argv[0] in ("train", "eval", "generate", "parity") else argv)
        captured = capsys.readouterr()
        assert rc == 0, f"{argv[0]} exited {rc}: {captured.err[-2000:]}"
        outputs[argv[0]] = captured.out + captured.err
    run = tmp_path / "runs" / "shakespeare"
    assert (tmp_path / "data" / "shakespeare" / "val.bin").is_file()
    assert (run / "model.safetensors").is_file() and (run / "loss.png").is_file() and (run / "best").is_dir()
    assert "trained steps 0->20" in outputs["train"]
    assert re.search(r"bits_per_byte\s+\d", outputs["eval"])
    assert outputs["generate"].startswith("ROMEO:")
    assert "PASS" in outputs["parity"]


def test_the_readme_python_api_block_runs_as_written(tmp_path: Path, tokenizer_dir: Path) -> None:
    """The README's Python block, with a 4-layer random checkpoint in place of the Hub's gpt2 (it names block.3)."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    ckpt = write_demo_checkpoint(
        tmp_path / "gpt2", config=replace(TINY, n_layer=4), seed=6, tokenizer_dir=tokenizer_dir
    )
    assert code.count('from_pretrained("gpt2"') == 1 and code.count('"out/"') == 1
    code = code.replace('from_pretrained("gpt2"', f"from_pretrained({str(ckpt)!r}").replace(
        '"out/"', repr(str(tmp_path / "out"))
    )
    scope: dict = {}
    exec(compile(code, "README.md (Python API)", "exec"), scope)  # noqa: S102
    assert scope["acts"]["block.3"].shape == (1, 2, TINY.n_embd) and (tmp_path / "out" / "model.safetensors").is_file()
