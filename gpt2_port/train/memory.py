"""Peak memory of a training run, known before it starts, against the memory the device has free.

On a CUDA device the peak is measured: one dry forward and backward at the run's batch (by the trainer, which leaves
the weights, the random generators and the data position as they were) gives `max_memory_allocated`, and AdamW's two
float32 moments, which the first real step adds, come on top (`check_measured`). On the CPU, where the allocator's
peak cannot be read back, it is estimated (`estimate`, `check_memory`): the float32 weights, their gradients, AdamW's
two moments, the activations autograd keeps for one micro-batch (all of every block, or only each block's input plus
one block's worth with gradient checkpointing), the logits with their float32 loss and gradient, the largest
short-lived buffers, the memory glibc keeps after tensors are freed, and a fixed allowance for the runtime. It is
meant to err high: a run it accepts fits, and a run it rejects stops with a one-line error instead of an
out-of-memory kill.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from .. import devices
from ..config import GPT2Config
from ..devices import MEMORY_HEADROOM, GiB, out_of_memory
from ..errors import UsageError
from ..model.fused import chunk_rows, padded_vocab
from ..model.lowp import upcasts_autocast_dtype
from .args import TrainArgs
from .distributed import Dist

RUNTIME_OVERHEAD = 0.75 * GiB  # torch, numpy, the tokenizer: `train` on a 2-layer 32-wide model (vocab 512, batch
# 2 x 16) peaks at 310 MB RSS (its --json peak_rss_mb)
# Bytes autograd keeps per token per block, in units of n_embd x the activation's size, with sdpa attention. Measured
# with saved_tensors_hooks (`python -m benchmarks.train_step`): 22.7 with the reference kernels (ln_1, q/k/v, merged
# heads, c_proj, ln_2, c_fc, gelu_new's five intermediates, the MLP's c_proj), 10.7 with the fast ones (one GELU
# input kept instead of five). The estimate rounds them up (it is meant to err high); what a smaller batch saves from a
# measured peak is counted with the measured ones (`_measured_need`: it must not be overstated).
BLOCK_ACTIVATIONS_MEASURED = {"reference": 22.7, "fast": 10.7}
BLOCK_ACTIVATIONS_PER_TOKEN = {"reference": 26, "fast": 14}
ATTN_SCORES_PER_HEAD = 3  # scores, probabilities, dropout mask: (T, T) per head when attention dropout is on
# Bytes per token per n_embd that attention on float32 copies adds in each block (lowp.attention: autocast on a CPU
# whose bf16/fp16 kernels are slow): SDPA keeps float32 q, k, v and output instead of c_attn's low-precision output
# and its own. Measured with saved_tensors_hooks over one 768-wide block at 2 x 128 under bf16 autocast, the float32
# products on against off: 60.0 against 55.0 units of n_embd x 2 bytes a token with the reference kernels, 48.0
# against 43.0 with the fast ones (the weights' bf16 casts included in both); tests/test_train.py measures it again.
ATTN_UPCAST_BYTES_PER_TOKEN = 10
LOGIT_BYTES = 16  # reference kernels: logits, log-softmax kept by cross-entropy, and two (N, V) gradients in backward
# glibc keeps memory that tensors freed (the gradients between steps, most of them under its 32 MB mmap threshold)
# and hands it out again with gaps: a share of the long-lived state. Measured: gpt2-large, 1 x 1024, gradient
# checkpointing, peaks at 15.2 GiB where weights + gradients + moments + activations + logits + transients come
# to 13.8 GiB (`python -m benchmarks.memory_estimate`); 0.12 of the 11.5 GiB of state covers it.
ALLOCATOR_SLACK = 0.12


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    transient: int  # the largest short-lived buffers: the embedding's dense gradient, AdamW's temporaries on wte
    slack: int
    overhead: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def describe(self) -> str:
        parts = ("weights", "grads", "optimizer", "activations", "logits")
        inner = ", ".join(f"{p} {getattr(self, p) / GiB:.1f}" for p in parts)
        other = (self.transient + self.slack + self.overhead) / GiB
        return f"{self.total / GiB:.1f} GiB ({inner}, buffers and runtime {other:.1f} GiB)"


def estimate(
    cfg: GPT2Config,
    batch_size: int,
    block_size: int,
    amp: bool = False,
    grad_checkpointing: bool = False,
    kernels: str = "reference",
    pad_multiple: int = 1,
    device_type: str = "cpu",
    upcast: bool = False,
    per_token: dict[str, float] = BLOCK_ACTIVATIONS_PER_TOKEN,
) -> MemoryEstimate:
    """Peak bytes of one process training `cfg` at this micro-batch (weights and AdamW state in float32).

    kernels: the model's training kernels ("fast": gpt2_port.fused, which never holds the (N, V) logits).
    pad_multiple: the fused head's vocabulary padding (fast kernels: its chunks and gradient have the padded rows,
    and in float32 the padded copy of the head is one more (Vp, C) tensor); device_type: where it runs (the fused
    head's chunk rows, fused.chunk_rows); upcast: under autocast, the matmuls run as float32 products of the cast
    operands (a CPU whose bf16/fp16 GEMM is slow: `upcasts_under_autocast`), which holds float32 copies of the head
    and of one product's operands and result at a time, and attention runs on float32 copies kept for backward.
    per_token: the bytes autograd keeps per token per block, in units of n_embd x the activation's size, per kernel
    set (by default the rounded-up counts).
    """
    P = cfg.num_params()
    act = 2 if amp else 4  # bytes per activation: bf16/fp16 under autocast, else float32
    BT, C, V = batch_size * block_size, cfg.n_embd, cfg.vocab_size
    scores = ATTN_SCORES_PER_HEAD * cfg.n_head * block_size if cfg.attn_pdrop > 0 else 0
    per_block = int(BT * act * per_token[kernels] * C)
    if amp and upcast:  # attention on float32 copies: its inputs, output and (T, T) scores kept in float32
        per_block += BT * (ATTN_UPCAST_BYTES_PER_TOKEN * C + 4 * scores)
    else:
        per_block += BT * act * scores
    if grad_checkpointing:  # each block's input, plus one block recomputed at a time in backward
        activations = cfg.n_layer * BT * C * act + per_block
    else:
        activations = cfg.n_layer * per_block
    activations += 2 * BT * C * 4  # embeddings and ln_f
    if kernels == "fast":  # a few chunks of logits, and the gradients the fused loss makes in forward
        Vp = padded_vocab(V, pad_multiple)
        rows = min(BT, chunk_rows(device_type, Vp))
        logits = 3 * rows * Vp * 4 + Vp * C * 4 + BT * C * 4 + (Vp * C * 4 if Vp > V else 0)
        if amp and upcast:  # the cast head and hidden states as float32 copies, a chunk's head-gradient product in
            # float32 and rounded, and one more chunk (the logits' gradient widened): (Vp, C) x (4 + 4 + 2) bytes
            logits += Vp * C * 10 + BT * C * 4 + rows * Vp * 4
        elif amp:  # the head and the hidden states cast for its matmuls, and a chunk's head-gradient product (float32
            # under fp16): (Vp, C) x (2 + 4) bytes and (N, C) x 2
            logits += Vp * C * 6 + BT * C * 2
    else:
        logits = BT * V * LOGIT_BYTES
        if amp and upcast:  # the head's product in float32 before its rounding, and the head widened to float32
            logits += BT * V * 4 + V * C * 4
    casts = 2 * P if amp else 0  # autocast's low-precision copies of the weights
    state = 4 * P + 4 * P + 8 * P
    return MemoryEstimate(
        weights=4 * P + casts,
        grads=4 * P,
        optimizer=8 * P,
        activations=activations,
        logits=logits,
        transient=3 * V * C * 4,
        slack=int(ALLOCATOR_SLACK * state),
        overhead=int(RUNTIME_OVERHEAD),
    )


def upcasts_under_autocast(args: TrainArgs, device: torch.device) -> bool:
    """Whether the run's autocast matmuls run as float32 products (lowp.autocast_upcast: bf16/fp16 on a CPU whose
    GEMM for it is slow)."""
    if args.dtype == "float32" or device.type != "cpu":
        return False
    return upcasts_autocast_dtype(torch.bfloat16 if args.dtype == "bf16" else torch.float16)


def run_config(cfg: GPT2Config, args: TrainArgs) -> GPT2Config:
    """The model's config as the run trains it (its --dropout, which decides whether attention keeps dropout masks)."""
    return cfg if args.dropout is None else cfg.with_dropout(args.dropout)


