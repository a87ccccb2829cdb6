"""Overlapped training steps (Trainer.overlap, `train --overlap`): step k + 1 is queued before step k's loss is read,
and the AdamW step rides with the step, skipped on the device when the step is not finite. On the CPU the work is done
when it is queued, so here the order of queueing and reading, the weights, the logs and the stops are checked against
the loop that reads each step first; tests/test_cuda.py counts the waits on a GPU."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import weights

from gpt2_port.cli.main import main
from gpt2_port.config import GPT2Config
from gpt2_port.errors import UsageError
from gpt2_port.generate.readback import Readback
from gpt2_port.io.demo import write_demo_checkpoint
from gpt2_port.model import from_pretrained
from gpt2_port.train import NonFiniteError, TrainArgs, Trainer, prepare_model
from gpt2_port.train import state as trainer_state
from gpt2_port.train.data import TokenFile

SMALL = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=512)
FAST = ["--batch-size", "2", "--block-size", "16", "--eval-batches", "2", "--device", "cpu", "--no-plot"]
TIMING = ("tokens_per_s", "mfu", "elapsed_s")  # the only fields of a step's record that may differ between runs


@pytest.fixture(scope="module")
def ck(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("ck"), config=SMALL, seed=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    for split, n in (("train", 6000), ("val", 2000)):
        rng.integers(0, SMALL.vocab_size, n).astype("<u2").tofile(d / f"{split}.bin")
    return d


def records(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def same_run(a: Path, b: Path) -> None:
    """The two runs' logs (but for their timings), weights and trainer states are the same, bit for bit."""
    assert records(a) == records(b)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = trainer_state.load(a), trainer_state.load(b)
    assert sa.step == sb.step and sa.batches_drawn == sb.batches_drawn and sa.tensors.keys() == sb.tensors.keys()
    assert all(torch.equal(sa.tensors[k], sb.tensors[k]) for k in sa.tensors)


def trainer(ck: Path, data: Path, out: Path, overlap: bool, resume: object = None, **kw) -> Trainer:  # noqa: ANN003
    """A Trainer on the CPU (`resume`: a trainer_state.TrainerState saved in `out`)."""
    m, _ = from_pretrained(ck)
    args = TrainArgs(batch_size=2, block_size=16, eval_batches=2, dropout=0.0, overlap=overlap, **kw)
    prepare_model(m, args, torch.device("cpu"))
    val = TokenFile(data / "val.bin", SMALL.vocab_size) if args.eval_every else None
    return Trainer(m, args, TokenFile(data / "train.bin", SMALL.vocab_size), val, out, "cpu", resume=resume)


