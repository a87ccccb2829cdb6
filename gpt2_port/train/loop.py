"""The training loop as a library: random windows, AdamW steps, evaluation, checkpoints, exact resume. No printing.

One step: the sampler draws the global batch's window offsets from one seeded generator; this process runs its
`grad_accum` micro-batches (forward, the summed NLL over the step's targets, backward), DDP synchronising gradients
on the last micro-step only; the gradients are clipped to `clip`; a non-finite loss or gradient stops the run (or
skips the step with `skip_nonfinite`); AdamW steps at the schedule's learning rate. Dropout is seeded per micro-batch
from (seed, step, global micro-batch index), so its masks do not depend on how the global batch is split across
processes and micro-steps, or on where a run was resumed.

On an accelerator a step waits for the device once: the step's loss and gradient norm (and a DDP run's stop vote,
which rides on the loss's all-reduce) come back together. The loss accumulates on the device, batches come from
pinned memory without waiting, and the next micro-batch is gathered and queued while the device works on the current
one; the next step's first batch is drawn and sent before the step's wait (the data position saved with a checkpoint
is that of the steps taken, so a resume draws the same batch again). With `compile`, torch.compile runs the forward
and backward (one graph, no break) and the evaluation forward.

Overlapped steps (`overlap`, the default on CUDA): the loop queues step k + 1 before it reads step k's values, so the
device does not wait for the host's logging, progress and launches between steps. The AdamW step is then queued with
the step, and torch's fused kernel skips it on the device when the step is not finite (its `found_inf`; under fp16's
grad scaler, the scaler's own inf check, which a non-finite loss makes fire), and every later step too until the run
stops at the read (with `skip_nonfinite`, that step alone): the non-finite stop stays exact, no bad step is ever
applied. A step whose weights the loop uses (it evaluates, samples, saves or stops after it) is read before the next
is queued, and so is the step before the last; a stop request is taken after the step already queued (under DDP,
whose vote rides on a step's all-reduce and is read with it, up to three steps after the request). Without
`overlap` the values are read after the backward pass and the AdamW step follows the read.

Outputs go through run_dir.RunDir (the process of rank 0 writes); progress reaches the caller through `Callbacks`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..devices import memory_errors
from ..errors import GPT2PortError, UsageError
from ..generate import generate
from ..generate.readback import Readback
from ..model import GPT2
from ..model.attention_kernel import attention_kernels
from . import state as trainer_state
from .args import TrainArgs
from .data import Batches, GlobalBatchSampler, TokenFile
from .distributed import Dist
from .memory import check_measured, dry_step_peak
from .run_dir import LOG_FILE, RunDir, read_log
from .schedule import make_optimizer
from .setup import same_model, set_tf32
from .throughput import flops_per_token, mfu, peak_flops

log = logging.getLogger(__name__)

SAMPLE_TOKENS = 32  # length of the sample written to the log every --sample-every steps


def apply_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, finite: bool) -> None:
    """The optimizer step of gradients already unscaled (`scaler.unscale_`): taken when `finite`, skipped otherwise.
    With a scaler, `update` runs either way: it ends the step's unscale_ (the next step's would raise otherwise) and
    backs the scale off after non-finite gradients."""
    if scaler is not None:
        if finite:
            scaler.step(optimizer)
        scaler.update()
    elif finite:
        optimizer.step()


class NonFiniteError(GPT2PortError):
    """The loss or the gradients became NaN or Inf: the run stops instead of training on."""


@dataclass
class QueuedStep:
    """A step queued on the device whose values the host has not read yet (Trainer._finish_step reads them)."""

    step: int  # 0-based
    lr: float
    values: object  # the Readback handle of (loss sum, grad norm[, stop votes])


@dataclass
class Callbacks:
    """Hooks the caller passes in; each is optional. Only the process of rank 0 calls them."""

    on_step: Callable[[dict[str, Any]], None] | None = None  # the step's log record, after it is written
    on_save: Callable[[str, Path, int], None] | None = None  # ("last" | "best", directory, step)
    on_start: Callable[[dict[str, Any]], None] | None = None  # the run's settings, before the first step
    on_eval: Callable[[int, int], None] | None = None  # (batches done, batches) while a validation loss is measured


@dataclass
class TrainResult:
    start_step: int
    step: int  # steps completed when the run ended
    interrupted: bool  # stopped before --steps, or during the last step, by request_stop (Ctrl-C, SIGTERM)
    stopped_at: bool  # stopped at --stop-at
    train_loss: float | None
    val_loss: float | None
    best_val_loss: float | None
    best_step: int | None
    elapsed_s: float  # this invocation's time in the loop
    total_elapsed_s: float  # with the earlier runs this one resumed
    tokens_per_s: float  # this invocation's mean over its steps (the first, which warms up, left out of a longer run)
    last_tokens_per_s: float
    mfu: float | None
    skipped_steps: list[int] = field(default_factory=list)
    eval_skipped: bool = False  # a stop request came during or before the last step's evaluation


class Trainer:
    def __init__(
        self,
        model: GPT2,
        args: TrainArgs,
        train_data: TokenFile,
        val_data: TokenFile | None,
        out_dir: str | Path,
        device: torch.device | str = "cpu",
        dist: Dist | None = None,
        resume: trainer_state.TrainerState | None = None,
        resume_dir: str | Path | None = None,
        tokenizer: Any = None,
        tokenizer_dir: str | Path | None = None,
        callbacks: Callbacks | None = None,
    ) -> None:
        args.validate()
        self.args, self.dist = args, dist or Dist()
        self.device = torch.device(device)
        self.model = model
        cfg = model.config
        self.block_size = args.block_size or cfg.n_positions
        if self.block_size > cfg.n_positions:
            raise UsageError(
                f"--block-size {self.block_size} is larger than the model's context n_positions={cfg.n_positions}"
            )
        if args.dtype == "fp16" and self.device.type != "cuda":
            raise UsageError("--dtype fp16 needs a CUDA device (it trains with a grad scaler); use bf16 or float32")
        self.train_data, self.val_data = train_data, val_data
        self.run_dir = RunDir(out_dir, writes=self.dist.is_main)
        self.out = self.run_dir.out
        self.tokenizer, self.tokenizer_dir = tokenizer, tokenizer_dir
        self.cb = callbacks or Callbacks()
        self._stop = False
        self._stop_voted = False  # any process's stop request, as the last step's all-reduce summed them (DDP)
        d = self.dist
        self.sampler = GlobalBatchSampler(
            len(train_data), self.block_size, args.batch_size, args.grad_accum, d.world_size, args.seed
        )
        self.batches = Batches(train_data, self.block_size, self.device)
        self._next_batch: tuple[torch.Tensor, torch.Tensor] | None = None  # the next step's first batch, sent ahead
        self.optimizer = make_optimizer(
            model, args.lr, args.weight_decay, (args.beta1, args.beta2), args.eps, self.device.type
        )
        self.scaler = torch.amp.GradScaler("cuda") if args.dtype == "fp16" else None
        self.overlap = self._resolve_overlap()
        # 1 once an overlapped step was not finite: no later one applies (the fused kernel's found_inf is float32)
        self._halted = torch.zeros((), dtype=torch.float32, device=self.device)
        self.readback = Readback(3 if self.dist.enabled else 2, self.device, torch.float32)
        self.start_step, self.best_val, self.best_step, self.elapsed0, self.tokens0 = 0, None, None, 0.0, 0
        self.last_saved: int | None = None
        self.records: list[dict] = []
        if resume is not None:
            self._restore(resume, Path(resume_dir or self.out))
            self.last_saved = resume.step
        self._put_back_tf32 = set_tf32(self.device, args.tf32)  # called when run() ends
        self.flops_per_token = flops_per_token(cfg, self.block_size)
        self.peak, self.peak_source = peak_flops(self.device, args.dtype, args.tf32, d.world_size)  # global rate
        self.net: nn.Module = model
        if d.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(model, device_ids=[self.device] if self.device.type == "cuda" else None)
        self.train_forward: Callable[..., Any] = self.net
        self.eval_forward: Callable[..., Any] = model
        if args.compile:
            # One graph per mode (train with gradients, eval without); DDP's bucketing splits the graph, so fullgraph
            # is asked of a single process only. GPT2_PORT_COMPILE_BACKEND picks another backend than inductor
            # (aot_eager: the same graphs run by eager kernels, no C++ compiler needed).
            backend = os.environ.get("GPT2_PORT_COMPILE_BACKEND", "inductor")
            self.train_forward = torch.compile(self.net, fullgraph=not d.enabled, backend=backend)
            self.eval_forward = torch.compile(model, fullgraph=True, backend=backend)

    def _resolve_overlap(self) -> bool:
        """Whether the loop queues the next step before it reads this one (`TrainArgs.overlap`; None: on CUDA). It
        needs torch's fused AdamW, which skips a step on the device (given the grad scaler's inf check or a flag)."""
        fused = bool(self.optimizer.defaults.get("fused"))
        if self.args.overlap is None:
            return self.device.type == "cuda" and fused
        if self.args.overlap and not fused:
            raise UsageError(f"--overlap needs torch's fused AdamW, which {self.device.type} lacks; leave it out")
        return self.args.overlap

    # control
    def request_stop(self) -> None:
        """Ask the loop to save a resumable state after the current step (with `overlap`, the one queued after it
        too; an evaluation in progress is cut short) and return (the CLI's Ctrl-C handler)."""
        self._stop = True

    def _stop_requested(self) -> bool:
        """The stop request, agreed by every process: a DDP run votes in each step, the vote riding on the loss's
        all-reduce and read back with the step's one wait (no collective or wait of its own), so every process stops
        after the same step."""
        return self._stop_voted if self.dist.enabled else self._stop

    @property
    def global_batch(self) -> int:
        return self.sampler.global_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.block_size

    def _restore(self, st: trainer_state.TrainerState, source: Path) -> None:
        same_model(self.model.config, st.model_config, str(source / trainer_state.STATE_JSON))
        st.check_steps(self.args.steps, source)
        trainer_state.load_optimizer_tensors(self.model, self.optimizer, st.tensors, source)
        self.sampler.restore(trainer_state.restore_rng(st.tensors), st.batches_drawn)
        if self.scaler is not None and st.scaler:
            self.scaler.load_state_dict(st.scaler)
        self.start_step, self.best_val, self.best_step = st.step, st.best_val_loss, st.best_step
        self.elapsed0, self.tokens0 = st.elapsed_s, st.tokens_seen
        self.records = read_log(source / LOG_FILE, st.step)

    # one step
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.args.dtype == "float32":
            return contextlib.nullcontext()
        dt = torch.bfloat16 if self.args.dtype == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dt)

    def _dropout_seed(self, step: int, micro: int) -> int:
        j = micro * self.dist.world_size + self.dist.rank  # the micro-batch's index in the global batch
        return (self.args.seed * 1_000_003 + step * self.args.grad_accum * self.dist.world_size + j) % (1 << 63)

    def _micro_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the step's mean loss: its summed NLL divided by the step's A x B x T targets
        (the windows ignore none), so the micro-batches' losses add up to the step's mean and backward starts from a
        gradient of 1 (transformers' num_items_in_batch rule; the fast kernels' fused loss is exact for it)."""
        n_items = self.args.grad_accum * self.args.batch_size * self.block_size
        with self._autocast():
            return self.train_forward(x, targets=y, num_items_in_batch=n_items).loss

    def _queue_step(self, step: int) -> QueuedStep:
        """Optimizer step `step` (0-based) queued on the device: the schedule's learning rate, this process's
        micro-batches (forward and backward), the clip, and with `overlap` the AdamW step (`_apply_queued`); its
        loss, gradient norm (and the DDP stop vote) sent to the host, where `_finish_step` reads them."""
        a, d = self.args, self.dist
        lr = a.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr  # a number: each queued AdamW step keeps its own
        offsets = self.sampler.next_step(d.rank)  # (A, B)
        acc = torch.float32 if self.device.type == "mps" else torch.float64
        total = torch.zeros((), dtype=acc, device=self.device)
        x, y = self._next_batch if self._next_batch is not None else self.batches.get(offsets[0])
        self._next_batch = None
        for m in range(a.grad_accum):
            torch.manual_seed(self._dropout_seed(step, m))
            last = m == a.grad_accum - 1
            sync = contextlib.nullcontext() if (last or not d.enabled) else self.net.no_sync()  # type: ignore[operator]
            with sync:
                loss = self._micro_loss(x, y)
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach()
            if not last:  # the next micro-batch is gathered and queued while the device works on this one
                x, y = self.batches.get(offsets[m + 1])
        if d.enabled:  # sum of every process's mean, and the number of processes asked to stop, in one all-reduce
            flag = torch.full((), 1.0 if self._stop else 0.0, dtype=acc, device=self.device)  # a fill: no copy
            total, stops = d.all_reduce_sum(torch.stack([total, flag])).unbind()
        else:
            stops = None
        if self.scaler is not None:  # a non-finite loss (overlapped: and every step after it) poisons a gradient:
            # the scaler's inf check skips the step and backs off, read first or not (its gradients may be finite)
            self._poison(self._halt((~torch.isfinite(total.float())).float()))
            self.scaler.unscale_(self.optimizer)
        if a.clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.clip)
        else:  # the norm alone: clip_grad_norm_ to inf would still multiply every gradient by 1, a pass over them
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        back = [total, norm] + ([stops] if stops is not None else [])
        values = torch.stack([v.float() for v in back])  # (2 or 3,): loss sum, grad norm[, stop votes]
        sent = self.readback.send(values)  # before the AdamW step: the read need not wait for it
        if self.overlap:
            self._apply_queued(values[:2])
        # the next step's first batch is gathered and sent now, so it is on the device before that step's forward
        self._next_batch = self.batches.get(self.sampler.prefetch(d.rank)[0])
        return QueuedStep(step, lr, sent)

    def _halt(self, bad: torch.Tensor) -> torch.Tensor:
        """() float32 0/1 on the device: 1 when this step must not be applied, `bad` (this step is not finite) or,
        unless `skip_nonfinite`, an earlier overlapped step was not (the run stops when the host reads that one)."""
        if self.overlap and not self.args.skip_nonfinite:
            bad = self._halted = torch.maximum(self._halted, bad)
        return bad

    def _poison(self, flag: torch.Tensor) -> None:
        """Before the grad scaler's unscale_: one gradient element times NaN where `flag` is 1 (times 1 otherwise,
        which is exact), so the scaler's own inf check skips the step on the device."""
        g = next(p.grad for p in self.model.parameters() if p.grad is not None)
        g[(0,) * g.dim()].mul_(torch.where(flag > 0, float("nan"), 1.0))  # a 0-d view: no index from the host

    def _apply_queued(self, loss_and_norm: torch.Tensor) -> None:
        """The AdamW step queued behind the backward pass, taken or skipped on the device. With a grad scaler, its
        step and update (the fused kernel gets the scaler's inf check: `_poison` made it see a step to skip). Else
        the fused kernel's `found_inf` (set as the scaler sets it) is `_halt` of whether the loss or the norm is not
        finite (the values the host reads, so both judge alike)."""
        if self.scaler is not None:
            apply_step(self.optimizer, self.scaler, finite=True)  # the scaler's inf check decides on the device
        else:
            self.optimizer.found_inf = self._halt((~torch.isfinite(loss_and_norm)).any().float())  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf  # type: ignore[attr-defined]
        self.optimizer.zero_grad(set_to_none=True)

    def _finish_step(self, q: QueuedStep) -> dict[str, Any]:
        """Step `q.step`'s values read back (the step's one wait) and its log record begun; without `overlap`, the
        AdamW step taken (or skipped) here. A non-finite step stops the run (NonFiniteError) without having been
        applied, unless `skip_nonfinite`."""
        a, d = self.args, self.dist
        loss_sum, grad_norm, *votes = self.readback.read(q.values)  # the step's one wait
        self._stop_voted = bool(votes) and votes[0] > 0
        train_loss = loss_sum / d.world_size
        finite = math.isfinite(train_loss) and (math.isfinite(grad_norm) or self.scaler is not None)
        if not finite and not a.skip_nonfinite:
            self.optimizer.zero_grad(set_to_none=True)
            self._halted = torch.zeros_like(self._halted)  # a caller that steps on applies its steps again
            what = "loss" if not math.isfinite(train_loss) else "gradient norm"
            value = train_loss if what == "loss" else grad_norm
            raise NonFiniteError(
                f"step {q.step + 1}: the {what} is {value} (non-finite); stopped without applying it; lower --lr, "
                f"keep --clip, use --dtype bf16 rather than fp16, or pass --skip-nonfinite"
            )
        record: dict[str, Any] = {
            "step": q.step + 1,
            "train_loss": train_loss if math.isfinite(train_loss) else None,
            "lr": q.lr,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else None,  # JSON has no Infinity: null
        }
        if not self.overlap:
            apply_step(self.optimizer, self.scaler, finite)
            self.optimizer.zero_grad(set_to_none=True)
        if not finite:
            record["skipped"] = True
            log.warning("step %d: non-finite loss or gradients, step skipped (--skip-nonfinite)", q.step + 1)
        elif not math.isfinite(grad_norm):  # a grad scaler's overflow: it skipped the step and backed its scale off
            record["skipped"] = True
            log.info("step %d: the scaled gradients overflowed; the grad scaler skipped the step", q.step + 1)
        return record

    def step(self, step: int) -> dict[str, Any]:
        """Optimizer step `step` (0-based), queued and read: schedule, micro-batches, clip, AdamW; the start of its
        log record."""
        return self._finish_step(self._queue_step(step))

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over `eval_batches * batch_size` val.bin windows, the same windows at every evaluation; None when
        a stop request cut it short (a single process: a DDP run finishes it, so the processes stay in step)."""
        assert self.val_data is not None
        a, d = self.args, self.dist
        g = torch.Generator().manual_seed(a.seed + 1)
        n = a.eval_batches * a.batch_size
        offsets = torch.randint(len(self.val_data) - self.block_size, (n,), generator=g)
        # whole batches dealt to the processes in turn: each batch is the single process's batch (the same rows, the
        # same loss), every forward has --batch-size rows (one compiled shape), and a process left without a batch
        # adds 0 (more processes than batches)
        chunks = offsets.split(a.batch_size)[d.rank :: d.world_size]
        val = Batches(self.val_data, self.block_size, self.device)
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64 if self.device.type != "mps" else torch.float32, device=self.device)
        try:
            for i, chunk in enumerate(chunks):
                if self._stop and not d.enabled:
                    return None
                x, y = val.get(chunk)
                with self._autocast():
                    nll = self.eval_forward(x, targets=y).loss
                total += nll.detach() * chunk.numel()
                if self.cb.on_eval and d.is_main:
                    self.cb.on_eval(i + 1, len(chunks))
        finally:
            self.model.train()
        return float(d.all_reduce_sum(total)) / n

    @torch.no_grad()
    def sample(self, step: int) -> str | None:
        if self.tokenizer is None:
            return None
        self.model.eval()
        try:
            prompt = torch.tensor([[50256 if self.model.config.vocab_size > 50256 else 0]], device=self.device)
            # 32 tokens: no CUDA graph (its memory pool would stay beside the training's, and a capture while DDP's
            # NCCL threads run is not safe); on CUDA the static step runs eagerly
            seed = self.args.seed + step
            ids = generate(self.model, prompt, SAMPLE_TOKENS, do_sample=True, seed=seed, cuda_graph=False)  # top-k 50
        finally:
            self.model.train()
        return self.tokenizer.decode(ids[0, 1:].tolist())

    # saving (rank 0)
    def _state(self, step: int, elapsed: float, tokens: int) -> trainer_state.TrainerState:
        tensors = trainer_state.optimizer_tensors(self.model, self.optimizer)
        tensors.update(trainer_state.rng_tensors(self.sampler.state()))
        return trainer_state.TrainerState(
            step=step,
            model_config=self.model.config.to_hf_dict(),
            args=self.args.saved(),
            world_size=self.dist.world_size,
            batches_drawn=self.sampler.batches_drawn,
            best_val_loss=self.best_val,
            best_step=self.best_step,
            elapsed_s=elapsed,
            tokens_seen=tokens,
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
            train_tokens=len(self.train_data),
            tensors=tensors,
        )

    def _write_model(self, directory: Path) -> None:
        self.model.save_pretrained(directory, self.tokenizer_dir)

    def save(self, step: int, elapsed: float, tokens: int) -> None:
        """The model and trainer state of `step` into --out (rank 0 only; the others wait)."""
        if self.dist.is_main:
            self.run_dir.save(self._write_model, self._state(step, elapsed, tokens))
            if self.cb.on_save:
                self.cb.on_save("last", self.out, step)
        self.last_saved = step  # rank 0 has written it; the others (which wait below) never report it
        self.dist.barrier()

    def save_best(self, step: int) -> None:
        if not self.dist.is_main:
            return
        where = self.run_dir.save_best(self._write_model)
        if self.cb.on_save:
            self.cb.on_save("best", where, step)

    def check_cuda_memory(self) -> dict:
        """On CUDA, the memory check measured: a dry step's peak (memory.dry_step_peak; with gradient accumulation two
        micro-steps, the second holding the gradients) with AdamW's moments on top; one line naming what to change
        when it does not fit (memory.check_measured). It also warms up (and compiles: the dry micro-batch has the
        real ones' shapes, strides and divisor, so the steps reuse its graph)."""
        dev, a = self.device, self.args
        blank = lambda: self._micro_loss(*self.batches.blank(a.batch_size))  # noqa: E731
        peak = dry_step_peak(self.model, blank, dev, micro_steps=min(a.grad_accum, 2))
        # AdamW's two float32 moments, for the parameters that have none yet (a resumed run's are in the peak)
        state = self.optimizer.state
        fresh = [p for p in self.model.parameters() if p.requires_grad and "exp_avg" not in state.get(p, {})]
        return check_measured(self.model.config, a, self.block_size, dev, peak, 8 * sum(p.numel() for p in fresh))

    def describe(self) -> dict[str, Any]:
        """What the run is, for the caller's first lines: sizes, kernels, the attention kernel SDPA picks for this
        batch (one probe forward of a single window, with gradients on and under the run's autocast as a step is; the
        random generators are left as they were), the MFU peak."""
        x, _ = self.train_data.windows(torch.zeros(1, dtype=torch.long), self.block_size)
        with self._autocast():
            probe = lambda: self.model(x.to(self.device), hidden_only=True)  # noqa: E731
            kernels = attention_kernels(probe, self.device, grad=True)
        head = self.model.loss_vocab
        return {
            "start_step": self.start_step,
            "steps": self.args.steps,
            "global_batch": self.global_batch,
            "tokens_per_step": self.tokens_per_step,
            "block_size": self.block_size,
            "world_size": self.dist.world_size,
            "params": self.model.num_params(),
            "kernels": self.args.resolved_kernels,
            "head": "" if head == self.model.config.vocab_size else f" (head padded to {head})",
            "attention": ", ".join(kernels) if kernels else "hand-written (the reference's eager arithmetic)",
            "compile": self.args.compile,
            "overlap": self.overlap,
            "dtype": self.args.dtype,
            "flops_per_token": self.flops_per_token,
            "peak": self.peak_source,
        }

    # what the loop does after step n (1-based) with the weights of that step
    def _evaluates(self, n: int) -> bool:
        a = self.args
        return self.val_data is not None and ((a.eval_every > 0 and n % a.eval_every == 0) or n == a.steps)

    def _samples(self, n: int) -> bool:
        return self.args.sample_every > 0 and n % self.args.sample_every == 0

    def _saves(self, n: int) -> bool:
        return self.args.save_every > 0 and n % self.args.save_every == 0

    def _stops_at(self, n: int) -> bool:
        return self.args.stop_at is not None and n >= self.args.stop_at

    def _acts_after(self, n: int) -> bool:
        """Whether the loop uses step n's weights (evaluates, samples, saves or stops): step n + 1 waits for its
        read then. Every process decides alike (a sample is rank 0's, but the others wait for it at their next
        collective)."""
        return n == self.args.steps or self._evaluates(n) or self._samples(n) or self._saves(n) or self._stops_at(n)

    def run(self) -> TrainResult:
        """The training run (see the class); the TF32 flags it set are put back when it ends, however it ends."""
        try:
            return self._run()
        finally:
            self._put_back_tf32()

    def _run(self) -> TrainResult:
        a, d = self.args, self.dist
        self.run_dir.start(self.records)  # a resume continues the log from its step
        if self.cb.on_start and d.is_main:
            self.cb.on_start(self.describe())
        t_start = time.perf_counter()
        step, train_loss, val_loss, skipped = self.start_step, None, None, []
        interrupted = stopped_at = eval_skipped = False
        step_times: list[float] = []
        last_saved = self.start_step if self.start_step else -1
        queued: QueuedStep | None = None  # the step the loop reads next
        while step < a.steps:
            saved = "nothing was saved"
            if last_saved >= 0:
                saved = f"the last checkpoint in {self.out} is from step {last_saved}"
            try:
                if queued is None:
                    t_mark = time.perf_counter()  # a step's time: from its queueing or the last read, the later
                    with memory_errors(f"in step {step + 1} ({saved})"):
                        queued = self._queue_step(step)
                # the next step, queued before this one is read when the loop does not use this one's weights; never
                # the last (a stop request while the one before it runs leaves the last, and its evaluation, to a
                # resume)
                ahead, n = None, step + 1
                if self.overlap and n + 1 < a.steps and not self._acts_after(n) and not self._stop_requested():
                    with memory_errors(f"in step {step + 2} ({saved})"):
                        ahead = self._queue_step(step + 1)
                with memory_errors(f"in step {step + 1} ({saved})"):  # without overlap, the AdamW step is here
                    record = self._finish_step(queued)
            except NonFiniteError as e:
                raise NonFiniteError(f"{e} ({saved})") from None
            queued = ahead
            now = time.perf_counter()
            dt, t_mark = now - t_mark, now
            step_times.append(dt)
            if record.get("skipped"):
                skipped.append(step + 1)
            if record["train_loss"] is not None:
                train_loss = record["train_loss"]
            step += 1
            last = step == a.steps
            interrupted = self._stop_requested() and queued is None  # else taken after the step queued
            if self._evaluates(step):
                if interrupted:
                    eval_skipped = True
                else:
                    with memory_errors(f"evaluating after step {step} ({saved})"):
                        v = self.evaluate()
                    if v is None:
                        interrupted = eval_skipped = True
                    else:  # JSON has no NaN: null, and never the best (nothing compares below NaN)
                        val_loss = record["val_loss"] = v if math.isfinite(v) else None
                        if val_loss is None:
                            log.warning("step %d: the validation loss is %s (non-finite): written as null", step, v)
            if self._samples(step) and d.is_main and not interrupted:
                with memory_errors(f"sampling after step {step} ({saved})"):
                    text = self.sample(step)
                if text is not None:
                    record["sample"] = text
            rate = self.tokens_per_step / dt if dt > 0 else 0.0
            elapsed = self.elapsed0 + time.perf_counter() - t_start
            record.update(tokens_per_s=rate, mfu=mfu(rate, self.flops_per_token, self.peak), elapsed_s=elapsed)
            tokens = self.tokens0 + (step - self.start_step) * self.tokens_per_step
            this_val = record.get("val_loss")  # this step's, when it evaluated and the loss was finite
            if this_val is not None and (self.best_val is None or this_val < self.best_val):
                self.best_val, self.best_step = this_val, step
                self.save_best(step)
            self.run_dir.append_log(record)
            self.records.append(record)
            if self.cb.on_step and d.is_main:
                self.cb.on_step(record)
            if self._stops_at(step) and not last and not interrupted:
                stopped_at = True
            if last or interrupted or stopped_at or self._saves(step):
                self.save(step, elapsed, tokens)
                last_saved = step
            if interrupted or stopped_at:
                break
        this_run = time.perf_counter() - t_start
        timed = step_times[1:] if len(step_times) > 1 else step_times  # the first step warms up (and compiles)
        mean_rate = self.tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else 0.0
        last_rate = self.tokens_per_step / step_times[-1] if step_times and step_times[-1] > 0 else 0.0
        return TrainResult(
            start_step=self.start_step,
            step=step,
            interrupted=interrupted,
            stopped_at=stopped_at,
            train_loss=train_loss,
            val_loss=val_loss,
            best_val_loss=self.best_val,
            best_step=self.best_step,
            elapsed_s=this_run,
            total_elapsed_s=self.elapsed0 + this_run,
            tokens_per_s=mean_rate,
            last_tokens_per_s=last_rate,
            mfu=mfu(mean_rate, self.flops_per_token, self.peak),
            skipped_steps=skipped,
            eval_skipped=eval_skipped,
        )
