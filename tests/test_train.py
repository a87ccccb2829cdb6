"""The training loop: windows, sampler, schedule, optimizer groups, exact resume, outputs, memory check, NaN, Ctrl-C."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import weights

from gpt2_port import devices
from gpt2_port.cli import main
from gpt2_port.config import GPT2Config, preset
from gpt2_port.errors import UsageError
from gpt2_port.io.demo import write_demo_checkpoint
from gpt2_port.io.tokenizer import load_tokenizer
from gpt2_port.model import GPT2, from_pretrained, lowp
from gpt2_port.train import NonFiniteError, TrainArgs, Trainer, memory, prepare_model
from gpt2_port.train import state as trainer_state
from gpt2_port.train.data import GlobalBatchSampler, TokenFile, open_split
from gpt2_port.train.schedule import lr_at, param_groups

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
# Small vocabulary: the machine's 2 cores are shared, and GPT-2's 50257-wide head would dominate every step.
SMALL = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=512)
PLOT = ["--batch-size", "2", "--block-size", "16", "--eval-batches", "2", "--device", "cpu"]
FAST = [*PLOT, "--no-plot"]


QUEUE = {"step": "_queue_step"}  # the loop queues each step (Trainer._queue_step), then reads it


def write_bin(path: Path, ids) -> Path:  # noqa: ANN001
    path.parent.mkdir(parents=True, exist_ok=True)
    np.array(ids, dtype="<u2").tofile(path)
    return path


@pytest.fixture(scope="module")
def shakes(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """tiny shakespeare as nanoGPT's prepare.py writes it: 90/10 character split, encode_ordinary, uint16."""
    text = CORPUS.read_text()
    n = int(len(text) * 0.9)
    enc = load_tokenizer(tokenizer_dir).enc
    d = tmp_path_factory.mktemp("shakes")
    write_bin(d / "train.bin", enc.encode_ordinary(text[:n]))
    write_bin(d / "val.bin", enc.encode_ordinary(text[n:]))
    return d


@pytest.fixture(scope="module")
def small_data(shakes: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus folded into SMALL's 512-token vocabulary (ids mod 512): real text statistics, a cheap head."""
    d = tmp_path_factory.mktemp("small_data")
    for split in ("train", "val"):
        ids = np.fromfile(shakes / f"{split}.bin", dtype="<u2")[:20000] % SMALL.vocab_size
        write_bin(d / f"{split}.bin", ids)
    return d


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("small_ckpt"), config=SMALL, seed=4)


def train(*argv: str) -> int:
    return main(["train", *argv])


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


# -- data ------------------------------------------------------------------------------------------------------------
def test_windows_are_x_data_i_to_i_plus_t_and_y_shifted_by_one(tmp_path: Path) -> None:
    f = TokenFile(write_bin(tmp_path / "a.bin", range(100)), vocab_size=200)
    x, y = f.windows(torch.tensor([0, 7, 90]), 9)
    assert x.dtype == torch.int64 and x.shape == (3, 9)
    assert x[1].tolist() == list(range(7, 16)) and y[1].tolist() == list(range(8, 17))
    assert y[2].tolist() == list(range(91, 100))  # the last window ends on the last token


def test_the_bin_format_is_little_endian_uint16_without_header(shakes: Path, tokenizer_dir: Path) -> None:
    f = TokenFile(shakes / "train.bin", 50257)
    assert len(f) == 301966  # nanoGPT's data/shakespeare/prepare.py: "train has 301,966 tokens"
    assert len(TokenFile(shakes / "val.bin", 50257)) == 36059  # "val has 36,059 tokens"
    enc = load_tokenizer(tokenizer_dir).enc
    assert enc.decode(f.ids[:5].tolist()) == "First Citizen:\nBefore"


def test_an_id_outside_the_vocabulary_is_named_with_its_file_and_offset(tmp_path: Path) -> None:
    p = write_bin(tmp_path / "train.bin", [1, 2, 3, 600, 4, 700])
    with pytest.raises(UsageError, match=r"train.bin: token id 600 at offset 3 .*vocabulary of 512"):
        TokenFile(p, 512)