def test_overlapped_steps_train_the_same_run_bit_for_bit(
    ck: Path, data: Path, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`train --overlap` against `--no-overlap`: with dropout, gradient accumulation, warmup, evaluations, samples
    and saves between the steps, the same losses, learning rates, gradient norms, validation losses, samples,
    weights and trainer state. (Queued ahead across an evaluation, the evaluation would see the next step's
    weights.)"""
    common = ["--init", str(ck), "--data", str(data), *FAST, "--steps", "9", "--dropout", "0.1", "--grad-accum", "2"]
    common += ["--warmup", "2", "--eval-every", "3", "--save-every", "4", "--sample-every", "5"]
    common += ["--tokenizer", str(tokenizer_dir), "--no-progress"]
    runs = {}
    for flag in ("--overlap", "--no-overlap"):
        runs[flag] = tmp_path / flag.strip("-")
        capsys.readouterr()
        assert main(["train", *common, flag, "--out", str(runs[flag])]) == 0
        assert f"overlap {'on' if flag == '--overlap' else 'off'};" in capsys.readouterr().err
    same_run(runs["--overlap"], runs["--no-overlap"])
    recs = records(runs["--overlap"])
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6, 9] and [r["step"] for r in recs if "sample" in r] == [
        5
    ]


def test_step_k_plus_1_is_queued_before_step_k_is_read_except_where_the_loop_uses_its_weights(
    ck: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order of the loop's queueing, reading and evaluating: each step is queued before the one before it is read,
    but for a step the loop evaluates after (steps 2 and 4) and the one before the last, which are read before the
    next is queued; without overlap, every step is read before the next is queued."""
    seen: list[str] = []
    real_queue, real_read, real_eval = Trainer._queue_step, Readback.read, Trainer.evaluate

    def queue(self: Trainer, step: int):  # noqa: ANN202
        seen.append(f"q{step + 1}")
        return real_queue(self, step)

    def read(self: Readback, handle: object) -> list:
        out = real_read(self, handle)
        seen.append("r")
        return out

    def evaluate(self: Trainer):  # noqa: ANN202
        seen.append("eval")
        return real_eval(self)

    monkeypatch.setattr(Trainer, "_queue_step", queue)
    monkeypatch.setattr(Readback, "read", read)
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    for overlap in (True, False):
        seen.clear()
        trainer(ck, data, tmp_path / str(overlap), overlap, steps=5, eval_every=2).run()
        order = " ".join(seen)
        if overlap:
            assert order == "q1 q2 r r eval q3 q4 r r eval q5 r eval"
        else:
            assert order == "q1 r q2 r eval q3 r q4 r eval q5 r eval"
    seen.clear()
    trainer(ck, data, tmp_path / "plain", True, steps=4, eval_every=0).run()
    assert " ".join(seen) == "q1 q2 r q3 r r q4 r"


def _nonfinite_at(monkeypatch: pytest.MonkeyPatch, at: int, what: str) -> None:
    """Step `at` (1-based; one micro-batch a step) goes non-finite: its loss is NaN, its gradients too ("loss") or
    finite ("loss alone": a NaN added to it, as when an fp16 logit overflows), or one gradient is Inf with the loss
    finite ("gradient norm")."""
    calls = []
    if what.startswith("loss"):
        real = Trainer._micro_loss

        def loss(self: Trainer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            out = real(self, x, y)
            if len(calls) != at:
                return out
            return out + torch.tensor(float("nan")) if what == "loss alone" else out * float("nan")

        monkeypatch.setattr(Trainer, "_micro_loss", loss)
    else:
        real_clip = torch.nn.utils.clip_grad_norm_

        def clip(params, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            params = list(params)
            calls.append(1)
            if len(calls) == at:
                params[0].grad[0] = float("inf")
            return real_clip(params, *a, **k)

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)


@pytest.mark.exactness  # torch's fused AdamW skipping on `found_inf`: run on pyproject's floor torch too (./dev test)
@pytest.mark.parametrize("skip", [False, True], ids=["stop", "skip-nonfinite"])
@pytest.mark.parametrize(
    ("what", "scaler"), [("loss", False), ("gradient norm", False), ("loss", True), ("loss alone", True)]
)
def test_a_non_finite_step_is_never_applied_though_the_next_was_queued(
    ck: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip: bool, what: str, scaler: bool
) -> None:
    """Step 3's loss is NaN, or one of its gradients Inf. Overlapped, step 4 was queued (its AdamW step too) before
    step 3 was read: the run still stops at step 3 with the weights and AdamW state of step 2, as the loop that reads
    first leaves them (the fused kernel skipped step 3, and step 4 after it). With --skip-nonfinite both loops skip
    step 3 alone and train on to the same weights. `scaler`: under fp16's grad scaler (torch's CPU one standing in),
    which skips on its own inf check, also where only the loss is NaN; with --skip-nonfinite its scale is the same
    too."""
    runs = []
    for overlap in (True, False):
        with monkeypatch.context() as mp:
            _nonfinite_at(mp, 3, what)
            t = trainer(ck, data, tmp_path / str(overlap), overlap, steps=6, eval_every=0, skip_nonfinite=skip)
            t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
            if skip:
                assert t.run().skipped_steps == [3]
            else:
                said = what.removesuffix(" alone")
                with pytest.raises(NonFiniteError, match=rf"^step 3: the {said} is (nan|inf) .*nothing was saved\)$"):
                    t.run()
        runs.append(t)
    (a, b) = runs
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert int(a.optimizer.state[next(a.model.parameters())]["step"]) == (5 if skip else 2)
    if scaler and skip:
        assert a.scaler.state_dict() == b.scaler.state_dict() and a.scaler.get_scale() < 2.0**10


def test_a_run_saved_after_a_skipped_first_step_resumes_to_the_uninterrupted_run(
    ck: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 not finite under --skip-nonfinite, the run saved right after it: overlapped, the fused kernel skipped
    that step but made AdamW's state (zero moments, step 0), which the save holds; without overlap there is none yet.
    Either way the run resumed to step 4 is the run that was never stopped, bit for bit (a zero state is the state
    AdamW's first step starts from), and the two loops train the same weights."""
    final = []
    for overlap in (True, False):
        for stops in ([4], [1, 4]):
            out = tmp_path / f"{overlap}-{len(stops)}"
            st = None
            with monkeypatch.context() as mp:
                _nonfinite_at(mp, 1, "loss")
                for steps in stops:
                    t = trainer(ck, data, out, overlap, resume=st, steps=steps, eval_every=0, skip_nonfinite=True)
                    assert t.run().skipped_steps == ([1] if st is None else [])
                    st = trainer_state.load(out)
                    if steps == 1:  # the state saved after the skipped step
                        saved = {k: float(v.abs().max()) for k, v in st.tensors.items() if k.startswith("optim.")}
                        assert (set(saved.values()) == {0.0} and len(saved) > 0) if overlap else saved == {}
            assert st.step == 4
            final.append(out)
    for out in final[1:]:
        same_run(final[0], out)


def test_fp16s_grad_scaler_skips_and_backs_off_alike_overlapped(ck: Path, data: Path, tmp_path: Path) -> None:
    """Under the grad scaler (torch's CPU one standing in for fp16's), starting at a scale whose first steps overflow:
    overlapped, the same steps are skipped, the same scale is reached and the same weights trained as by the loop
    that reads each step first."""
    runs = []
    for overlap in (True, False):
        t = trainer(ck, data, tmp_path / str(overlap), overlap, steps=6, eval_every=0)
        t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=2)
        res = t.run()
        runs.append((t, res, records(tmp_path / str(overlap))))
    (a, ra, la), (b, rb, lb) = runs
    assert ra.skipped_steps == rb.skipped_steps and ra.skipped_steps[:1] == [1] and len(ra.skipped_steps) < 6
    assert la == lb and a.scaler.state_dict() == b.scaler.state_dict()
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


@pytest.mark.parametrize("where", ["save-every", "stop-at"])
def test_checkpoints_between_overlapped_steps_are_the_steps_they_name(
    ck: Path, data: Path, tmp_path: Path, where: str
) -> None:
    """Every checkpoint an overlapped run writes (--save-every 2, or --stop-at 3) holds the weights, AdamW state and
    data position of the step it names, as the loop that reads first writes it: queued ahead across a save, it would
    hold the next step's weights under this step's number."""
    saved: dict[bool, list] = {}
    for overlap in (True, False):
        out = tmp_path / str(overlap)
        kw = {"save_every": 2} if where == "save-every" else {"stop_at": 3}
        t = trainer(ck, data, out, overlap, steps=7, eval_every=0, **kw)
        snaps = saved[overlap] = []
        t.cb.on_save = lambda kind, d, step, snaps=snaps: snaps.append((step, weights(d), trainer_state.load(d)))
        t.run()
    assert [s[0] for s in saved[True]] == ([2, 4, 6, 7] if where == "save-every" else [3])
    for (step, wa, sa), (step_b, wb, sb) in zip(saved[True], saved[False], strict=True):
        assert step == step_b and sa.batches_drawn == sb.batches_drawn
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
        assert sa.tensors.keys() == sb.tensors.keys()
        assert all(torch.equal(sa.tensors[k], sb.tensors[k]) for k in sa.tensors)


def test_a_stop_request_is_taken_after_the_step_already_queued_and_the_run_resumes_exactly(
    ck: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Ctrl-C while step 3 is queued ahead of step 2's read: the loop reads step 2, finishes step 3, saves step 3 (its
    weights are the ones queued) and stops; resumed to step 6 it is the uninterrupted run, bit for bit."""
    real = Trainer._queue_step

    def pressed(self: Trainer, step: int):  # noqa: ANN202
        if step == 2:
            signal.raise_signal(signal.SIGINT)  # the CLI's handler: stop after this step
        return real(self, step)

    common = ["--data", str(data), *FAST, "--steps", "6", "--eval-every", "0", "--overlap", "--no-progress"]
    part, full = tmp_path / "part", tmp_path / "full"
    with monkeypatch.context() as mp:
        mp.setattr(Trainer, "_queue_step", pressed)
        capsys.readouterr()
        assert main(["train", "--init", str(ck), "--out", str(part), *common]) == 130
    assert "stopping after the steps already queued (a resumable state is saved)" in capsys.readouterr().err
    assert trainer_state.load(part).step == 3 and [r["step"] for r in records(part)] == [1, 2, 3]
    assert main(["train", "--resume", str(part), *common]) == 0
    assert main(["train", "--init", str(ck), "--out", str(full), *common]) == 0
    same_run(part, full)


def test_overlap_is_on_by_default_on_cuda_only_and_needs_the_fused_adamw(ck: Path, data: Path, tmp_path: Path) -> None:
    t = trainer(ck, data, tmp_path / "o", None, steps=1, eval_every=0)
    assert t.overlap is False  # the CPU: the work is done when it is queued, nothing to overlap
    stand_in = SimpleNamespace(args=TrainArgs(), optimizer=t.optimizer, scaler=None, device=torch.device("cuda"))
    assert Trainer._resolve_overlap(stand_in) is True
    stand_in.args.overlap = False
    assert Trainer._resolve_overlap(stand_in) is False
    stand_in.args.overlap = True
    stand_in.optimizer = torch.optim.AdamW(t.model.parameters(), foreach=True)  # no `found_inf`: cannot skip
    with pytest.raises(UsageError, match=r"^--overlap needs torch's fused AdamW, which cuda lacks; leave it out$"):
        Trainer._resolve_overlap(stand_in)


def test_a_caller_that_steps_on_after_a_non_finite_stop_has_its_steps_applied(
    ck: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Library use: the device's flag that holds overlapped steps back after a non-finite one is cleared with the
    NonFiniteError, so a caller that catches it and calls `step` again trains on (not silently skipped steps)."""
    with monkeypatch.context() as mp:
        _nonfinite_at(mp, 1, "loss")
        t = trainer(ck, data, tmp_path / "o", True, steps=3, eval_every=0)
        with pytest.raises(NonFiniteError, match="^step 1: the loss is nan"):
            t.step(0)
    before = [p.detach().clone() for p in t.model.parameters()]
    assert "skipped" not in t.step(1)
    assert not any(torch.equal(b, p) for b, p in zip(before, t.model.parameters(), strict=True))
