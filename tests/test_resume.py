"""`gpt2-port train --resume DIR` continues the saved run with its saved settings: no flag needed, the same weights as
an uninterrupted run bit for bit; a flag given again overrides its saved value and says so; moved data is refused
until --data says where it went; the line printed at a stop is exactly the command that continues."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import weights

from gpt2_port.cli import main
from gpt2_port.config import GPT2Config
from gpt2_port.io.demo import write_demo_checkpoint
from gpt2_port.train import state as trainer_state

pytestmark = pytest.mark.exactness  # bit-for-bit resume: run again under a second arithmetic configuration
SMALL = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=512)
# every setting away from its default, so a resume that fell back to a default would show
SETTINGS = ["--batch-size", "2", "--block-size", "16", "--grad-accum", "2", "--lr", "3e-4", "--min-lr", "1e-5"]
SETTINGS += ["--warmup", "2", "--schedule", "cosine", "--beta2", "0.99", "--weight-decay", "0.05", "--clip", "0.5"]
SETTINGS += ["--dropout", "0.1", "--eval-every", "2", "--eval-batches", "2", "--seed", "7", "--kernels", "fast"]


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("ck"), config=SMALL, seed=4)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    ids = np.random.default_rng(1).integers(0, SMALL.vocab_size, 6000).astype("<u2")
    ids.tofile(d / "train.bin")
    ids[:1000].tofile(d / "val.bin")
    return d


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["train", *argv, "--device", "cpu", "--no-plot"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_resume_with_no_flags_continues_the_saved_run_bit_for_bit(ck: Path, data: Path, tmp_path: Path, capsys) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    base = ["--init", str(ck), "--data", str(data), "--steps", "6", *SETTINGS]
    assert train(capsys, *base, "--out", str(full))[0] == 0
    rc, out, _ = train(capsys, *base, "--out", str(part), "--stop-at", "3")
    assert rc == 0 and out.splitlines()[-1] == f"gpt2-port train --resume {part}"  # the command, exactly
    rc, _, err = train(capsys, "--resume", str(part))  # nothing else: the saved settings and data directory
    assert rc == 0 and "WARNING" not in err, err
    a, b = log(full), log(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for key in ("train_loss", "lr", "grad_norm", "val_loss"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    wa, wb = weights(full), weights(part)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    saved = trainer_state.load(part).args
    assert saved["lr"] == 3e-4 and saved["kernels"] == "fast" and saved["data"] == str(data) and "stop_at" not in saved


def test_an_override_is_named_with_its_old_and_new_value(ck: Path, data: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert train(capsys, "--init", str(ck), "--data", str(data), "--out", str(out), "--steps", "4", "--stop-at", "2",
                 *SETTINGS)[0] == 0  # fmt: skip
    rc, _, err = train(capsys, "--resume", str(out), "--lr", "1e-3", "--eval-every", "1", "--stop-at", "3")
    assert rc == 0
    warnings = [ln for ln in err.splitlines() if ln.startswith("WARNING resume:")]
    assert len(warnings) == 2, err
    assert "--lr 0.001 where the saved run used 0.0003" in warnings[0] and "uninterrupted" in warnings[0]
    assert "--eval-every 1 where the saved run used 2" in warnings[1]
    assert trainer_state.load(out).args["lr"] == 1e-3  # the override is the run's setting from now on
    # a flag given again with its saved value changes nothing and says nothing
    rc, _, err = train(capsys, "--resume", str(out), "--lr", "1e-3", "--steps", "4")
    assert rc == 0 and "WARNING" not in err


def test_moved_data_is_refused_naming_the_saved_path_and_data_fixes_it(
    ck: Path, data: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "run"
    argv = ["--init", str(ck), "--data", str(data), "--out", str(out), "--steps", "3", "--stop-at", "1", *SETTINGS]
    assert train(capsys, *argv)[0] == 0
    moved = tmp_path / "moved"
    shutil.move(data, moved)
    rc, _, err = train(capsys, "--resume", str(out))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"the run's data directory {data} is gone" in err and "--data" in err
    rc, _, err = train(capsys, "--resume", str(out), "--data", str(moved))
    assert rc == 0 and "WARNING" not in err  # the same data where it is now: not an override
    assert trainer_state.load(out).args["data"] == str(moved)


def test_other_data_given_on_resume_is_named(ck: Path, data: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["--init", str(ck), "--data", str(data), "--out", str(out), "--steps", "3", "--stop-at", "1", *SETTINGS]
    assert train(capsys, *argv)[0] == 0
    other = tmp_path / "other"
    other.mkdir()
    (np.arange(3000) % SMALL.vocab_size).astype("<u2").tofile(other / "train.bin")
    rc, _, err = train(capsys, "--resume", str(out), "--data", str(other))
    assert rc == 0 and "other data" in err and "6,000 train tokens" not in err and "3,000" in err


def test_a_state_saved_before_settings_were_saved_needs_data(ck: Path, data: Path, tmp_path: Path, capsys) -> None:
    """A trainer_state.json whose args lack "data" (an older gpt2-port): --data is required, and said so."""
    out = tmp_path / "run"
    argv = ["--init", str(ck), "--data", str(data), "--out", str(out), "--steps", "3", "--stop-at", "1", *SETTINGS]
    assert train(capsys, *argv)[0] == 0
    js = out / trainer_state.STATE_JSON
    meta = json.loads(js.read_text())
    del meta["args"]["data"]
    meta["args"]["stop_at"] = 1  # older states saved it too: it is ignored
    js.write_text(json.dumps(meta))
    rc, _, err = train(capsys, "--resume", str(out))
    assert rc == 2 and "--data DIR is required" in err
    assert train(capsys, "--resume", str(out), "--data", str(data))[0] == 0


def test_toggling_compile_on_resume_is_named_and_grad_checkpointing_is_not() -> None:
    """A compiled step rounds differently and draws other dropout masks than an eager one (measured with inductor:
    every tensor differs after 6 steps at dropout 0.1), so switching --compile on resume is an override that changes
    the run; gradient checkpointing recomputes the same arithmetic with the same masks
    (tests/test_train.py::test_grad_checkpointing_trains_the_same_model), so switching it says nothing."""
    from gpt2_port.train.args import TrainArgs, resume_changes

    saved = TrainArgs(data="d", dropout=0.1)
    lines = resume_changes(saved, dataclasses.replace(saved, compile=True), 1, 1)
    assert len(lines) == 1 and lines[0].startswith("resuming with --compile True where the saved run used False")
    assert "dropout masks" in lines[0] and "uninterrupted" in lines[0]
    assert resume_changes(saved, dataclasses.replace(saved, grad_checkpointing=True), 1, 1) == []


def test_changing_the_head_padding_on_resume_is_named_only_where_the_head_is_fused() -> None:
    """The padded head's softmax rows are longer, so they round differently: with the fast kernels (the fused head)
    a new --pad-vocab changes the run; the reference kernels never pad, so there it says nothing."""
    from gpt2_port.train.args import TrainArgs, resume_changes

    fast = TrainArgs(data="d", kernels="fast")
    lines = resume_changes(fast, dataclasses.replace(fast, pad_vocab=64), 1, 1)
    assert len(lines) == 1 and lines[0].startswith("resuming with --pad-vocab 64 where the saved run used None")
    ref = TrainArgs(data="d", dtype="float32")  # auto: the reference kernels
    assert resume_changes(ref, dataclasses.replace(ref, pad_vocab=64), 1, 1) == []


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_deterministic_is_on_while_the_run_trains_saved_kept_by_a_resume_and_off_after(
    ck: Path, data: Path, tmp_path: Path, capsys, monkeypatch, kernels: str
) -> None:
    """--deterministic turns torch.use_deterministic_algorithms on for the run (every kernel of a step, bf16 and
    both kernel sets, has a deterministic version here), the saved settings keep it, a resume runs with it again
    without the flag and continues bit for bit, and the process's settings are as they were afterwards."""
    from gpt2_port.train.loop import Trainer

    seen: list[bool] = []
    step = Trainer._queue_step

    def spy(self, i: int):  # noqa: ANN001, ANN202
        seen.append(torch.are_deterministic_algorithms_enabled())
        return step(self, i)

    monkeypatch.setattr(Trainer, "_queue_step", spy)
    full, part = tmp_path / "full", tmp_path / "part"
    base = ["--init", str(ck), "--data", str(data), "--steps", "4", *SETTINGS[:4], "--dtype", "bf16"]
    base += ["--kernels", kernels, "--deterministic"]
    assert train(capsys, *base, "--out", str(full))[0] == 0
    assert train(capsys, *base, "--out", str(part), "--stop-at", "2")[0] == 0
    assert trainer_state.load(part).args["deterministic"] is True
    rc, _, err = train(capsys, "--resume", str(part))
    assert rc == 0 and "WARNING" not in err, err
    assert seen == [True] * 8 and not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic
    wa, wb = weights(full), weights(part)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    seen.clear()
    assert train(capsys, "--resume", str(part), "--no-deterministic", "--steps", "5")[0] == 0
    assert seen == [False]