def test_a_truncated_bin_and_a_missing_split_are_errors(tmp_path: Path) -> None:
    (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(UsageError, match="3 bytes is not a whole number"):
        TokenFile(tmp_path / "train.bin", 512)
    with pytest.raises(UsageError, match="no val.bin"):
        open_split(tmp_path, "val", 512, 8)
    write_bin(tmp_path / "val.bin", range(5))
    with pytest.raises(UsageError, match="holds 5 tokens, fewer than the 9"):
        open_split(tmp_path, "val", 512, 8)


def test_one_generator_draws_the_global_batch_and_each_rank_takes_its_share() -> None:
    one = GlobalBatchSampler(1000, 16, batch_size=3, grad_accum=2, world_size=1, seed=5)
    two = [GlobalBatchSampler(1000, 16, batch_size=3, grad_accum=1, world_size=2, seed=5) for _ in range(2)]
    for _ in range(3):
        a = one.next_step(0)  # (2, 3): micro-steps 0 and 1 of the one process
        r0, r1 = two[0].next_step(0), two[1].next_step(1)  # (1, 3) each
        assert torch.equal(a[0], r0[0]) and torch.equal(a[1], r1[0])
    assert (a >= 0).all() and (a < 1000 - 16).all()
    other = GlobalBatchSampler(1000, 16, batch_size=3, grad_accum=2, world_size=1, seed=6)
    assert not torch.equal(GlobalBatchSampler(1000, 16, 3, 2, 1, 5).next_step(0), other.next_step(0))


def test_a_prefetched_draw_is_the_next_step_and_not_part_of_the_saved_data_position() -> None:
    s = GlobalBatchSampler(1000, 16, batch_size=3, grad_accum=2, world_size=2, seed=5)
    ref = GlobalBatchSampler(1000, 16, batch_size=3, grad_accum=2, world_size=2, seed=5)
    s.next_step(1), ref.next_step(1)
    before = s.state()
    ahead = s.prefetch(1)
    assert torch.equal(s.state(), before) and s.batches_drawn == 1  # the position of the steps taken
    assert torch.equal(s.prefetch(1), ahead)  # asking again draws nothing new
    resumed = GlobalBatchSampler(1000, 16, batch_size=3, grad_accum=2, world_size=2, seed=99)
    resumed.restore(s.state(), s.batches_drawn)
    assert torch.equal(s.next_step(1), ahead) and torch.equal(ref.next_step(1), ahead)
    assert torch.equal(resumed.next_step(1), ahead)  # a resume from the saved position draws it again
    assert s.batches_drawn == 2 and torch.equal(s.next_step(1), ref.next_step(1))


# -- schedule and optimizer ------------------------------------------------------------------------------------------
def test_lr_warms_up_linearly_then_follows_a_cosine_to_min_lr() -> None:
    lrs = [lr_at(s, 1.0, 0.1, 4, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and math.isclose(lrs[-1], 0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # decays monotonically
    mid = 4 + (19 - 4) / 2
    assert math.isclose(lr_at(int(mid), 1.0, 0.1, 4, 20), 0.1 + 0.45 * (1 + math.cos(math.pi * 7 / 15)))
    assert [lr_at(s, 1.0, 0.1, 2, 10, "constant") for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_weight_decay_goes_to_weights_of_two_or_more_dims_only() -> None:
    m = GPT2(SMALL).requires_grad_(True)
    decay, no_decay = param_groups(m, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    names = {id(p): n for n, p in m.named_parameters()}
    assert {names[id(p)] for p in decay["params"]} >= {"wte.weight", "wpe.weight", "h.0.mlp.c_fc.weight"}
    assert "ln_f.weight" in {names[id(p)] for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))  # tied head counted once


def test_gradients_are_clipped_to_clip_and_the_norm_before_clipping_is_logged(small_ckpt: Path, small_data: Path):
    m, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=1, batch_size=2, block_size=16, clip=0.01, eval_every=0, dropout=0.0)
    prepare_model(m, args, torch.device("cpu"))
    t = Trainer(m, args, TokenFile(small_data / "train.bin", 512), None, "/nonexistent")
    _, norm = t.readback.read(t._queue_step(0).values)  # the clipped gradients, before the AdamW step
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters()]))
    assert math.isfinite(norm) and norm > 0.05 and math.isclose(float(after), 0.01, rel_tol=1e-4)


def test_clip_0_measures_the_norm_and_leaves_the_gradients_alone(
    small_ckpt: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No clipping: the norm is measured (and logged), and no pass multiplies every gradient by 1 (clip_grad_norm_ to
    inf would make one)."""
    m, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=1, batch_size=2, block_size=16, clip=0.0, eval_every=0, dropout=0.0)
    prepare_model(m, args, torch.device("cpu"))
    t = Trainer(m, args, TokenFile(small_data / "train.bin", 512), None, "/nonexistent")

    def no_clip(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("clip_grad_norm_ called with --clip 0")

    versions: list[int] = []
    real_norm = torch.nn.utils.get_total_norm

    def total_norm(grads, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        versions.extend(g._version for g in grads)
        return real_norm(grads, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", no_clip)
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", total_norm)
    _, norm = t.readback.read(t._queue_step(0).values)
    grads = [p.grad for p in m.parameters()]
    assert versions == [g._version for g in grads]  # nothing wrote into the gradients after the norm was taken
    assert math.isclose(norm, float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))), rel_tol=1e-6)


@pytest.mark.parametrize("when", ["on_step", "on_save"])
def test_an_out_directory_moved_while_training_stops_with_a_usage_error(
    small_ckpt: Path, small_data: Path, tmp_path: Path, when: str
) -> None:
    """Moved after a step's log line (the next write is the log or a save) or right after a save: one line naming
    --out (exit 2 in the CLI), and nothing recreated at the old path or written into the moved directory after it."""
    import shutil

    from gpt2_port.train import Callbacks

    m, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=3, batch_size=2, block_size=16, eval_every=0, dropout=0.0, save_every=1)
    prepare_model(m, args, torch.device("cpu"))
    out, moved = tmp_path / "out", tmp_path / "moved"
    once = []

    def move(*_a) -> None:
        if not once:
            once.append(1)
            shutil.move(out, moved)

    cb = Callbacks(on_step=move) if when == "on_step" else Callbacks(on_save=move)
    t = Trainer(m, args, TokenFile(small_data / "train.bin", 512), None, out, callbacks=cb)
    with pytest.raises(UsageError, match=r"--out .*out: the directory is gone \(moved or deleted"):
        t.run()
    assert not out.exists()  # not recreated by a later write
    assert (moved / "log.jsonl").is_file()


# -- the command: outputs and exact resume ---------------------------------------------------------------------------
def test_the_out_directory_loads_in_transformers_and_holds_log_best_and_plot(
    small_ckpt: Path, small_data: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "4"]
    rc = train(
        *argv,
        *PLOT,
        "--eval-every",
        "2",
        "--sample-every",
        "2",
        "--tokenizer",
        str(tokenizer_dir),
        "--json",
        str(tmp_path / "s.json"),
    )
    assert rc == 0
    records = log(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert {"step", "train_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"} <= set(r)
    assert ("val_loss" in records[1]) and ("val_loss" in records[3]) and ("val_loss" not in records[0])
    assert isinstance(records[1]["sample"], str) and records[1]["sample"] and "sample" not in records[0]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "vocab.json").is_file() and (out / "best" / "config.json").is_file()
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["step"] == 4 and summary["val_loss"] == records[3]["val_loss"]
    from gpt2_port.model.attention_kernel import SDPA_OPS

    assert summary["attention"] in SDPA_OPS.values()  # the SDPA kernel the run's first lines name
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary directory left
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ours, _ = from_pretrained(out)
    ids = torch.randint(0, 512, (1, 12))
    torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=0, atol=1e-5)
    # the model in --out is the last step's: one more step of AdamW would have moved it
    assert not torch.equal(weights(out)["h.0.mlp.c_fc.weight"], weights(small_ckpt)["h.0.mlp.c_fc.weight"])


@pytest.mark.parametrize("where", ["step", "apply_step", "_apply_queued", "evaluate", "sample"])
def test_running_out_of_device_memory_names_the_step_the_last_checkpoint_and_what_to_change(
    small_ckpt: Path, small_data: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch, capsys, where: str
) -> None:
    """torch's OutOfMemoryError in step 3 (its forward and backward, or its AdamW step: the first allocates AdamW's
    moments; overlapped, queued with the step), or in the evaluation or the sample after step 3 (a stand-in here; on
    a GPU a longer batch or fragmentation after the measured check), is one line naming the step, the last checkpoint
    (step 2, kept whole) and train's hint, exit 2: not an internal error."""
    from gpt2_port.train import loop

    owner, name = (loop, where) if where == "apply_step" else (loop.Trainer, QUEUE.get(where, where))
    real = getattr(owner, name)
    calls = []

    def oom_at_the_third(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has 0.2 GiB free.")
        return real(self, *a, **k)

    monkeypatch.setattr(owner, name, oom_at_the_third)
    out = tmp_path / "run"
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "4", *FAST]
    capsys.readouterr()
    argv += ["--eval-every", "1" if where == "evaluate" else "0", "--save-every", "2", "--no-progress"]
    argv += ["--overlap"] if where == "_apply_queued" else []  # the AdamW step queued with the step
    if where == "sample":
        argv += ["--sample-every", "1", "--tokenizer", str(tokenizer_dir)]
    assert train(*argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    during = {"evaluate": "evaluating after step 3", "sample": "sampling after step 3"}.get(where, "in step 3")
    assert err.startswith(f"gpt2-port train: error: CUDA out of memory. Tried to allocate 1.50 GiB {during} (")
    assert f"the last checkpoint in {out} is from step 2): a smaller --batch-size" in err, err
    assert trainer_state.load(out).step == 2


@pytest.mark.parametrize("stop_at", [None, "1"])
def test_json_to_stdout_is_the_json_alone(small_ckpt: Path, small_data: Path, tmp_path: Path, capsys, stop_at) -> None:
    """`--json -`: stdout is the summary alone (the closing lines go to stderr), as `-` means for every JSON output;
    to a file, the command says `wrote PATH`."""
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--steps", "2", *FAST, "--eval-every", "0"]
    argv += ["--no-progress", *(["--stop-at", stop_at] if stop_at else [])]
    capsys.readouterr()
    assert train(*argv, "--out", str(tmp_path / "a"), "--json", "-") == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["step"] == int(stop_at or 2)
    assert ("--resume" if stop_at else "trained steps 0->2") in err
    assert train(*argv, "--out", str(tmp_path / "b"), "--json", str(tmp_path / "s.json")) == 0
    assert f"wrote {tmp_path / 's.json'}" in capsys.readouterr().out.splitlines()


def test_without_matplotlib_train_stops_before_training_and_names_no_plot(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "run"
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "2"]
    assert train(*argv, *PLOT) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gpt2-port train: error: OUT/loss.png needs matplotlib")
    assert err.endswith("pip install 'gpt2-port[plot]' (or pass --no-plot)")
    assert not out.exists()  # stopped before a step was taken


@pytest.mark.exactness
def test_resume_continues_exactly_same_losses_and_bit_identical_weights(
    small_ckpt: Path, small_data: Path, tmp_path: Path
) -> None:
    """6 steps == 3 steps (--stop-at 3) + resume to 6, with dropout, grad accumulation, warmup, a cosine schedule
    and evaluation in play."""
    common = ["--data", str(small_data), *FAST, "--dropout", "0.1", "--grad-accum", "2", "--warmup", "2"]
    common += ["--eval-every", "2", "--seed", "7"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train("--init", str(small_ckpt), "--out", str(full), "--steps", "6", *common) == 0
    assert train("--init", str(small_ckpt), "--out", str(part), "--steps", "6", "--stop-at", "3", *common) == 0
    assert trainer_state.load(part).step == 3
    assert train("--resume", str(part), "--steps", "6", *common) == 0
    a, b = log(full), log(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for key in ("train_loss", "lr", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]  # evaluated at steps 2, 4, 6
    wa, wb = weights(full), weights(part)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = trainer_state.load(full), trainer_state.load(part)
    assert all(torch.equal(sa.tensors[k], sb.tensors[k]) for k in sa.tensors)


def test_a_non_finite_validation_loss_is_null_in_the_log_never_the_best_and_the_run_resumes(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluation can overflow (fp16 evaluates without a grad scaler): its NaN goes into log.jsonl as null (JSON has
    no NaN), is never the best (nothing compares below NaN, so a first NaN would have kept every later best out), and
    the trainer state stays loadable, so --resume goes on."""
    from gpt2_port.train.loop import Trainer

    vals = iter([float("nan"), 5.0, float("inf"), 4.0])
    monkeypatch.setattr(Trainer, "evaluate", lambda self: next(vals))
    out = tmp_path / "run"
    common = ["--data", str(small_data), *FAST, "--eval-every", "1", "--steps", "4"]
    assert train("--init", str(small_ckpt), "--out", str(out), "--stop-at", "2", *common) == 0
    assert train("--resume", str(out), *common) == 0

    def strict(c: str) -> None:
        raise ValueError(f"{c} in log.jsonl")

    records = [json.loads(line, parse_constant=strict) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["val_loss"] for r in records] == [None, 5.0, None, 4.0]
    st = trainer_state.load(out)
    assert (st.best_val_loss, st.best_step) == (4.0, 4)


def test_the_trainer_state_is_safetensors_and_json_not_a_pickle(small_ckpt: Path, small_data: Path, tmp_path: Path):
    out = tmp_path / "run"
    assert train("--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "1", *FAST) == 0
    raw = (out / trainer_state.STATE_TENSORS).read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    names = set(header) - {"__metadata__"}
    assert {"rng.torch_cpu", "rng.data", "optim.wte.weight.exp_avg", "optim.wte.weight.exp_avg_sq"} <= names
    meta = json.loads((out / trainer_state.STATE_JSON).read_text())
    assert meta["step"] == 1 and meta["batches_drawn"] == 1 and meta["model_config"]["n_embd"] == 32


def test_from_scratch_is_seeded_and_an_out_that_holds_a_run_is_not_overwritten(
    small_data: Path, tmp_path: Path
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL.to_hf_dict()))
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert (
            train(
                "--init",
                str(cfg),
                "--from-scratch",
                "--data",
                str(small_data),
                "--out",
                str(out),
                "--steps",
                "2",
                *FAST,
            )
            == 0
        )
        runs.append(log(out))
    assert [r["train_loss"] for r in runs[0]] == [r["train_loss"] for r in runs[1]]
    assert abs(runs[0][0]["train_loss"] - math.log(512)) < 0.1  # GPT-2 init: near-uniform predictions
    rc = train(
        "--init",
        str(cfg),
        "--from-scratch",
        "--data",
        str(small_data),
        "--out",
        str(tmp_path / "a"),
        "--steps",
        "2",
        *FAST,
    )
    assert rc == 2 and log(tmp_path / "a") == runs[0]


@pytest.mark.exactness
def test_grad_checkpointing_trains_the_same_model(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch
) -> None:
    """--grad-checkpointing: the same losses and weights bit for bit, and the blocks do go through checkpoint()."""
    import gpt2_port.model.gpt2 as gpt2_module

    calls = [0]
    real = gpt2_module.checkpoint

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(gpt2_module, "checkpoint", counted)
    runs, checkpointed = [], []
    for flag in ([], ["--grad-checkpointing"]):
        out = tmp_path / f"run{len(runs)}"
        argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "2", *FAST]
        calls[0] = 0
        assert train(*argv, "--dropout", "0.1", "--eval-every", "0", *flag) == 0
        runs.append(out)
        checkpointed.append(calls[0])
    assert checkpointed[0] == 0 and checkpointed[1] >= 2 * 2  # 2 blocks a step at least
    assert [r["train_loss"] for r in log(runs[0])] == [r["train_loss"] for r in log(runs[1])]
    wa, wb = weights(runs[0]), weights(runs[1])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# -- memory, NaN, Ctrl-C ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux only: reads VmHWM in /proc")
def test_the_peak_rss_a_command_reports_is_its_own_not_its_parents() -> None:
    """`peak_rss_mb` (train's and generate's --json) counts the process from its exec: a child started by a parent
    that touched 400 MB reports less than that (ru_maxrss would carry the parent's peak over), and its own 400 MB."""
    from gpt2_port.devices import peak_rss_mb

    held = torch.ones(100 * 2**20)  # 400 MB, touched
    code = "import resource, torch, gpt2_port.devices as d; a = d.peak_rss_mb(); x = torch.ones(100 * 2**20)\n"
    code += "print(a, d.peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    before, after, maxrss = map(float, r.stdout.split())
    assert peak_rss_mb() > 400 and maxrss > peak_rss_mb() - 50  # the inherited peak, as ru_maxrss tells it
    assert before < peak_rss_mb() - 300 and 390 < after - before < 420
    del held


@pytest.mark.parametrize(("kernels", "dtype"), [("reference", "float32"), ("fast", "float32"), ("fast", "bf16")])
def test_the_estimate_bounds_a_real_runs_peak(shakes: Path, tmp_path: Path, kernels: str, dtype: str) -> None:
    """A run whose memory is mostly logits (GPT-2's vocabulary, 8 x 256 tokens, a 2-layer 64-wide model): the peak
    RSS of a fresh `gpt2-port train` process stays under the estimate it printed, which is what makes the check
    before the run a promise (a run it accepts does not get killed). Fresh process: pytest's own memory not counted.
    Under bf16 autocast the fast kernels' estimate counts chunks and casts, not the (N, V) logits they never make.
    The fast kernels run 16 x 256 tokens: the RSS they add hardly grows with the tokens (chunks of fixed rows, the
    kernels' code paged in on first use: 30-76 MB, allocator and library caches): 287-421 MB at 8 x 256 and 295-402
    MB at 16 x 256 (torch 2.13 and 2.11, float32 and bf16, an Intel Xeon with AMX), where one logits tensor is 393
    and 785 MB: at 8 x 256 torch 2.11 in bf16 passed it.
    """
    import subprocess
    import sys

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=256)
    ck = write_demo_checkpoint(tmp_path / "ck", config=cfg, seed=1)
    out, js = tmp_path / "out", tmp_path / "s.json"
    batch = 8 if kernels == "reference" else 16
    argv = ["--init", str(ck), "--data", str(shakes), "--out", str(out), "--steps", "2", "--batch-size", str(batch)]
    argv += ["--block-size", "256", "--dropout", "0.0", "--eval-every", "0", "--kernels", kernels, "--json", str(js)]
    argv += ["--dtype", dtype, "--eval-batches", "1"]  # the final evaluation's peak is one batch's (20: 20 s more)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run(
        [sys.executable, "-m", "gpt2_port", "train", *argv, "--no-plot"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(js.read_text())
    # What the libraries hold before any training: torch's CUDA builds map ~270 MB more than its CPU build.
    imports = "import gpt2_port.cli.main, gpt2_port.cli.train, gpt2_port.devices as d; print(d.peak_rss_mb())"
    base_mb = float(subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True, env=env).stdout)
    logits_mb = batch * 256 * cfg.vocab_size * 4 / 2**20  # one (N, V) float32 tensor: 393 MB at 8 x 256
    assert s["peak_rss_mb"] <= s["memory_estimate_mb"]
    if kernels == "reference":  # the logits and their gradients were really there: the bound is not vacuous
        assert s["peak_rss_mb"] - base_mb > 3 * logits_mb
    else:  # the fused loss never made them, and the estimate does not count them
        assert s["peak_rss_mb"] - base_mb < logits_mb
        assert s["memory_estimate_mb"] < 4 * logits_mb  # less than the reference's logits (16 bytes each) alone


def test_gpt2_large_fine_tunes_in_24_gib_by_the_estimate_with_grad_checkpointing() -> None:
    large = preset("gpt2-large")
    small_batch = memory.estimate(large, 1, 1024, grad_checkpointing=True)
    assert small_batch.total < 20 * memory.GiB  # fits this 24 GiB machine with room for the system
    assert small_batch.weights + small_batch.grads + small_batch.optimizer == 16 * large.num_params()
    big_batch = memory.estimate(large, 16, 1024)
    assert big_batch.total > 24 * memory.GiB  # would be an out-of-memory kill: the check stops it first
    assert (
        memory.estimate(large, 4, 1024, grad_checkpointing=True).activations
        < memory.estimate(large, 4, 1024).activations / 5
    )


def test_a_run_that_cannot_fit_stops_with_the_estimate_and_what_to_change(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setattr(devices, "available_cpu_memory", lambda: (int(0.8 * memory.GiB), "MemAvailable (test)"))
    out = tmp_path / "run"
    rc = train(
        "--init",
        str(small_ckpt),
        "--data",
        str(small_data),
        "--out",
        str(out),
        "--steps",
        "1",
        "--batch-size",
        "64",
        "--block-size",
        "64",
        "--no-plot",
        "--device",
        "cpu",
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "memory: this run needs about" in err and "0.8 GiB is available" in err and "try" in err
    assert not out.exists()


def _cuda_check_stand_ins(monkeypatch: pytest.MonkeyPatch, peak: int | None, free: int) -> None:
    """Trainer.check_cuda_memory on a CPU model: the dry step's peak (None: it ran out of memory) and `free` bytes of
    the device, the whole of it usable (no headroom), stood in for."""
    from gpt2_port.train import loop

    monkeypatch.setattr(loop, "dry_step_peak", lambda model, loss, device, micro_steps: peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * memory.GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a stand-in GPU")
    monkeypatch.setattr(memory, "MEMORY_HEADROOM", 1.0)


def test_the_cuda_check_adds_adams_moments_only_where_the_optimizer_has_none(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainer.check_cuda_memory: the dry step's peak, plus 8 bytes a parameter for the moments the first step makes;
    after a step (or on a resume, whose moments are on the device before the dry step), the peak already holds them.
    The CUDA calls are stood in for here (a CPU model); tests/test_cuda.py runs the check on a GPU."""
    peak = 3 * memory.GiB
    _cuda_check_stand_ins(monkeypatch, peak, 70 * memory.GiB)
    model, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=3, batch_size=2, block_size=16, eval_every=0, dropout=0.0)
    prepare_model(model, args, torch.device("cpu"))
    t = Trainer(model, args, open_split(small_data, "train", SMALL.vocab_size, 16), None, tmp_path / "o", "cpu")
    params = sum(p.numel() for p in model.parameters())
    fresh = t.check_cuda_memory()
    assert fresh["estimate_bytes"] == peak + 8 * params and "AdamW moments" in fresh["detail"]
    t.step(0)
    assert t.check_cuda_memory()["estimate_bytes"] == peak


@pytest.mark.parametrize(("fits", "hint"), [(5, 5), (9, 6)])
def test_a_cuda_refusal_suggests_the_batch_the_measured_peak_allows(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fits: int, hint: int
) -> None:
    """The measured check's refusal is one line whose --batch-size comes from the measurement: the dry step's peak at
    the run's 12 rows less what the rows dropped keep for backward, and the largest divisor of the step's 60 rows
    (--grad-accum 5) that fits, so that --grad-accum keeps the batch. Here the device has exactly what `fits`
    rows take; --grad-checkpointing (which keeps less per row) fits at least as many."""
    import dataclasses

    model, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=3, batch_size=12, grad_accum=5, block_size=16, eval_every=0, dropout=0.0)
    prepare_model(model, args, torch.device("cpu"))
    moments = 8 * sum(p.numel() for p in model.parameters())
    cfg = dataclasses.replace(memory.run_config(model.config, args), attn_pdrop=0.0)

    def kept(b: int) -> int:  # what b rows keep for backward, with the measured counts
        e = memory.estimate(
            cfg,
            b,
            16,
            False,
            False,
            args.resolved_kernels,
            args.resolved_pad_vocab("cpu"),
            "cpu",
            False,
            memory.BLOCK_ACTIVATIONS_MEASURED,
        )
        return e.activations + e.logits

    peak = 3 * memory.GiB
    _cuda_check_stand_ins(monkeypatch, peak, peak + moments - kept(12) + kept(fits))
    t = Trainer(model, args, open_split(small_data, "train", SMALL.vocab_size, 16), None, tmp_path / "o", "cpu")
    with pytest.raises(UsageError) as e:
        t.check_cuda_memory()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("memory: this run needs 3.0 GiB (a dry step's peak 3.0, AdamW moments")
    assert f"try --batch-size {hint} (with --grad-accum {60 // hint} for the same batch) or --grad-check" in msg, msg
    gc = int(msg.rsplit("--grad-checkpointing (fits --batch-size ", 1)[1].rstrip(")"))
    assert hint <= gc <= 12 and 60 % gc == 0, msg


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_what_a_smaller_batch_saves_is_counted_with_the_measured_activations(
    monkeypatch: pytest.MonkeyPatch, dropout: float
) -> None:
    """The saving from dropping rows is what autograd keeps per token as measured (22.7 units with the reference
    kernels), not the estimate's rounded-up count (26), which would overstate it: on a wide model with a small
    vocabulary (activations dominate), a device with room for 3 of 12 rows gets --batch-size 3, where the rounded-up
    count would promise 4. Attention dropout adds no (T, T) scores to it (they would promise 4 too): SDPA's CUDA
    kernels keep none."""
    import dataclasses

    cfg = GPT2Config(n_layer=2, n_embd=256, n_head=8, n_positions=64, vocab_size=64)
    args = TrainArgs(batch_size=12, grad_accum=5, block_size=64, dropout=dropout)
    flat = dataclasses.replace(cfg.with_dropout(0.0), attn_pdrop=0.0)

    def kept(b: int) -> int:
        e = memory.estimate(flat, b, 64, per_token=memory.BLOCK_ACTIVATIONS_MEASURED)
        return e.activations + e.logits

    peak, moments = 2 * memory.GiB, 8 * cfg.num_params()
    _cuda_check_stand_ins(monkeypatch, peak, peak + moments - kept(12) + kept(3))
    with pytest.raises(UsageError, match=r"try --batch-size 3 \(with --grad-accum 20 for the same batch\)"):
        memory.check_measured(cfg, args, 64, torch.device("cpu"), peak, moments)


@pytest.mark.parametrize(("fits", "hint"), [(4, 4), (16, 8)])
def test_a_dry_step_out_of_memory_is_one_line_with_a_smaller_batch(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fits: int, hint: int
) -> None:
    """When the dry step itself runs out of memory there is no peak to scale: the refusal says so in one line and
    suggests the batch the estimate's device bytes (no host allowances) fit into the free memory, always below the
    batch that just ran out (where the estimate has room for all 16 rows, 8)."""
    model, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=3, batch_size=16, block_size=16, eval_every=0, dropout=0.0)
    prepare_model(model, args, torch.device("cpu"))
    cfg = memory.run_config(model.config, args)
    est = memory.estimate(cfg, fits, 16, False, False, args.resolved_kernels, args.resolved_pad_vocab("cpu"))
    _cuda_check_stand_ins(monkeypatch, None, est.total - est.slack - est.overhead)
    t = Trainer(model, args, open_split(small_data, "train", SMALL.vocab_size, 16), None, tmp_path / "o", "cpu")
    with pytest.raises(UsageError) as e:
        t.check_cuda_memory()
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("memory: this run ran out of memory in a dry forward and backward at --batch-size 16 ")
    assert f"try --batch-size {hint} (with --grad-accum {16 // hint} for the same batch)" in msg, msg


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_the_cuda_dry_step_holds_the_gradients_through_a_micro_step_when_they_accumulate(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grad_accum: int
) -> None:
    """From the second micro-step of an accumulating step on, the whole gradient is held through the forward and
    backward: the dry step runs two micro-steps then (the second with every gradient there), one otherwise, and
    drops its gradients after. The CUDA calls are stood in for (a CPU model)."""
    import contextlib

    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * memory.GiB, 80 * memory.GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a stand-in GPU")
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices=None: contextlib.nullcontext())
    model, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=3, batch_size=2, block_size=16, eval_every=0, dropout=0.0, grad_accum=grad_accum)
    prepare_model(model, args, torch.device("cpu"))
    t = Trainer(model, args, open_split(small_data, "train", SMALL.vocab_size, 16), None, tmp_path / "o", "cpu")
    grads_held: list[bool] = []
    real = t._micro_loss

    def micro_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        grads_held.append(all(p.grad is not None for p in model.parameters()))
        return real(x, y)

    monkeypatch.setattr(t, "_micro_loss", micro_loss)
    t.check_cuda_memory()
    assert grads_held == ([False, True] if grad_accum > 1 else [False])
    assert all(p.grad is None for p in model.parameters())


def test_a_nan_loss_stops_with_the_step_and_skip_nonfinite_skips_it(small_ckpt: Path, small_data: Path) -> None:
    m, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=3, batch_size=2, block_size=16, eval_every=0, dropout=0.0)
    prepare_model(m, args, torch.device("cpu"))
    with torch.no_grad():
        m.ln_f.weight[3] = float("nan")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    t = Trainer(m, args, TokenFile(small_data / "train.bin", 512), None, "/nonexistent-out")
    with pytest.raises(NonFiniteError, match=r"step 1: the loss is nan .*--skip-nonfinite"):
        t.run()
    for k, v in m.state_dict().items():  # nothing was applied
        assert torch.equal(torch.nan_to_num(before[k]), torch.nan_to_num(v)), k


def test_skip_nonfinite_skips_the_step_without_changing_weights(
    small_ckpt: Path, small_data: Path, tmp_path: Path
) -> None:
    m, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=2, batch_size=2, block_size=16, eval_every=0, dropout=0.0, skip_nonfinite=True)
    prepare_model(m, args, torch.device("cpu"))
    with torch.no_grad():
        m.h[0].mlp.c_fc.bias[0] = float("inf")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    res = Trainer(m, args, TokenFile(small_data / "train.bin", 512), None, tmp_path / "o").run()
    assert res.skipped_steps == [1, 2]
    for k, v in m.state_dict().items():
        assert torch.equal(torch.nan_to_num(before[k]), torch.nan_to_num(v)), k
    assert [r.get("skipped") for r in log(tmp_path / "o")] == [True, True]


def test_a_grad_scalers_overflow_step_is_recorded_as_skipped_and_leaves_the_weights(
    small_ckpt: Path, small_data: Path, tmp_path: Path
) -> None:
    """fp16 trains with a grad scaler (CUDA); when the scaled gradients overflow, the scaler skips the step and halves
    its scale. The record says so (the weights did not move), and the run goes on. Here the scaler is torch's CPU one
    with a scale that overflows float32 at once (the loss ~6 times 2**127)."""
    m, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=1, batch_size=2, block_size=16, eval_every=0, dropout=0.0)
    prepare_model(m, args, torch.device("cpu"))
    t = Trainer(m, args, TokenFile(small_data / "train.bin", 512), None, tmp_path / "o")
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    res = t.run()
    assert [r.get("skipped") for r in log(tmp_path / "o")] == [True]
    assert res.skipped_steps == [1] and t.scaler.get_scale() == 2.0**126
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_a_resumed_fp16_run_takes_up_the_grad_scalers_state(small_ckpt: Path, small_data: Path, tmp_path: Path) -> None:
    """The grad scaler's scale and growth tracker are saved with the run and taken up by its resume: a resumed fp16 run
    continues at the scale it had backed off to, not at GradScaler's default. Here the scaler is torch's CPU one
    (fp16 trains on CUDA), starting where float32 overflows (a skipped step halves it)."""
    m, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=2, batch_size=2, block_size=16, eval_every=0, dropout=0.0)
    prepare_model(m, args, torch.device("cpu"))
    data = TokenFile(small_data / "train.bin", 512)
    t = Trainer(m, args, data, None, tmp_path / "o")
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=3)
    t.run()
    saved = t.scaler.state_dict()
    assert saved["scale"] < 2.0**127  # backed off, so unlike a fresh scaler's
    st = trainer_state.load(tmp_path / "o")
    assert st.scaler == saved
    m2, _ = from_pretrained(tmp_path / "o")
    prepare_model(m2, args, torch.device("cpu"))
    t2 = Trainer(m2, args, data, None, tmp_path / "o", resume=st, resume_dir=tmp_path / "o")
    t2.scaler = torch.amp.GradScaler("cpu")
    t2._restore(st, tmp_path / "o")  # as a CUDA Trainer restores it when it is built
    assert t2.scaler.state_dict() == saved


def test_ctrl_c_saves_a_resumable_state_then_exits(small_ckpt: Path, small_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "gpt2_port",
        "train",
        "--init",
        str(small_ckpt),
        "--data",
        str(small_data),
        "--out",
        str(out),
        "--steps",
        "100000",
        *FAST,
        "--eval-every",
        "0",
        "--schedule",
        "constant",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "log.jsonl").exists() and len(log(out)) >= 2):
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    st = trainer_state.load(out)
    assert st.step >= 2 and f"interrupted at step {st.step}/100000" in stdout
    assert "--resume" in stdout and "Traceback" not in stderr
    assert [r["step"] for r in log(out)] == list(range(1, st.step + 1))
    # the interrupted run resumes to the same place as an uninterrupted run (constant lr: --steps may change)
    more = ["--data", str(small_data), *FAST, "--eval-every", "0", "--schedule", "constant"]
    assert train("--resume", str(out), "--steps", str(st.step + 2), *more) == 0
    ref = tmp_path / "ref"
    assert train("--init", str(small_ckpt), "--out", str(ref), "--steps", str(st.step + 2), *more) == 0
    assert [r["train_loss"] for r in log(out)] == [r["train_loss"] for r in log(ref)]
    wa, wb = weights(out), weights(ref)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# -- mixed precision, honest stops and summaries ---------------------------------------------------------------------
@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_bf16_autocast_trains_on_the_cpu_with_either_kernel_set(
    small_ckpt: Path, small_data: Path, tmp_path: Path, kernels: str
) -> None:
    """The step that crashed in CAttn's backward under autocast: it runs, and its losses track the float32 run's."""
    losses = {}
    for dtype in ("float32", "bf16"):
        out = tmp_path / dtype
        argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "3", *FAST]
        assert train(*argv, "--dtype", dtype, "--kernels", kernels, "--dropout", "0", "--eval-every", "0") == 0
        losses[dtype] = [r["train_loss"] for r in log(out)]
        assert trainer_state.load(out).args["dtype"] == dtype
    assert losses["bf16"] != losses["float32"]  # bf16 really ran
    for a, b in zip(losses["float32"], losses["bf16"]):
        assert abs(a - b) / a < 2e-2


@pytest.mark.parametrize("overlap", [False, True], ids=["read-then-step", "overlapped"])
@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_a_step_reads_the_device_once(
    small_ckpt: Path, small_data: Path, tmp_path: Path, kernels: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read of a tensor's value by gpt2_port's own code during a step with 2 micro-batches, counted over every
    way a value reaches the host: one (the step's loss and gradient norm together, through readback.Readback), with
    the AdamW step after the read or queued before it (`overlap`: skipped on the device when not finite). The
    forward's id checks are off as for a device tensor (they run only on CPU tensors); reads from inside torch are
    not counted. The fused loss's check for an incoming gradient of exactly 1 is off too (it reads a CPU tensor
    only)."""
    import traceback

    from gpt2_port.model import gpt2 as gpt2_module
    from gpt2_port.train import distributed

    model, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=3, batch_size=2, block_size=16, grad_accum=2, dropout=0.1, kernels=kernels, eval_every=0)
    args.overlap = overlap
    prepare_model(model, args, torch.device("cpu"))
    split = open_split(small_data, "train", SMALL.vocab_size, 16)
    t = Trainer(model, args, split, None, tmp_path / "out", "cpu", distributed.from_env())
    t.step(0)
    package = str(Path(gpt2_module.__file__).parents[1])
    reads: list[str] = []
    from gpt2_port.model import fused

    for module in (gpt2_module, fused):  # the checks that read values run on CPU tensors only: as on a device
        monkeypatch.setattr(module, "host_readable", lambda tensor: False)
    for name in ("tolist", "item", "__bool__", "__float__", "__int__", "__index__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            caller = traceback.extract_stack(limit=2)[0]
            if caller.filename.startswith(package):
                reads.append(f"{_name} at {Path(caller.filename).name}:{caller.lineno}")
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    record = t.step(1)
    monkeypatch.undo()
    assert len(reads) == 1 and reads[0].startswith("tolist at readback.py"), reads
    assert math.isfinite(record["train_loss"]) and record["grad_norm"] > 0


def test_a_cpu_step_runs_torchs_fused_adamw(small_ckpt: Path, small_data: Path, tmp_path: Path) -> None:
    """The CPU step updates every weight with torch's fused AdamW, as on CUDA: one kernel, no parameter-sized
    temporaries (the for-loop AdamW's square root and quotient), read as the ops the step dispatches."""
    from conftest import OpNames

    model, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=2, batch_size=2, block_size=16, dropout=0.0, eval_every=0)
    prepare_model(model, args, torch.device("cpu"))
    t = Trainer(model, args, open_split(small_data, "train", SMALL.vocab_size, 16), None, tmp_path / "out", "cpu")
    with OpNames() as ops:
        t.step(0)
    seen = ops.seen
    assert seen.count("_fused_adamw_") == len(t.optimizer.param_groups)  # one call per group, every weight in it
    assert "sqrt" not in seen and "addcdiv_" not in seen  # nothing of the for-loop AdamW's arithmetic
    assert all(p in t.optimizer.state for p in model.parameters())


def test_default_kernels_are_the_reference_in_float32_and_fast_under_autocast() -> None:
    assert TrainArgs(dtype="float32").resolved_kernels == "reference"
    assert TrainArgs(dtype="bf16").resolved_kernels == "fast"
    assert TrainArgs(dtype="bf16", kernels="reference").resolved_kernels == "reference"


def test_under_autocast_the_fast_kernels_estimate_counts_chunks_and_casts_not_the_logits() -> None:
    """The fused head-and-loss never holds the (N, V) logits under autocast either: it holds its chunks, the head and
    the hidden states cast to autocast's dtype, and one chunk's head-gradient product. Counting 16 bytes a logit
    there (3.3 GB more at 8 x 1024) refused runs that fit; the real run's bound is test_the_estimate_bounds_..."""
    fast, full = (memory.estimate(preset("gpt2"), 8, 1024, amp=True, kernels=k) for k in ("fast", "reference"))
    fast32 = memory.estimate(preset("gpt2"), 8, 1024, kernels="fast")
    assert fast.logits - fast32.logits == 50257 * 768 * 6 + 8 * 1024 * 768 * 2
    assert fast.logits < full.logits / 10 and full.logits == 8 * 1024 * 50257 * memory.LOGIT_BYTES
    # a CPU without bf16 units (lowp.autocast_upcast): the head and hidden states as float32 copies, a float32
    # head-gradient product before its rounding, one more chunk; the reference head's float32 product and head
    up_fast, up_full = (
        memory.estimate(preset("gpt2"), 8, 1024, amp=True, kernels=k, upcast=True) for k in ("fast", "reference")
    )
    assert up_fast.logits - fast.logits == 50257 * 768 * 4 + 8 * 1024 * 768 * 2 + 256 * 50257 * 4
    assert up_full.logits - full.logits == 8 * 1024 * 50257 * 4 + 50257 * 768 * 4
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert not memory.upcasts_under_autocast(TrainArgs(dtype="float32"), cpu)
    assert not memory.upcasts_under_autocast(TrainArgs(dtype="bf16"), gpu)
    assert memory.upcasts_under_autocast(TrainArgs(dtype="bf16"), cpu) is lowp.upcasts_autocast_dtype(torch.bfloat16)


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_the_estimate_counts_what_attention_on_float32_copies_keeps(monkeypatch: pytest.MonkeyPatch, kernels) -> None:  # noqa: ANN001
    """Under bf16 autocast on a CPU without bf16 units attention runs on float32 copies (lowp.attention), which
    autograd keeps: the bytes it saves for one block's backward, measured with the float32 products on and off,
    grow by no more than the estimate's per-block increment (and by something: the term is not vacuous)."""
    monkeypatch.setattr(lowp, "cpu_features", lambda: frozenset())
    cfg = GPT2Config(n_layer=1, n_embd=64, n_head=2, n_positions=64, vocab_size=512).with_dropout(0.0)
    model = GPT2(cfg).init_weights(0).train()
    model.set_kernels(kernels)
    x = torch.randn(2, 64, 64, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}

    def saved(on: bool) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        lowp.set_autocast_upcast(on)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model.h[0](x, None, None)
        finally:
            lowp.set_autocast_upcast(True)
        return sum(n for ptr, n in seen.items() if ptr not in params)

    grown = saved(True) - saved(False)
    est = [memory.estimate(cfg, 2, 64, amp=True, kernels=kernels, upcast=u).activations for u in (True, False)]
    assert 0 < grown <= (est[0] - est[1]) / cfg.n_layer, (grown, est)


def test_the_fused_head_is_padded_to_64_on_cuda_by_default_and_not_on_the_cpu() -> None:
    """On this CPU padding gains nothing measurable (benchmarks.head_padding: 50304 rows at 0.986x and 0.861x the
    unpadded head in float32, 1.166x and 0.944x in bf16, two measures of the same head: noise), so it pads on CUDA
    only, where GEMMs take aligned sizes (nanoGPT's 50304)."""
    assert TrainArgs().resolved_pad_vocab("cpu") == 1
    assert TrainArgs().resolved_pad_vocab("cuda") == 64
    assert TrainArgs(pad_vocab=128).resolved_pad_vocab("cpu") == 128
    assert TrainArgs(pad_vocab=1).resolved_pad_vocab("cuda") == 1
    for bad in (0, -64, 2.5, True):
        with pytest.raises(UsageError, match="--pad-vocab must be a positive integer"):
            TrainArgs(pad_vocab=bad).validate()  # type: ignore[arg-type]
    # the CPU estimate counts a padded float32 head's copy (50304 x 768 floats) and its wider chunks
    plain, padded = (memory.estimate(preset("gpt2"), 4, 256, kernels="fast", pad_multiple=m) for m in (1, 64))
    assert padded.logits - plain.logits >= 50304 * 768 * 4
    assert (
        memory.estimate(preset("gpt2"), 4, 256, pad_multiple=64).logits
        == memory.estimate(preset("gpt2"), 4, 256).logits
    )


def test_a_padded_head_trains_like_the_unpadded_one_and_saves_the_real_rows(
    small_ckpt: Path, small_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--pad-vocab 96 takes SMALL's 512-token head to 576 rows inside the fused loss: the run says so, the losses
    are the unpadded run's to rounding, and the saved checkpoint holds 512 rows."""
    runs = {}
    for pad in ("1", "96"):
        out = tmp_path / pad
        argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "3", *FAST]
        argv += ["--kernels", "fast", "--dropout", "0", "--eval-every", "0", "--pad-vocab", pad]
        assert train(*argv, "--json", str(tmp_path / f"{pad}.json")) == 0
        runs[pad] = (log(out), json.loads((tmp_path / f"{pad}.json").read_text()), capsys.readouterr().err)
        assert weights(out)["wte.weight"].shape == (SMALL.vocab_size, SMALL.n_embd)
    (plain, s1, err1), (padded, s96, err96) = runs["1"], runs["96"]
    assert s1["head_vocab"] == 512 and "head padded" not in err1
    assert s96["head_vocab"] == 576 and "kernels fast (head padded to 576)" in err96
    for a, b in zip(plain, padded):  # float32: the same products, only the softmax rows are longer
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5 * a["train_loss"]


def test_the_optimizer_state_lands_on_the_parameters_device(small_ckpt: Path, small_data: Path, tmp_path: Path):
    """Saved from one device, restored onto parameters on another ('meta' stands in for a GPU here): every moment
    beside its parameter, and the step count where torch's AdamW keeps it: beside the parameter for the fused kernel
    (which refuses a CPU step with a CUDA parameter), a CPU scalar otherwise."""
    out = tmp_path / "run"
    assert train("--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "1", *FAST) == 0
    st = trainer_state.load(out)
    for fused in (False, True):
        with torch.device("meta"):
            m = GPT2(SMALL)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused)
        trainer_state.load_optimizer_tensors(m, opt, st.tensors, out)
        for p in m.parameters():
            s = opt.state[p]
            assert s["exp_avg"].device.type == "meta" and s["exp_avg_sq"].device.type == "meta"
            assert s["step"].device.type == ("meta" if fused else "cpu") and s["step"].dtype == torch.float32


def test_a_nonfinite_grad_norm_is_json_null(small_ckpt: Path, small_data: Path, tmp_path: Path) -> None:
    m, _ = from_pretrained(small_ckpt)
    args = TrainArgs(steps=1, batch_size=2, block_size=16, eval_every=0, dropout=0.0, skip_nonfinite=True)
    prepare_model(m, args, torch.device("cpu"))
    with torch.no_grad():
        m.h[0].mlp.c_fc.bias[0] = float("inf")
    Trainer(m, args, TokenFile(small_data / "train.bin", 512), None, tmp_path / "o").run()
    line = (tmp_path / "o" / "log.jsonl").read_text()
    assert "Infinity" not in line and "NaN" not in line  # strict JSON
    r = json.loads(line)
    assert r["grad_norm"] is None and r["train_loss"] is None and r["skipped"] is True


def test_the_summary_gives_this_runs_mean_rate_and_its_own_time(
    small_ckpt: Path, small_data: Path, tmp_path: Path, capsys
) -> None:
    out, js = tmp_path / "run", tmp_path / "s.json"
    base = ["--data", str(small_data), *FAST, "--eval-every", "0", "--json", str(js)]
    assert train("--init", str(small_ckpt), "--out", str(out), "--steps", "6", "--stop-at", "3", *base) == 0
    before = trainer_state.load(out).elapsed_s  # the time the first run had spent when it saved step 3
    assert train("--resume", str(out), *base) == 0
    text = capsys.readouterr().out.splitlines()[-1]
    s = json.loads(js.read_text())
    recs = log(out)[3:]
    mean = (
        s["global_batch"]
        * s["block_size"]
        * (len(recs) - 1)
        / sum(s["global_batch"] * s["block_size"] / r["tokens_per_s"] for r in recs[1:])
    )
    assert s["tokens_per_s"] == pytest.approx(mean, rel=1e-6)  # the mean over this run's steps, not the last one
    assert s["last_tokens_per_s"] == pytest.approx(recs[-1]["tokens_per_s"], rel=1e-9)
    assert s["total_elapsed_s"] == pytest.approx(before + s["elapsed_s"], rel=1e-9)
    assert "trained steps 3->6 in" in text and "since step 0" in text and "tok/s mean" in text
    assert all("mfu" in r for r in log(out)) and s["mfu"] is None  # no peak is known for a CPU


def test_mfu_is_the_rate_against_the_devices_peak_in_the_log_the_summary_and_its_line(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Where a peak is known (a GPU in the peak table: here a stand-in peak for the CPU), every log record's mfu is
    its tokens/s times the FLOPs per token over the peak, the summary's is the mean rate's, and its line shows it."""
    from gpt2_port.train import loop
    from gpt2_port.train.throughput import flops_per_token

    peak = 1e9
    monkeypatch.setattr(loop, "peak_flops", lambda *a, **k: (peak, "a stand-in peak"))
    out, js = tmp_path / "run", tmp_path / "s.json"
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "3", *FAST]
    capsys.readouterr()
    assert train(*argv, "--eval-every", "0", "--json", str(js)) == 0
    s, recs = json.loads(js.read_text()), log(out)
    per_token = flops_per_token(from_pretrained(small_ckpt)[0].config, 16)
    for r in recs:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / peak, rel=1e-9)
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] * per_token / peak, rel=1e-9)
    assert s["mfu"] > 0 and f"MFU {100 * s['mfu']:.1f}%; model in {out}" in capsys.readouterr().out


def _interrupt_at(
    monkeypatch: pytest.MonkeyPatch, where: str, at: int, times: int, signum: int = signal.SIGINT
) -> None:
    """Ctrl-C pressed `times` times (a real SIGINT each, or `signum`, delivered to this process's handler) inside the
    Trainer's `where` ("step" or "evaluate") on its `at`-th call (1-based)."""
    real = getattr(Trainer, QUEUE.get(where, where))
    calls = []

    def pressed(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == at:
            for _ in range(times):
                signal.raise_signal(signum)  # the handler runs before the next line
        return real(self, *a, **k)

    monkeypatch.setattr(Trainer, QUEUE.get(where, where), pressed)


def test_ctrl_c_is_acknowledged_at_once_and_a_second_stops_without_saving(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The first Ctrl-C is answered on stderr at once, while the step runs; a second one stops there, saves nothing,
    and says which state the directory holds."""
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, "step", at=4, times=2)
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "10", *FAST]
    rc = train(*argv, "--eval-every", "0", "--save-every", "2")
    err = capsys.readouterr().err
    assert rc == 130, err
    assert "stopping after this step" in err and "Ctrl-C again to stop now without saving" in err
    assert f"stopped at once (second Ctrl-C) without saving: the last saved state in {out} is step 2" in err
    assert trainer_state.load(out).step == 2 and [r["step"] for r in log(out)] == [1, 2, 3]


def test_a_repeated_sigterm_still_saves(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """SIGTERM twice (a scheduler signalling every process of the job, and torchrun passing its own on) is one request:
    the run finishes the step and saves; only a second Ctrl-C stops without saving."""
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, "step", at=4, times=2, signum=signal.SIGTERM)
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "10", *FAST]
    rc = train(*argv, "--eval-every", "0", "--save-every", "2")
    o, e = capsys.readouterr()
    assert rc == 130, e
    assert "stopped at once" not in e and f"interrupted at step 4/10: state saved in {out}" in o
    assert "SIGTERM: stopping after this step (a resumable state is saved); Ctrl-C to stop now without saving" in e
    assert e.count("stopping after") == 1  # the second is the same request: said once
    assert trainer_state.load(out).step == 4 and [r["step"] for r in log(out)] == [1, 2, 3, 4]


def test_one_ctrl_c_stops_after_the_step_with_the_command_that_continues(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, "step", at=2, times=1)
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "10", *FAST]
    rc = train(*argv, "--eval-every", "0")
    o, e = capsys.readouterr()
    assert rc == 130 and "stopping after this step" in e
    assert o.splitlines()[-2:] == [
        f"interrupted at step 2/10: state saved in {out}; continue with",
        f"gpt2-port train --resume {out}",
    ]
    assert trainer_state.load(out).step == 2


def test_an_interrupt_in_the_last_steps_evaluation_is_not_swallowed(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A stop asked for during the last step's evaluation: the evaluation is cut short, the step saved, the run ends
    with exit 130 and says what happened (before, this waited for the evaluation and exited 0 in silence)."""
    out = tmp_path / "run"
    _interrupt_at(monkeypatch, "evaluate", at=2, times=1)
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "4", *FAST]
    rc = train(*argv, "--eval-every", "2")
    o, e = capsys.readouterr()
    assert rc == 130, e
    assert "interrupted at step 4/4, the last: the run is complete (its final evaluation skipped)" in o
    assert trainer_state.load(out).step == 4
    assert "val_loss" in log(out)[1] and "val_loss" not in log(out)[3]


@pytest.mark.parametrize("finite_first", [False, True])
def test_a_skipped_fp16_step_leaves_the_grad_scaler_ready_for_the_next(finite_first: bool) -> None:
    """fp16 trains with a GradScaler: a step skipped for a non-finite loss (--skip-nonfinite) still ends the scaler's
    step (`update`), so the next step's unscale_ runs, and the scale backs off. torch's CPU GradScaler runs the same
    logic as CUDA's."""
    from gpt2_port.train.loop import apply_step

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    losses = [torch.tensor(float("inf")) * w.sum(), w.sum()]
    if finite_first:
        losses.reverse()
    for loss in losses:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # raises on the second step unless the first one's update ran
        finite = bool(torch.isfinite(loss))
        apply_step(opt, scaler, finite)
        opt.zero_grad(set_to_none=True)
    assert scaler.get_scale() == 2.0**9  # backed off once, for the non-finite step
    assert not torch.equal(w.detach(), torch.ones(3))  # the finite step was taken


def test_summary_json_write_failing_after_the_run_is_one_line(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """--json on a full device (/dev/full passes the early check): the run is saved, then exit 2 with one line naming
    --json and the reason, and the summary kept in a file in the system's temporary directory."""
    import tempfile

    kept_dir = tmp_path / "systmp"
    kept_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(kept_dir))
    out = tmp_path / "run"
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "1", *FAST]
    rc = train(*argv, "--json", "/dev/full", "--no-progress")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    line = err.splitlines()[-1]
    assert line.startswith("gpt2-port train: error: --json /dev/full: cannot write (No space left on device)"), line
    (kept,) = kept_dir.glob("gpt2-port-results-*")
    assert json.loads(kept.read_text())["step"] == 1 and f"kept in {kept}" in line
    assert trainer_state.load(out).step == 1


def test_tokenizer_named_is_checked_before_the_first_step(
    small_ckpt: Path, small_data: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """--tokenizer is read before training (a missing file would otherwise end the run at its first save), and a
    good one is copied beside the saved model."""
    steps: list[int] = []
    real_step = Trainer._queue_step
    monkeypatch.setattr(Trainer, "_queue_step", lambda self, i: steps.append(i) or real_step(self, i))
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--steps", "2", *FAST]
    assert train(*argv, "--out", str(tmp_path / "bad"), "--tokenizer", str(tmp_path / "nonexist")) == 2
    assert steps == [] and not (tmp_path / "bad").exists()
    assert "--tokenizer" in capsys.readouterr().err
    assert train(*argv, "--out", str(tmp_path / "good"), "--tokenizer", str(tokenizer_dir)) == 0
    assert steps == [0, 1] and (tmp_path / "good" / "vocab.json").is_file()


def test_train_args_name_the_state_file_and_key() -> None:
    """Settings read from a trainer_state.json are named by the file and key, not by a flag the user never gave."""
    with pytest.raises(UsageError, match=r"^--grad-accum must be a positive integer, got 0$"):
        TrainArgs(grad_accum=0).validate()
    with pytest.raises(UsageError, match=r"^run/trainer_state.json: args.grad_accum must be a positive integer"):
        TrainArgs(grad_accum="2").validate("run/trainer_state.json")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"args.compile must be true or false, got 'yes'"):
        TrainArgs(compile="yes").validate("s.json")  # type: ignore[arg-type]
    TrainArgs(seed=2**63 - 1, stop_at=100, steps=100).validate()  # the largest seed, a stop at the last step


def test_the_attention_kernel_it_names_is_probed_with_gradients_on_under_the_runs_autocast(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first lines name the SDPA kernel from one probe forward, run as a step runs (gradients on, the run's
    autocast): SDPA may take another kernel for inputs that require grad than for an inference forward."""
    from gpt2_port.train import loop

    seen, real = [], loop.attention_kernels

    def spy(run, device, grad=False):  # noqa: ANN001, ANN202
        def probe():  # noqa: ANN202
            seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
            return run()

        return real(probe, device, grad)

    monkeypatch.setattr(loop, "attention_kernels", spy)
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(tmp_path / "run"), "--steps", "1"]
    assert train(*argv, *FAST, "--dtype", "bf16", "--eval-every", "0", "--no-progress") == 0
    assert seen == [(True, True)]


@pytest.mark.parametrize("flag, want", [([], True), (["--no-tf32"], False)], ids=["default", "no-tf32"])
def test_tf32_is_on_by_default_and_no_tf32_turns_it_off(
    small_ckpt: Path,
    small_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    flag,
    want,  # noqa: ANN001
) -> None:
    """What `train` asks of setup.set_tf32 (which acts on CUDA only: float32 matmuls on TF32 tensor cores), and that
    the run puts the flags back when it ends."""
    from gpt2_port.train import loop

    seen = []
    monkeypatch.setattr(loop, "set_tf32", lambda device, on: seen.append(on) or (lambda: seen.append("put back")))
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(tmp_path / "run"), "--steps", "1"]
    assert train(*argv, *FAST, "--eval-every", "0", "--no-progress", *flag) == 0
    assert seen == [want, "put back"]


def test_set_tf32_returns_what_puts_the_flags_back_as_they_were() -> None:
    """set_tf32 on a CUDA device (only flags are set, so it runs anywhere) turns TF32 on for float32 matmuls and
    cuDNN, and what it returns puts both back: a float32 generation after a training run in one process runs in
    float32. On the CPU it sets nothing."""
    from gpt2_port.train.setup import set_tf32

    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # noqa: E731
    before = flags()
    put_back = set_tf32(torch.device("cuda"), not before[0])
    try:
        assert flags() == (not before[0], not before[0])
    finally:
        put_back()
    assert flags() == before
    set_tf32(torch.device("cpu"), not before[0])()
    assert flags() == before


@pytest.mark.parametrize(("given", "dtype"), [("bfloat16", "bf16"), ("float16", "fp16"), ("BF16", "bf16")])
def test_train_takes_the_dtype_names_the_other_commands_use(given: str, dtype: str) -> None:
    """generate, eval and parity say bfloat16 and float16; train's own names are bf16 and fp16: either works."""
    from gpt2_port.cli.main import build_parser
    from gpt2_port.cli.train_settings import given_settings

    args = build_parser().parse_args(["train", "--init", "m", "--data", "d", "--out", "o", "--dtype", given])
    assert given_settings(args)["dtype"] == dtype


# -- behaviour a mutation run found unguarded ------------------------------------------------------------------------
def test_the_optimizer_decays_matrices_only() -> None:
    """The AdamW the trainer builds (not only param_groups): weight decay on the 2-D weights, none on biases and
    LayerNorm, every parameter in exactly one group."""
    from gpt2_port.train.schedule import make_optimizer

    m = GPT2(SMALL)
    opt = make_optimizer(m, 1e-3, 0.1, (0.9, 0.95), 1e-8, "cpu")
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    names = dict(m.named_parameters())
    assert len(decay) == len(names) == sum(len(g["params"]) for g in opt.param_groups)
    assert decay[id(names["wte.weight"])] == 0.1 and decay[id(names["h.0.mlp.c_fc.weight"])] == 0.1
    assert decay[id(names["ln_f.weight"])] == decay[id(names["h.1.mlp.c_proj.bias"])] == 0.0


def test_the_default_min_lr_is_a_tenth_of_lr(tmp_path: Path) -> None:
    a = TrainArgs(data=str(tmp_path), lr=1e-3, steps=100, warmup=0)
    assert a.final_min_lr == pytest.approx(1e-4)
    assert lr_at(99, a.lr, a.final_min_lr, 0, 100) == pytest.approx(1e-4)


def test_each_step_and_micro_batch_draws_its_own_dropout_masks() -> None:
    from types import SimpleNamespace

    t = SimpleNamespace(args=SimpleNamespace(seed=7, grad_accum=2), dist=SimpleNamespace(world_size=1, rank=0))
    assert len({Trainer._dropout_seed(t, s, m) for s in range(3) for m in range(2)}) == 6  # type: ignore[arg-type]


def test_the_sampler_reaches_the_last_window_and_the_first() -> None:
    """Offsets in [0, n - T - 1]: the last window's target ends on the file's last token; a file of exactly one
    window (T + 1 tokens) draws offset 0."""
    assert GlobalBatchSampler(17, 16, 4, 1, 1, 0).next_step(0).tolist() == [[0, 0, 0, 0]]
    s = GlobalBatchSampler(40, 16, 64, 1, 1, 0)
    drawn = torch.cat([s.next_step(0).flatten() for _ in range(20)])
    assert int(drawn.min()) == 0 and int(drawn.max()) == 40 - 16 - 1


def test_each_sample_is_seeded_by_its_step(small_ckpt: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The text sampled during training: seed + step, so samples differ from step to step and repeat across runs."""
    from gpt2_port.train import loop as train_loop

    seeds = []
    monkeypatch.setattr(train_loop, "generate", lambda *a, seed, **k: seeds.append(seed) or torch.zeros(1, 2).long())

    class Tok:
        def decode(self, ids: list[int]) -> str:
            return ""

    data = tmp_path / "d"
    write_bin(data / "train.bin", list(range(200)))
    t = Trainer(from_pretrained(small_ckpt)[0], TrainArgs(data=str(data), seed=3), TokenFile(data / "train.bin", 512),
                None, tmp_path / "out", device=torch.device("cpu"), tokenizer=Tok())  # fmt: skip
    t.sample(10)
    t.sample(20)
    assert seeds == [13, 23]


def test_gradient_accumulation_gives_the_step_of_the_whole_batch(small_ckpt: Path, small_data: Path, tmp_path: Path):
    """--batch-size 1 --grad-accum 2 draws the windows --batch-size 2 draws (one generator for the global batch) and
    sums each micro-batch's share of the mean: the same loss and gradient norm, to float32 rounding."""
    runs = {}
    for name, split in (("whole", ["--batch-size", "2"]), ("accum", ["--batch-size", "1", "--grad-accum", "2"])):
        out = tmp_path / name
        argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "2", *FAST]
        assert train(*argv, *split, "--eval-every", "0", "--dropout", "0") == 0
        runs[name] = log(out)
    for a, b in zip(runs["whole"], runs["accum"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_a_resume_keeps_the_best_validation_loss_it_had(
    small_ckpt: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation losses 4, 5 | resume | 6, 7: the best stays step 1's (the resumed run must not take its first
    evaluation as the best and overwrite OUT/best with worse weights)."""
    from gpt2_port.train.loop import Trainer

    vals = iter([4.0, 5.0, 6.0, 7.0])
    monkeypatch.setattr(Trainer, "evaluate", lambda self: next(vals))
    out = tmp_path / "run"
    common = ["--data", str(small_data), *FAST, "--eval-every", "1", "--steps", "4"]
    assert train("--init", str(small_ckpt), "--out", str(out), "--stop-at", "2", *common) == 0
    best = weights(out / "best")
    assert train("--resume", str(out), *common) == 0
    st = trainer_state.load(out)
    assert (st.best_val_loss, st.best_step) == (4.0, 1)
    after = weights(out / "best")
    assert all(torch.equal(best[k], after[k]) for k in best)  # OUT/best still holds step 1's weights


def test_the_last_step_is_evaluated_when_the_cadence_skips_it(small_ckpt: Path, small_data: Path, tmp_path: Path):
    out = tmp_path / "run"
    argv = ["--init", str(small_ckpt), "--data", str(small_data), "--out", str(out), "--steps", "3", *FAST]
    assert train(*argv, "--eval-every", "2") == 0
    assert [r["step"] for r in log(out) if r.get("val_loss") is not None] == [2, 3]


def test_restoring_the_generators_puts_torchs_cpu_generator_back() -> None:
    """The training loop reseeds what it draws, but a resumed process's global generator is the saved one too (a
    callback or a user's code drawing from it continues the same sequence)."""
    saved = trainer_state.rng_tensors(torch.tensor([1, 2]))
    expected = torch.rand(3)
    torch.rand(5)  # the generator moves on
    assert torch.equal(trainer_state.restore_rng(saved), torch.tensor([1, 2]))
    assert torch.equal(torch.rand(3), expected)
