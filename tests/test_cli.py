"""The console command: help on every subcommand, inspect, demo-checkpoint, exit codes in a real process."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY

from gpt2_port.cli import main
from gpt2_port.cli.main import build_parser
from gpt2_port.io.safetensors_io import SafetensorsFile


def test_help_on_every_subcommand(capsys):
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    assert {"parity", "inspect", "demo-checkpoint"} <= set(subs)
    for name in subs:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        assert "usage: gpt2-port " + name in capsys.readouterr().out


def test_demo_checkpoint_is_official_layout(tmp_path: Path, tokenizer_dir: Path, capsys):
    from gpt2_port.config import GPT2Config
    from gpt2_port.io.demo import write_demo_checkpoint

    d = write_demo_checkpoint(tmp_path / "d", config=GPT2Config(n_layer=3, n_embd=64, n_head=2, n_positions=32), seed=7)
    f = SafetensorsFile(d / "model.safetensors")
    assert f.metadata == {"format": "pt"}
    keys = set(f.keys())
    assert "lm_head.weight" not in keys and not any(k.startswith("transformer.") for k in keys)
    assert {f"h.{i}.attn.bias" for i in range(3)} <= keys
    assert f.infos["h.2.attn.bias"].shape == (1, 1, 32, 32)
    assert all(i.dtype.is_floating_point and str(i.dtype) == "torch.float32" for i in f.infos.values())
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu_new" and cfg["n_layer"] == 3
    # deterministic for a seed
    d2 = write_demo_checkpoint(
        tmp_path / "d2", config=GPT2Config(n_layer=3, n_embd=64, n_head=2, n_positions=32), seed=7
    )
    assert (d / "model.safetensors").read_bytes() == (d2 / "model.safetensors").read_bytes()
    assert not list(tmp_path.rglob("*.partial"))


def test_demo_checkpoint_cli_writes_tokenizer(tmp_path: Path, tokenizer_dir: Path, capsys):
    out = tmp_path / "ck"
    assert main(["demo-checkpoint", "--out", str(out), "--tokenizer-from", str(tokenizer_dir)]) == 0
    assert (out / "vocab.json").read_bytes() == (tokenizer_dir / "encoder.json").read_bytes()
    assert (out / "merges.txt").read_bytes() == (tokenizer_dir / "vocab.bpe").read_bytes()
    assert (out / "model.safetensors").stat().st_size > 500e6  # 124M float32 + 12 mask buffers
    assert "wrote" in capsys.readouterr().out


def test_inspect(tiny_official: Path, tmp_path: Path, capsys):
    out = tmp_path / "i.json"
    assert main(["inspect", str(tiny_official), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "h.0.attn.c_attn.weight" in text and "split_qkv_weight" in text and "h.0.attn.q_proj.weight" in text
    assert "dropped     2 buffer(s)" in text and "head tied to wte" in text
    r = json.loads(out.read_text())
    assert r["tensors"] == 2 * 12 + 4 + 2  # 12 per layer, 4 top-level, 2 mask buffers
    assert r["parameters"] == TINY.num_params()  # counted from the loaded tensors, checked against the formula
    assert r["dropped"] == ["h.0.attn.bias", "h.1.attn.bias"]
    assert r["config"]["n_layer"] == 2


def test_real_process_exit_codes(tiny_official: Path, tmp_path: Path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "gpt2_port", *a], capture_output=True, text=True)  # noqa: E731
    ok = run("inspect", str(tiny_official))
    assert ok.returncode == 0, ok.stderr
    missing = run("inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.count("\n") == 1 and "nope: no such file or directory" in missing.stderr
    bad_arg = run("parity", str(tiny_official), "--reference-attn", "flash")
    assert bad_arg.returncode == 2 and bad_arg.stderr.count("\n") == 1 and "--reference-attn" in bad_arg.stderr


def test_library_never_imports_transformers(tiny_official: Path, tmp_path: Path):
    """gpt2_port (every module, and a load + generate + inspect through the CLI) runs without importing transformers."""
    code = f"""
import sys, pkgutil, importlib
import gpt2_port
for m in pkgutil.walk_packages(gpt2_port.__path__, "gpt2_port."):
    if m.name != "gpt2_port.__main__":
        importlib.import_module(m.name)