def test_an_op_without_a_deterministic_kernel_is_one_line(ck: Path, data: Path, tmp_path: Path, capsys, monkeypatch):
    """torch raises for an op that has no deterministic kernel (on CUDA, e.g. an index_add with atomics): the run
    stops with one line naming it and the way out, exit 2, and the settings are put back."""
    from gpt2_port.train.loop import Trainer

    def refuses(self, i: int):  # noqa: ANN001, ANN202
        raise RuntimeError(
            "index_add_cuda_ does not have a deterministic implementation, but you set "
            "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation..."
        )

    monkeypatch.setattr(Trainer, "_queue_step", refuses)
    rc, _, err = train(capsys, "--init", str(ck), "--data", str(data), "--out", str(tmp_path / "r"), "--steps", "2",
                       *SETTINGS[:4], "--deterministic")  # fmt: skip
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "gpt2-port train: error: --deterministic: index_add_cuda_ has no deterministic kernel on cpu; run without "
        "--deterministic"
    ), err
    assert not torch.are_deterministic_algorithms_enabled()


def test_toggling_deterministic_on_resume_is_named() -> None:
    from gpt2_port.train.args import TrainArgs, resume_changes

    saved = TrainArgs(data="d")
    lines = resume_changes(saved, dataclasses.replace(saved, deterministic=True), 1, 1)
    assert len(lines) == 1 and lines[0].startswith("resuming with --deterministic True where the saved run used False")