def largest_batch_that_fits(need: Callable[[int], int], budget: int, limit: int) -> int:
    """The largest micro-batch up to `limit` whose `need(batch)` bytes are within `budget` (0 if not even 1 fits)."""
    best = 0
    for b in range(1, limit + 1):
        if need(b) > budget:
            break
        best = b
    return best


def _hints(args: TrainArgs, need: Callable[[int, bool], int], budget: int) -> str:
    """What to change so that the run fits `budget` bytes: a smaller --batch-size, with the --grad-accum that keeps
    the batch per optimizer step (the micro-batch a divisor of it), or gradient checkpointing, or else a smaller
    window or model. need(batch, grad_checkpointing): the bytes the run would take."""
    rows = args.grad_accum * args.batch_size  # rows per optimizer step in this process

    def divisor(b: int) -> int:  # the largest micro-batch up to b that divides the step's rows (0: none)
        return max((n for n in range(1, b + 1) if rows % n == 0), default=0)

    hints = []
    b = divisor(largest_batch_that_fits(lambda n: need(n, args.grad_checkpointing), budget, args.batch_size - 1))
    if b:
        hints.append(f"--batch-size {b} (with --grad-accum {rows // b} for the same batch)")
    if not args.grad_checkpointing:
        bc = divisor(largest_batch_that_fits(lambda n: need(n, True), budget, args.batch_size))
        if bc:
            hints.append(f"--grad-checkpointing (fits --batch-size {bc})")
    if not hints:
        hints.append("a smaller --block-size or a smaller model")
    return " or ".join(hints)


