"""The optimizer and the learning-rate schedule of the training loop (nanoGPT's `configure_optimizers` and `get_lr`).

AdamW with weight decay on the weights of 2 or more dimensions only (matrices and embeddings); biases and LayerNorm
parameters are not decayed. nanoGPT and the HF Trainer group parameters this way. The learning rate warms up
linearly for `warmup` steps, then decays along a cosine to `min_lr` at the last step (or stays constant).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from ..errors import UsageError

ScheduleKind = Literal["cosine", "constant"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: parameters of 2+ dims decay, the rest (biases, LayerNorm) do not. A tied head is one tensor."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# Device types where torch's fused AdamW runs: one kernel over each parameter, its moments and its gradient, and no
# temporaries. On the CPU the default (for-loop) AdamW makes two parameter-sized temporaries a weight (the square
# root and its quotient): at 124M on the 2-core AMD EPYC its step took 0.65-1.1 s against the fused kernel's 0.23 s,
# most of it the kernel faulting in fresh memory for the wte-sized ones (~60 ms per 154 MB there); `gpt2-port
# train` at 4 x 256 went from 107 to 118 tokens/s in float32 and from 83 to 97 under bf16 autocast. The fused kernel
# rounds differently from the for-loop one (2.4e-7 apart after three steps of random gradients).
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float, device_type: str
) -> torch.optim.AdamW:
    """torch's AdamW over `param_groups`, fused where torch has the kernel (FUSED_ADAMW_DEVICES)."""
    kwargs = {"fused": True} if device_type in FUSED_ADAMW_DEVICES else {}
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, **kwargs)


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int, kind: ScheduleKind = "cosine") -> float:
    """The learning rate of step `step` (0-based) of `total`: linear warmup to `lr`, then cosine to `min_lr` or flat.

    Warmup: lr * (step + 1) / warmup, so the first step already moves. Cosine: from lr at step `warmup` to min_lr at
    the last step (total - 1).
    """
    if kind not in ("cosine", "constant"):
        raise UsageError(f"--schedule must be 'cosine' or 'constant', got {kind!r}")
    if step < warmup:
        return lr * (step + 1) / warmup
    if kind == "constant":
        return lr
    span = max(1, total - 1 - warmup)
    ratio = min(1.0, (step - warmup) / span)  # 0 -> 1 over the decay
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
