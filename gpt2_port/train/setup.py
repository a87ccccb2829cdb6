"""Making a model trainable, and the checks that tie a resumed run to its model: every parameter its own float32
tensor on the device, dropout, checkpointing and kernels as asked; the architecture a resume must match; TF32;
deterministic kernels."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..config import GPT2Config
from ..errors import CheckpointError
from ..generate.int8 import check_trainable
from ..model import GPT2
from .args import TrainArgs

# The config fields that make two models the same model for a resume (dropout and init fields may change).
ARCH_KEYS = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "tie_word_embeddings")


def same_model(a: GPT2Config, b: dict[str, Any], source: str) -> None:
    """Refuse a resume whose saved model differs from this one in any architectural field."""
    ours = a.to_hf_dict()
    diff = [f"{k}={b.get(k)!r} there, {ours.get(k)!r} here" for k in ARCH_KEYS if ours.get(k) != b.get(k)]
    if diff:
        raise CheckpointError(f"{source}: trained another model ({'; '.join(diff)}): cannot resume it into this one")


def prepare_model(model: GPT2, args: TrainArgs, device: torch.device) -> GPT2:
    """Make `model` trainable in place: every parameter its own contiguous float32 tensor on `device`, dropout,
    gradient checkpointing, kernels and the fused head's padding as asked, train mode, gradients on.

    A loaded checkpoint's q/k/v are views into one c_attn tensor, backed by a copy-on-write map of the file; the
    optimizer updates parameters in place, so each gets its own memory (and contiguous tensors reduce the same way
    in a fresh run and in a resumed one, which bit-identical resume needs).
    """
    check_trainable(model)
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:  # a tied head has no tensor of its own (it is wte.weight): nothing to re-tie
                t = p.detach().to(device=device, dtype=torch.float32).contiguous().clone()
                mod._parameters[name] = nn.Parameter(t)
    model.set_packed_weights(False)  # no packed copies of the load's weights, nor the fused c_attn view kept of them
    if args.dropout is not None:
        model.set_dropout(args.dropout)
    model.gradient_checkpointing = args.grad_checkpointing
    model.set_kernels(args.resolved_kernels)  # type: ignore[arg-type]
    model.set_head_padding(args.resolved_pad_vocab(device.type))
    return model.train().requires_grad_(True)


def set_tf32(device: torch.device, on: bool) -> Callable[[], None]:
    """float32 matmuls and convolutions on TF32 tensor cores (CUDA; `train` only, never the parity checker). Returns
    what puts both flags back as they were (a training run ends with it, so a float32 generation or evaluation after
    it in the same process runs in float32)."""
    if device.type != "cuda":
        return lambda: None
    was = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32

    def put_back() -> None:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = was

    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return put_back


# cuBLAS's workspace setting that makes its matmuls deterministic (torch refuses a cuBLAS call in deterministic mode
# without it, or ":16:8"); read when cuBLAS's workspace is made, so set before the first matmul on the device.
CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_kernels(device: torch.device, on: bool) -> Iterator[None]:
    """With `on`, torch.use_deterministic_algorithms(True) while the block runs, and cuDNN deterministic without
    autotuning: on CUDA the flash and memory-efficient attention backward then sum without atomics, the embedding
    backward sorts, and cuBLAS keeps a fixed workspace (CUBLAS_WORKSPACE_CONFIG, kept when already set); the same
    run gives the same bits, a resumed one included. An op with no deterministic kernel raises instead of running.
    Every setting is put back afterwards (the process may train again, as the tests do)."""
    if not on:
        yield
        return
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
