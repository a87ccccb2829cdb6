"""No Python number goes through a tensor index in a training step or a decode: on CUDA each one is a wait.

`t[index_tensor] = 0.0` and `t[i, j] = 0.0` turn the number into a host tensor and copy it to the device, and that
copy waits for the device (torch's sync debug mode flags it); a slice (`t[:, j] = 0.0`, a fill), a boolean mask (a
masked fill) and a value already on the device do not wait. torch takes the same route on the CPU, so it shows here:
the number becomes a fresh 0-d tensor (`aten.lift_fresh`) that reaches `index_put_` with integer indices, or is
copied into a 0-d view. tests/test_cuda.py counts the waits themselves on a GPU."""

from __future__ import annotations

import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gpt2_port
from gpt2_port.config import GPT2Config
from gpt2_port.generate import generate_full
from gpt2_port.io.tokens import TokenFile
from gpt2_port.model import GPT2
from gpt2_port.train import Trainer
from gpt2_port.train.args import TrainArgs

aten = torch.ops.aten
PACKAGE = str(Path(gpt2_port.__file__).parent)
INDEX_PUTS = (aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default)
CFG = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=96)


class IndexedHostScalars(TorchDispatchMode):
    """Inside `with IndexedHostScalars() as seen:`, `seen.hits` lists where gpt2_port's code (file:line) put a Python
    number through an index in a way that waits for a CUDA device ("outside gpt2_port" for other code)."""

    def __init__(self) -> None:
        super().__init__()
        self.lifted: list[torch.Tensor] = []  # kept alive, so no other tensor takes their identity
        self.hits: list[str] = []

    def _from_host(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and any(t is x for x in self.lifted)

    def _hit(self) -> None:
        ours = [f for f in traceback.extract_stack() if f.filename.startswith(PACKAGE)]
        self.hits.append(f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "outside gpt2_port")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in INDEX_PUTS and self._from_host(args[2]):
            if any(i is not None and i.dtype != torch.bool for i in args[1]):  # a boolean mask is a masked fill
                self._hit()
        elif func is aten.copy_.default and args[0].dim() == 0 and self._from_host(args[1]):
            self._hit()
        out = func(*args, **kwargs)
        if func is aten.lift_fresh.default and out.dim() == 0:
            self.lifted.append(out)
        return out


def test_the_detector_sees_the_assignments_that_wait_and_not_the_ones_that_do_not() -> None:
    t = torch.zeros(4, 6)
    rows, cols = torch.arange(4), torch.zeros(4, dtype=torch.long)
    with IndexedHostScalars() as seen:
        t[rows, cols] = 0.0  # waits on CUDA
        t[0, 1] = 1.0  # waits on CUDA
        t[:, 1] = 1.0  # a fill
        t[t > 0] = 2.0  # a masked fill
        t[rows, cols] = t.new_zeros(())  # on the device already
        t[rows, cols] = torch.where(rows > 0, 1.0, 0.0)  # on the device already
    assert seen.hits == ["outside gpt2_port"] * 2


@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize(
    ("dtype", "overlap"), [("float32", False), ("bf16", False), ("bf16", True), ("scaler", True)]
)  # "scaler": float32 under torch's CPU grad scaler, standing in for fp16's (overlapped: a gradient poisoned)
def test_a_training_step_puts_no_python_number_through_an_index(
    tmp_path: Path, kernels: str, dtype: str, overlap: bool
) -> None:
    np.random.default_rng(0).integers(0, CFG.vocab_size, 3000).astype("<u2").tofile(tmp_path / "train.bin")
    model = GPT2(CFG).init_weights(0).set_kernels(kernels).set_dropout(0.1).train().requires_grad_(True)
    args = TrainArgs(steps=3, batch_size=2, block_size=16, grad_accum=2, eval_every=0, kernels=kernels)
    args.dtype, args.overlap = ("float32" if dtype == "scaler" else dtype), overlap
    t = Trainer(model, args, TokenFile(tmp_path / "train.bin", CFG.vocab_size), None, tmp_path / "out", "cpu")
    t.scaler = torch.amp.GradScaler("cpu") if dtype == "scaler" else None
    with IndexedHostScalars() as seen:
        t.step(0)
        t.step(1)
    assert seen.hits == []


@pytest.mark.parametrize("static_cache", [False, True], ids=["growing-cache", "static-cache"])
@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.3}])
def test_a_padded_batch_decode_puts_no_python_number_through_an_index(static_cache: bool, sampling: dict) -> None:
    model = GPT2(CFG).init_weights(0).eval()
    ids = torch.tensor([[0, 0, 5, 17, 42], [3, 9, 11, 2, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with IndexedHostScalars() as seen:
        out = generate_full(
            model, ids, 6, attention_mask=mask, eos_token_id=7, seed=0, static_cache=static_cache, **sampling
        )
    assert out.sequences.shape[0] == 2
    assert seen.hits == []