from gpt2_port.cli import main
assert main(["inspect", {str(tiny_official)!r}]) == 0
assert main(["generate", {str(tiny_official)!r}, "Hi", "--greedy", "--max-new-tokens", "3"]) == 0
print("transformers" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


def test_attention_counts_one_token_in_the_singular(tiny_official: Path, tmp_path: Path, capsys):
    assert main(["attention", str(tiny_official), "Hi", "--layer", "0", "--png", str(tmp_path / "a.png")]) == 0
    out = capsys.readouterr().out
    assert "1 token" in out and "1 tokens" not in out


def test_generate_memory_check_refuses_only_what_does_not_fit(tiny_official: Path, monkeypatch, capsys):
    """The estimate against the memory available (faked here): a batch over 90% of it stops before generating with
    the number of samples that fits; that number, and any batch under the estimate's limit, runs."""
    from gpt2_port import devices
    from gpt2_port.generate.memory import decode_memory

    greedy = {"do_sample": False, "repetition_penalty": 1.0}
    one = sum(decode_memory(TINY, 1, 1, 3, 4, greedy, True).values())
    assert sum(decode_memory(TINY, 100, 1, 3, 4, greedy, True).values()) == 100 * one  # linear in the samples
    assert decode_memory(TINY, 1, 1, 3, 4, greedy, True)["next-token scores"] == TINY.vocab_size * 12
    monkeypatch.setattr(devices, "available_memory", lambda device: (100 * one, "faked"))
    argv = ["generate", str(tiny_official), "Hi", "--greedy", "--max-new-tokens", "2"]
    capsys.readouterr()
    assert main([*argv, "--num-samples", "91"]) == 2
    err = capsys.readouterr().err
    fits = int(re.search(r"\(faked\); try --num-samples (\d+)", err).group(1))  # type: ignore[union-attr]
    assert "memory: 91 sample(s) of 3 tokens" in err and fits in (89, 90), err  # 90% of 100 (float rounding)
    assert main([*argv, "--num-samples", str(fits)]) == 0
    assert main([*argv, "--num-samples", "91", "--no-memory-check"]) == 0


def test_demo_checkpoint_takes_the_largest_seed(tmp_path: Path):
    from gpt2_port.config import GPT2Config
    from gpt2_port.io.demo import write_demo_checkpoint

    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=64)
    a = write_demo_checkpoint(tmp_path / "a", config=cfg, seed=2**63 - 1)
    b = write_demo_checkpoint(tmp_path / "b", config=cfg, seed=2**63 - 2)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_out_of_memory_said_as_one_line_shows_its_traceback_only_when_asked(
    tiny_official: Path, monkeypatch, capsys
) -> None:
    """The DeviceMemoryError that train and eval raise (torch's error as its cause) is one line, exit 2; under
    GPT2_PORT_DEBUG=1 it is raised, traceback and all, for a report."""
    import gpt2_port.io.load as load
    from gpt2_port.errors import DeviceMemoryError

    def oom(*_a, **_k) -> None:
        raise DeviceMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB in step 3")

    monkeypatch.setattr(load, "read_checkpoint", oom)
    monkeypatch.delenv("GPT2_PORT_DEBUG", raising=False)
    capsys.readouterr()
    assert main(["inspect", str(tiny_official)]) == 2
    err = capsys.readouterr().err
    assert err == "gpt2-port inspect: error: CUDA out of memory. Tried to allocate 1.00 GiB in step 3\n", err
    monkeypatch.setenv("GPT2_PORT_DEBUG", "1")
    with pytest.raises(DeviceMemoryError, match="in step 3"):
        main(["inspect", str(tiny_official)])


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize(
    ("command", "hint"),
    [
        (["generate", "Hi", "--greedy", "--max-new-tokens", "2"], "fewer rows (--num-samples"),
        (["parity", "--no-noise-floor"], "fewer or shorter prompts"),
        (["attention", "Hi", "--layer", "0", "--png", "{tmp}/a.png"], "a shorter TEXT"),
    ],
)
def test_running_out_of_device_memory_is_one_line_saying_what_to_change(
    tiny_official: Path, tmp_path: Path, monkeypatch, capsys, command: list[str], hint: str, wrapped: bool
) -> None:
    """torch's OutOfMemoryError (here from a stand-in forward; `wrapped`: re-raised from another error, as
    torch.compile does) is not a bug: one line with torch's request and what to change, exit 2, no traceback."""
    from gpt2_port.model import GPT2

    def oom(*_a, **_k) -> None:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1.5 GiB free. X")
        except torch.OutOfMemoryError as e:
            if wrapped:
                raise RuntimeError("backend='inductor' raised: see above") from e
            raise

    monkeypatch.setattr(GPT2, "forward", oom)
    argv = [command[0], str(tiny_official), *(a.format(tmp=tmp_path) for a in command[1:])]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err and "Traceback" not in err, err
    assert f"gpt2-port {command[0]}: error: CUDA out of memory. Tried to allocate 2.00 GiB: {hint}" in err, err
    monkeypatch.setenv("GPT2_PORT_DEBUG", "1")  # the traceback asked for: torch's error itself, for a report
    with pytest.raises((torch.OutOfMemoryError, RuntimeError), match="out of memory|inductor"):
        main(argv)


@pytest.mark.parametrize(
    "flag, want",
    [([], (True, None)), (["--no-cuda-graph"], (False, None)), (["--op-for-op"], (True, False))],
    ids=["default", "no-cuda-graph", "op-for-op"],
)
def test_the_cuda_step_flags_reach_the_generation(tiny_official: Path, monkeypatch, capsys, flag, want) -> None:  # noqa: ANN001
    """`generate --no-cuda-graph` asks generate_full for the eager static step (on CUDA; elsewhere nothing is
    captured either way), and the default asks for the captured one; `--op-for-op` asks for the forward's ops in
    that step, and the default leaves generate its choice (the fused step on CUDA)."""
    import gpt2_port.generate as gen

    seen, real = [], gen.generate_full

    def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
        seen.append((k["cuda_graph"], k["fused_kernels"]))
        return real(*a, **k)

    monkeypatch.setattr(gen, "generate_full", spy)
    assert main(["generate", str(tiny_official), "Hi", "--greedy", "--max-new-tokens", "2", *flag]) == 0
    assert seen == [want]


@pytest.mark.parametrize("command", ["generate", "eval", "parity", "attention", "train"])
def test_every_command_that_runs_the_model_picks_the_device_itself_by_default(command: str) -> None:
    """`--device auto` is the default (cuda, else mps, else cpu): a GPU user's command runs on the GPU unasked."""
    argv = {
        "generate": ["generate", "m", "x"],
        "eval": ["eval", "m", "--data", "d"],
        "parity": ["parity", "m"],
        "attention": ["attention", "m", "x", "--layer", "0", "--png", "a.png"],
        "train": ["train", "--init", "m", "--data", "d", "--out", "o"],
    }[command]
    assert build_parser().parse_args(argv).device == "auto"