def test_resume_in_place_may_name_its_own_tokenizer_but_not_replace_another_checkpoint(
    ck: Path, data: Path, tmp_path: Path, tokenizer_dir: Path, capsys
) -> None:
    """A resume rewrites its own directory (--tokenizer may name it: the files it holds are not copied onto
    themselves), while an --out elsewhere that holds a checkpoint is refused before anything is written."""
    out = tmp_path / "run"
    base = ["--data", str(data), *SETTINGS[:4]]
    rc, _, err = train(capsys, "--init", str(ck), "--out", str(out), "--steps", "2", "--stop-at", "1",
                       "--tokenizer", str(tokenizer_dir), *base)  # fmt: skip
    assert rc == 0, err
    vocab = (out / "vocab.json").read_bytes()
    other = shutil.copytree(ck, tmp_path / "other")
    rc, _, err = train(capsys, "--resume", str(out), "--out", str(other))
    assert rc == 2 and "--out" in err and "holds a checkpoint already (model.safetensors)" in err, err
    assert (other / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
    rc, _, err = train(capsys, "--resume", str(out), "--out", str(out), "--tokenizer", str(out))
    assert rc == 0, err
    assert trainer_state.load(out).step == 2 and (out / "vocab.json").read_bytes() == vocab


def test_cuda_generator_states_are_restored_in_device_order_past_ten_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """rng.cuda.N keys sorted as strings would put device 10 before device 2: each GPU would get another's state."""
    # in the order a saved state holds them: save() writes its keys sorted as strings (0, 1, 10, 11, 2, ...)
    states = {f"rng.cuda.{i}": torch.full((4,), i, dtype=torch.uint8) for i in sorted(range(12), key=str)}
    assert list(states)[2] == "rng.cuda.10"
    tensors = {**states, trainer_state.RNG_TORCH: torch.get_rng_state(), trainer_state.RNG_DATA: torch.zeros(1)}
    got: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 12)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: got.extend(s))
    trainer_state.restore_rng(tensors)
    assert [int(t[0]) for t in got] == list(range(12))


def test_data_prepared_again_under_the_same_path_is_named(ck: Path, data: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["--init", str(ck), "--data", str(data), "--out", str(out), "--steps", "3", "--stop-at", "1", *SETTINGS]
    assert train(capsys, *argv)[0] == 0
    (np.arange(3000) % SMALL.vocab_size).astype("<u2").tofile(data / "train.bin")  # the same path, other tokens
    rc, _, err = train(capsys, "--resume", str(out))
    assert rc == 0 and f"the data in {data} changed since the run was saved" in err and "3,000 tokens" in err


def test_resuming_a_run_that_has_done_its_steps_says_so(ck: Path, data: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["--init", str(ck), "--data", str(data), "--out", str(out), "--steps", "2", *SETTINGS]
    assert train(capsys, *argv)[0] == 0
    log_before = (out / "log.jsonl").read_bytes()
    rc, _, err = train(capsys, "--resume", str(out))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "has done its 2 steps already" in err and "--steps N with N > 2" in err
    assert (out / "log.jsonl").read_bytes() == log_before  # nothing rewritten
    assert train(capsys, "--resume", str(out), "--steps", "3")[0] == 0
