"""Peak memory of a training run, estimated before it starts, against the memory the device has free.

The estimate adds the float32 weights, their gradients, AdamW's two moments, the activations autograd keeps for
one micro-batch (all of every block, or only each block's input plus one block's worth with gradient checkpointing),
the logits with their float32 loss and gradient, and a fixed allowance for the runtime. It is meant to err high: a
run it accepts fits, and a run it rejects stops with a one-line error instead of an out-of-memory kill.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import GPT2Config

GiB = 1 << 30
RUNTIME_OVERHEAD = 0.75 * GiB  # torch, numpy, the tokenizer, allocator slack: `train` on a 2-layer 32-wide model
# (vocab 512, batch 2 x 16) peaks at 310 MB RSS (its --json peak_rss_mb)
# Values kept per token per block for backward, in units of n_embd: ln_1 in/out, q/k/v, merged heads, c_proj and its
# dropout, the residual, ln_2, c_fc (4C), gelu_new's intermediates (pow, tanh, products: ~16C), its output (4C), the
# MLP's c_proj and dropout. Counted from the autograd graph of model.py's block, rounded up.
BLOCK_ACTIVATIONS_PER_TOKEN = 36
ATTN_SCORES_PER_HEAD = 3  # scores, probabilities, dropout mask: (T, T) per head when attention is not fused
LOGIT_BYTES = 16  # logits, their float32 upcast, log-softmax kept by cross-entropy, and the logits' gradient


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    overhead: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.overhead

    def describe(self) -> str:
        parts = ("weights", "grads", "optimizer", "activations", "logits")
        inner = ", ".join(f"{p} {getattr(self, p) / GiB:.1f}" for p in parts)
        return f"{self.total / GiB:.1f} GiB ({inner} GiB)"


def estimate(
    cfg: GPT2Config, batch_size: int, block_size: int, amp: bool = False, grad_checkpointing: bool = False
) -> MemoryEstimate:
    """Peak bytes of one process training `cfg` at this micro-batch (weights and AdamW state in float32)."""
    P = cfg.num_params()
    act = 2 if amp else 4  # bytes per activation: bf16/fp16 under autocast, else float32
    BT, C = batch_size * block_size, cfg.n_embd
    per_block = BT * act * (BLOCK_ACTIVATIONS_PER_TOKEN * C + ATTN_SCORES_PER_HEAD * cfg.n_head * block_size)
    if grad_checkpointing:  # each block's input, plus one block recomputed at a time in backward
        activations = cfg.n_layer * BT * C * act + per_block
    else:
        activations = cfg.n_layer * per_block
    activations += 2 * BT * C * 4  # embeddings and ln_f
    casts = 2 * P if amp else 0  # autocast's low-precision copies of the weights
    return MemoryEstimate(
        weights=4 * P + casts,
        grads=4 * P,
        optimizer=8 * P,
        activations=activations,
        logits=BT * cfg.vocab_size * LOGIT_BYTES,
        overhead=RUNTIME_OVERHEAD,
    )


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_cpu_memory() -> tuple[int, str]:
    """Bytes this process may still use on the host: MemAvailable, or less when a cgroup limit is nearer."""
    avail, source = None, "MemAvailable in /proc/meminfo"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        avail, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "free physical pages"
    for limit_f, usage_f in (
        (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),  # cgroup v2
        (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
    ):
        limit, usage = _read_int(limit_f), _read_int(usage_f)
        if limit is not None and usage is not None and limit < (1 << 60) and limit - usage < avail:
            avail, source = max(0, limit - usage), f"the cgroup limit in {limit_f}"
    return avail, source


def available_memory(device: torch.device) -> tuple[int, str]:
    """Free bytes on `device` and where the figure comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory on {device}"
    return available_cpu_memory()


def largest_batch_that_fits(
    cfg: GPT2Config, block_size: int, budget: int, amp: bool, grad_checkpointing: bool, limit: int = 1024
) -> int:
    """The largest micro-batch whose estimate is within `budget` (0 if not even 1 fits)."""
    best = 0
    for b in range(1, limit + 1):
        if estimate(cfg, b, block_size, amp, grad_checkpointing).total > budget:
            break
        best = b
    return best