def check_memory(cfg: GPT2Config, args: TrainArgs, block_size: int, device: torch.device, d: Dist) -> dict:
    """Stop before the run starts if its estimated peak does not fit the free memory (one line: what to change).
    The host's check (CPU): on CUDA the trainer measures instead (`check_measured`)."""
    at = estimator(run_config(cfg, args), args, block_size, device, upcasts_under_autocast(args, device))
    est = at(args.batch_size, args.grad_checkpointing)
    avail, source = devices.available_memory(device)
    share = d.local_world_size if device.type == "cpu" else 1  # processes on one host share its memory
    budget = int(avail * MEMORY_HEADROOM) // share
    info = {
        "estimate_bytes": est.total,
        "available_bytes": avail,
        "source": source,
        "detail": est.describe(),
        "method": "estimated",
    }
    if est.total <= budget:
        return info
    per = f" per process ({share} on this host)" if share > 1 else ""
    raise UsageError(
        f"memory: this run needs about {est.describe()}{per} at --batch-size {args.batch_size} --block-size "
        f"{block_size}, but only {avail / GiB:.1f} GiB is available ({source}); "
        f"try {_hints(args, lambda b, gc: at(b, gc).total, budget)}"
    )


def estimator(
    cfg: GPT2Config,
    args: TrainArgs,
    block_size: int,
    device: torch.device,
    upcast: bool = False,
    per_token: dict[str, float] = BLOCK_ACTIVATIONS_PER_TOKEN,
) -> Callable[[int, bool], MemoryEstimate]:
    """(batch, grad_checkpointing) -> the run's `estimate` at that micro-batch: its dtype, kernels, vocabulary padding
    and device as `args` resolve them."""
    amp, kernels, pad = args.dtype != "float32", args.resolved_kernels, args.resolved_pad_vocab(device.type)
    return lambda batch, gc: estimate(cfg, batch, block_size, amp, gc, kernels, pad, device.type, upcast, per_token)


def dry_step_peak(
    model: torch.nn.Module, loss: Callable[[], torch.Tensor], device: torch.device, micro_steps: int = 1
) -> int | None:
    """CUDA: the peak bytes allocated by `micro_steps` forwards and backwards of `loss()` (a micro-batch as the
    run's, so a compiled step compiles here what the real steps reuse), the random generators kept and the gradients
    dropped after; None when it ran out of memory. With gradient accumulation pass 2: from the second micro-step on,
    the whole float32 gradient is held through the forward and backward, which the first micro-step's peak (its
    gradients made while its activations are freed) does not show."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.random.fork_rng(devices=[device]):
            for _ in range(micro_steps):
                loss().backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    except Exception as e:
        if out_of_memory(e):  # also when torch.compile wrapped it (the dry step is where a compiled step compiles)
            return None
        raise
    finally:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def check_measured(
    cfg: GPT2Config,
    args: TrainArgs,
    block_size: int,
    device: torch.device,
    step_peak: int | None,
    moments: int,
) -> dict:
    """The CUDA check: the dry step's peak (None: it ran out of memory) plus the bytes of AdamW's moments that the
    first real step will allocate (`moments`: 8 per parameter without them; 0 on a resume, whose moments were on the
    device during the dry step), against what this process can have (free memory plus its own allocations)."""
    free, total = torch.cuda.mem_get_info(device)
    have = free + torch.cuda.memory_reserved(device)
    source = f"{torch.cuda.get_device_name(device)}: {total / GiB:.1f} GiB, {free / GiB:.1f} GiB free"
    if step_peak is not None:
        need = step_peak + moments
        info = {
            "estimate_bytes": need,
            "available_bytes": have,
            "source": source,
            "detail": f"{need / GiB:.1f} GiB (a dry step's peak {step_peak / GiB:.1f}, "
            + (f"AdamW moments {moments / GiB:.1f})" if moments else "AdamW's moments in it)"),
            "method": "measured",
        }
        if need <= int(have * MEMORY_HEADROOM):
            return info
        what = f"needs {info['detail']}"
    else:
        what = "ran out of memory in a dry forward and backward"
    budget = int(have * MEMORY_HEADROOM)
    need = _measured_need(cfg, args, block_size, device, None if step_peak is None else step_peak + moments)
    hints = _hints(args, need, budget)
    raise UsageError(
        f"memory: this run {what} at --batch-size {args.batch_size} --block-size {block_size}, but only "
        f"{have / GiB:.1f} GiB is available ({source}); try {hints}"
    )


def _measured_need(
    cfg: GPT2Config, args: TrainArgs, block_size: int, device: torch.device, measured: int | None
) -> Callable[[int, bool], int]:
    """need(batch, grad_checkpointing) on CUDA, for the hints: the bytes `measured` at the run's batch less what the
    rows dropped keep for backward (the estimate's activations and logits, with the measured per-token counts, not
    its rounded-up ones, so that the saving is not overstated; the peak's parts that do not grow with the batch stay
    whole), or what gradient checkpointing's kept activations save. The attention keeps no (T, T) scores: SDPA's
    CUDA kernels apply attention dropout inside. Without a measurement (the dry step ran out of memory): the
    estimate's device bytes (its rounded-up counts, without the host's glibc slack and runtime allowance)."""
    cfg = run_config(cfg, args)
    if measured is None:
        estimated = estimator(cfg, args, block_size, device)

        def device_bytes(batch: int, grad_checkpointing: bool) -> int:
            e = estimated(batch, grad_checkpointing)
            return e.total - e.slack - e.overhead

        return device_bytes
    at = estimator(
        dataclasses.replace(cfg, attn_pdrop=0.0), args, block_size, device, False, BLOCK_ACTIVATIONS_MEASURED
    )

    def kept(batch: int, grad_checkpointing: bool) -> int:
        e = at(batch, grad_checkpointing)
        return e.activations + e.logits

    at_run = kept(args.batch_size, args.grad_checkpointing)
    return lambda batch, gc: measured - at_run + kept(batch, gc)
