"""The training loop as a library: random windows, AdamW steps, evaluation, checkpoints, exact resume. No printing.

One step: the sampler draws the global batch's window offsets from one seeded generator; this process runs its
`grad_accum` micro-batches (forward, `cross_entropy`, backward of loss / grad_accum), DDP synchronising gradients on
the last micro-step only; the gradients are clipped to `clip`; a non-finite loss or gradient stops the run (or skips
the step with `skip_nonfinite`); AdamW steps at the schedule's learning rate. Dropout is seeded per micro-batch from
(seed, step, global micro-batch index), so its masks do not depend on how the global batch is split across processes
and micro-steps, or on where a run was resumed.

Outputs (only the process of rank 0 writes): `out/` holds the last saved step in the official layout
(save_pretrained) with `trainer_state.{json,safetensors}` beside it, `out/best/` the best step by validation loss,
`out/log.jsonl` one record per step. Each checkpoint is written into a temporary directory first and its files renamed
into place, the trainer state's JSON last, so no file is ever half-written.

Progress reaches the caller through `Callbacks` (the CLI draws a bar from them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import trainer_state
from .config import GPT2Config
from .data import GlobalBatchSampler, TokenFile
from .distributed import Dist
from .errors import CheckpointError, GPT2PortError, UsageError
from .load import save_pretrained
from .memory import GiB, available_memory, estimate, largest_batch_that_fits
from .model import GPT2
from .quantize import check_trainable
from .schedule import lr_at, make_optimizer

log = logging.getLogger(__name__)

LOG_FILE = "log.jsonl"
BEST_DIR = "best"
DTYPE_CHOICES = ("float32", "bf16", "fp16")
# The config fields that make two models the same model for a resume (dropout and init fields may change).
ARCH_KEYS = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "tie_word_embeddings")
MEMORY_HEADROOM = 0.9  # use at most this share of the available memory: the estimate is not exact
SAMPLE_TOKENS = 32  # length of the sample written to the log every --sample-every steps


class NonFiniteError(GPT2PortError):
    """The loss or the gradients became NaN or Inf: the run stops instead of training on."""


@dataclass
class TrainArgs:
    steps: int = 100  # total optimizer steps from the start of training (a resume continues to it)
    batch_size: int = 8  # micro-batch of one process
    block_size: int | None = None  # window length; None: the model's n_positions
    grad_accum: int = 1
    lr: float = 6e-4
    min_lr: float | None = None  # None: lr / 10
    warmup: int = 0
    schedule: str = "cosine"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0  # 0: no clipping (the norm is still measured)
    dropout: float | None = None  # None: keep the checkpoint's config
    grad_checkpointing: bool = False
    kernels: str = "reference"  # "fast": gpt2_port.fused (not bit-identical to transformers; within its noise)
    eval_every: int = 50  # 0: never (the last step still evaluates when val.bin is given)
    eval_batches: int = 20
    save_every: int = 0  # 0: only at the end (and on Ctrl-C)
    sample_every: int = 0  # 0: never
    seed: int = 1337
    dtype: str = "float32"
    skip_nonfinite: bool = False
    stop_at: int | None = None  # stop after this step with a resumable state (the schedule still spans `steps`)

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "eval_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        for name in ("warmup", "eval_every", "save_every", "sample_every", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UsageError(f"--{name.replace('_', '-')} must be a non-negative integer, got {v!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise UsageError(f"--block-size must be a positive integer, got {self.block_size!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr must be a positive number, got {self.lr!r}")
        if self.min_lr is not None and not (0 <= self.min_lr <= self.lr):
            raise UsageError(f"--min-lr must be in [0, --lr={self.lr}], got {self.min_lr!r}")
        if self.schedule not in ("cosine", "constant"):
            raise UsageError(f"--schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        for name in ("beta1", "beta2"):
            if not (0 <= getattr(self, name) < 1):
                raise UsageError(f"--{name} must be in [0, 1), got {getattr(self, name)!r}")
        if not self.eps > 0:
            raise UsageError(f"--eps must be positive, got {self.eps!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay!r}")
        if not (self.clip >= 0 and math.isfinite(self.clip)):
            raise UsageError(f"--clip must be >= 0 (0: no clipping), got {self.clip!r}")
        if self.dropout is not None and not (0 <= self.dropout < 1):
            raise UsageError(f"--dropout must be in [0, 1), got {self.dropout!r}")
        if self.stop_at is not None and not (isinstance(self.stop_at, int) and 1 <= self.stop_at):
            raise UsageError(f"--stop-at must be a positive integer, got {self.stop_at!r}")
        if self.kernels not in ("reference", "fast"):
            raise UsageError(f"--kernels must be 'reference' or 'fast', got {self.kernels!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")

    @property
    def final_min_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.lr, self.final_min_lr, self.warmup, self.steps, self.schedule)  # type: ignore[arg-type]


@dataclass
class Callbacks:
    """Hooks the caller passes in; each is optional. Only the process of rank 0 calls them."""

    on_step: Callable[[dict[str, Any]], None] | None = None  # the step's log record, after it is written
    on_save: Callable[[str, Path, int], None] | None = None  # ("last" | "best", directory, step)
    on_start: Callable[[dict[str, Any]], None] | None = None  # the run's settings, before the first step


@dataclass
class TrainResult:
    start_step: int
    step: int  # steps completed when the run ended
    interrupted: bool  # stopped before --steps: by request_stop (Ctrl-C, SIGTERM) or at --stop-at
    train_loss: float | None
    val_loss: float | None
    best_val_loss: float | None
    best_step: int | None
    elapsed_s: float
    tokens_per_s: float
    skipped_steps: list[int] = field(default_factory=list)


# -- model and memory ------------------------------------------------------------------------------------------------
def same_model(a: GPT2Config, b: dict[str, Any], source: str) -> None:
    """Refuse a resume whose saved model differs from this one in any architectural field."""
    ours = a.to_hf_dict()
    diff = [f"{k}={b.get(k)!r} there, {ours.get(k)!r} here" for k in ARCH_KEYS if ours.get(k) != b.get(k)]
    if diff:
        raise CheckpointError(f"{source}: trained another model ({'; '.join(diff)}): cannot resume it into this one")


def prepare_model(model: GPT2, args: TrainArgs, device: torch.device) -> GPT2:
    """Make `model` trainable in place: every parameter its own contiguous float32 tensor on `device`, dropout and
    gradient checkpointing as asked, train mode, gradients on.

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
    if args.dropout is not None:
        model.set_dropout(args.dropout)
    model.gradient_checkpointing = args.grad_checkpointing
    model.set_kernels(args.kernels)  # type: ignore[arg-type]
    return model.train().requires_grad_(True)


def check_memory(cfg: GPT2Config, args: TrainArgs, block_size: int, device: torch.device, d: Dist) -> dict:
    """Stop before the run starts if its estimated peak does not fit the free memory (one line: what to change)."""
    amp = args.dtype != "float32"
    if args.dropout is not None:
        cfg = cfg.with_dropout(args.dropout)
    est = estimate(cfg, args.batch_size, block_size, amp, args.grad_checkpointing, args.kernels)
    avail, source = available_memory(device)
    share = d.local_world_size if device.type == "cpu" else 1  # processes on one host share its memory
    budget = int(avail * MEMORY_HEADROOM) // share
    info = {"estimate_bytes": est.total, "available_bytes": avail, "source": source, "detail": est.describe()}
    if est.total <= budget:
        return info
    hints = []
    b = largest_batch_that_fits(cfg, block_size, budget, amp, args.grad_checkpointing, args.batch_size, args.kernels)
    if b:
        hints.append(
            f"--batch-size {b} (with --grad-accum {args.grad_accum * args.batch_size // b} for the same batch)"
        )
    if not args.grad_checkpointing:
        bc = largest_batch_that_fits(cfg, block_size, budget, amp, True, args.batch_size, args.kernels)
        if bc:
            hints.append(f"--grad-checkpointing (fits --batch-size {bc})")
    if not hints:
        hints.append("a smaller --block-size or a smaller model")
    per = f" per process ({share} on this host)" if share > 1 else ""
    raise UsageError(
        f"memory: this run needs about {est.describe()}{per} at --batch-size {args.batch_size} --block-size "
        f"{block_size}, but only {avail / GiB:.1f} GiB is available ({source}); try {' or '.join(hints)}"
    )


# -- output directory ------------------------------------------------------------------------------------------------
def check_out_dir(out: Path) -> None:
    """Fail before any work when `out` cannot hold a checkpoint: probe it by creating (and removing) a file in it."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    created: list[Path] = []
    p = out
    while not p.exists():
        created.append(p)
        p = p.parent
    if not p.is_dir():
        raise UsageError(f"--out {out}: {p} is a file, not a directory")
    try:
        for c in reversed(created):
            c.mkdir()
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    finally:
        for c in created:
            with contextlib.suppress(OSError):
                c.rmdir()


def _swap_in(tmp: Path, out: Path) -> None:
    """Move every file of `tmp` into `out`: the trainer state's JSON removed first and renamed in last, so a run
    killed in between leaves no state that would resume against other weights."""
    (out / trainer_state.STATE_JSON).unlink(missing_ok=True)
    for f in sorted(tmp.iterdir()):
        if f.name != trainer_state.STATE_JSON:
            os.replace(f, out / f.name)
    if (tmp / trainer_state.STATE_JSON).exists():
        os.replace(tmp / trainer_state.STATE_JSON, out / trainer_state.STATE_JSON)
    tmp.rmdir()


def _replace_dir(tmp: Path, dst: Path) -> None:
    """Put directory `tmp` at `dst` by renames: the old one moved aside, the new one in, the old one deleted."""
    old = dst.with_name(f".{dst.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old.exists():
        shutil.rmtree(old)


def read_log(path: Path, upto: int) -> list[dict]:
    """The records of log.jsonl up to step `upto` (a resume rewrites the log from there)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            r = json.loads(line)
            if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= upto:
                out.append(r)
    return out


# -- the loop --------------------------------------------------------------------------------------------------------
class Trainer:
    def __init__(
        self,
        model: GPT2,
        args: TrainArgs,
        train_data: TokenFile,
        val_data: TokenFile | None,
        out_dir: str | os.PathLike[str],
        device: torch.device | str = "cpu",
        dist: Dist | None = None,
        resume: trainer_state.TrainerState | None = None,
        resume_dir: str | os.PathLike[str] | None = None,
        tokenizer: Any = None,
        tokenizer_dir: str | os.PathLike[str] | None = None,
        callbacks: Callbacks | None = None,
    ) -> None:
        args.validate()
        self.args, self.dist = args, dist or Dist()
        self.device = torch.device(device)
        self.model = model
        self.block_size = args.block_size or model.config.n_positions
        if self.block_size > model.config.n_positions:
            raise UsageError(
                f"--block-size {self.block_size} is larger than the model's context n_positions="
                f"{model.config.n_positions}"
            )
        self.train_data, self.val_data = train_data, val_data
        self.out = Path(out_dir)
        self.tokenizer, self.tokenizer_dir = tokenizer, tokenizer_dir
        self.cb = callbacks or Callbacks()
        self._stop = False
        d = self.dist
        self.sampler = GlobalBatchSampler(
            len(train_data), self.block_size, args.batch_size, args.grad_accum, d.world_size, args.seed
        )
        self.optimizer = make_optimizer(
            model, args.lr, args.weight_decay, (args.beta1, args.beta2), args.eps, fused=self.device.type == "cuda"
        )
        if args.dtype == "fp16" and self.device.type != "cuda":
            raise UsageError("--dtype fp16 needs a CUDA device (it trains with a grad scaler); use float32 on CPU")
        self.scaler = torch.amp.GradScaler("cuda") if args.dtype == "fp16" else None
        self.start_step, self.best_val, self.best_step, self.elapsed0, self.tokens0 = 0, None, None, 0.0, 0
        self.records: list[dict] = []
        if resume is not None:
            self._restore(resume, Path(resume_dir or self.out))
        self.net: nn.Module = model
        if d.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(model, device_ids=[self.device] if self.device.type == "cuda" else None)

    # control
    def request_stop(self) -> None:
        """Ask the loop to save a resumable state after the current step and return (the CLI's Ctrl-C handler)."""
        self._stop = True

    @property
    def global_batch(self) -> int:
        return self.sampler.global_batch

    def _restore(self, st: trainer_state.TrainerState, source: Path) -> None:
        same_model(self.model.config, st.model_config, str(source / trainer_state.STATE_JSON))
        if st.args.get("steps") != self.args.steps and self.args.schedule == "cosine":
            log.warning(
                "--steps %d where the saved run planned %s: the cosine schedule now spans %d steps",
                self.args.steps,
                st.args.get("steps"),
                self.args.steps,
            )
        if st.step > self.args.steps:
            raise UsageError(f"--steps {self.args.steps}: the run in {source} is already at step {st.step}")
        trainer_state.load_optimizer_tensors(self.model, self.optimizer, st.tensors, source)
        trainer_state.restore_rng(st.tensors, self.sampler.generator)
        self.sampler.batches_drawn = st.batches_drawn
        saved_gb = int(st.args.get("batch_size", 0)) * int(st.args.get("grad_accum", 0)) * st.world_size
        if saved_gb != self.global_batch:
            log.warning(
                "resuming with a global batch of %d windows where the saved run used %d: the run continues, "
                "but is no longer the one an uninterrupted run would have been",
                self.global_batch,
                saved_gb,
            )
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

    def _train_step(self, step: int) -> tuple[float, float, bool]:
        """Forward and backward over this process's micro-batches; returns (global mean loss, grad norm, finite)."""
        a, d = self.args, self.dist
        offsets = self.sampler.next_step(d.rank)  # (A, B)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for m in range(a.grad_accum):
            x, y = self.train_data.windows(offsets[m], self.block_size)  # (B, T) each
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            torch.manual_seed(self._dropout_seed(step, m))
            last = m == a.grad_accum - 1
            sync = contextlib.nullcontext() if (last or not d.enabled) else self.net.no_sync()  # type: ignore[operator]
            with sync:
                with self._autocast():
                    # this micro-batch's summed NLL over the step's A x B x T targets (the windows ignore none):
                    # the micro-batches' losses add up to the step's mean, and backward starts from a gradient of 1
                    # (transformers' num_items_in_batch rule; the fast kernels' fused loss is exact for it)
                    loss = self.net(x, targets=y, num_items_in_batch=a.grad_accum * y.numel()).loss
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += loss.detach().double().cpu()
        total = d.all_reduce_sum(loss_sum.to(self.device)).cpu()  # sum of every process's mean
        train_loss = float(total) / d.world_size
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = a.clip if a.clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        finite = math.isfinite(train_loss) and (math.isfinite(grad_norm) or self.scaler is not None)
        return train_loss, grad_norm, finite

    def step(self, step: int) -> dict[str, Any]:
        """Optimizer step `step` (0-based): schedule, micro-batches, clip, AdamW; the start of its log record."""
        a = self.args
        lr = a.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        train_loss, grad_norm, finite = self._train_step(step)
        if not finite and not a.skip_nonfinite:
            self.optimizer.zero_grad(set_to_none=True)
            what = "loss" if not math.isfinite(train_loss) else "gradient norm"
            value = train_loss if what == "loss" else grad_norm
            raise NonFiniteError(
                f"step {step + 1}: the {what} is {value} (non-finite); stopped without applying it; lower --lr, "
                f"keep --clip, use --dtype bf16 rather than fp16, or pass --skip-nonfinite"
            )
        record: dict[str, Any] = {"step": step + 1, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm}
        if finite:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        else:
            record["skipped"] = True
            log.warning("step %d: non-finite loss or gradients, step skipped (--skip-nonfinite)", step + 1)
        self.optimizer.zero_grad(set_to_none=True)
        return record

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over `eval_batches * batch_size` val.bin windows, the same windows at every evaluation."""
        assert self.val_data is not None
        a, d = self.args, self.dist
        g = torch.Generator().manual_seed(a.seed + 1)
        n = a.eval_batches * a.batch_size
        offsets = torch.randint(len(self.val_data) - self.block_size, (n,), generator=g)[d.rank :: d.world_size]
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64)
        try:
            for chunk in offsets.split(a.batch_size):
                x, y = self.val_data.windows(chunk, self.block_size)
                with self._autocast():
                    nll = self.model(x.to(self.device), targets=y.to(self.device)).loss
                total += float(nll) * chunk.numel()
        finally:
            self.model.train()
        total = d.all_reduce_sum(total.to(self.device)).cpu()
        return float(total) / n

    @torch.no_grad()
    def sample(self, step: int) -> str | None:
        if self.tokenizer is None:
            return None
        from .generate import generate

        self.model.eval()
        try:
            prompt = torch.tensor([[50256 if self.model.config.vocab_size > 50256 else 0]], device=self.device)
            ids = generate(self.model, prompt, SAMPLE_TOKENS, do_sample=True, top_k=50, seed=self.args.seed + step)
        finally:
            self.model.train()
        return self.tokenizer.decode(ids[0, 1:].tolist())

    # saving (rank 0)
    def _state(self, step: int, elapsed: float, tokens: int) -> trainer_state.TrainerState:
        tensors = trainer_state.optimizer_tensors(self.model, self.optimizer)
        tensors.update(trainer_state.rng_tensors(self.sampler.generator))
        args = dataclasses.asdict(self.args)
        return trainer_state.TrainerState(
            step=step,
            model_config=self.model.config.to_hf_dict(),
            args=args,
            world_size=self.dist.world_size,
            batches_drawn=self.sampler.batches_drawn,
            best_val_loss=self.best_val,
            best_step=self.best_step,
            elapsed_s=elapsed,
            tokens_seen=tokens,
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
            tensors=tensors,
        )

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around every write into --out: a directory moved or deleted while training, or a write that fails (a full
        disk, lost permissions), stops the run with one line naming --out instead of a traceback."""
        if not self.out.is_dir():
            raise UsageError(
                f"--out {self.out}: the directory is gone (moved or deleted while training); stopped without "
                "writing anything more (to continue, --resume the directory where it is now)"
            )
        try:
            yield
        except OSError as e:
            raise UsageError(f"--out {self.out}: cannot write there any more ({e.strerror or e})") from None

    def save(self, step: int, elapsed: float, tokens: int) -> None:
        """The model and trainer state of `step` into --out (rank 0 only; the others wait)."""
        if self.dist.is_main:
            with self._writing():
                tmp = Path(tempfile.mkdtemp(prefix=f".step-{step}-", suffix=".partial", dir=self.out))
                try:
                    save_pretrained(self.model, tmp, self.tokenizer_dir)
                    trainer_state.save(self._state(step, elapsed, tokens), tmp)
                    _swap_in(tmp, self.out)
                finally:
                    if tmp.exists():
                        shutil.rmtree(tmp)
            if self.cb.on_save:
                self.cb.on_save("last", self.out, step)
        self.dist.barrier()

    def save_best(self, step: int) -> None:
        if not self.dist.is_main:
            return
        with self._writing():
            tmp = Path(tempfile.mkdtemp(prefix=".best-", suffix=".partial", dir=self.out))
            try:
                save_pretrained(self.model, tmp, self.tokenizer_dir)
                _replace_dir(tmp, self.out / BEST_DIR)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp)
        if self.cb.on_save:
            self.cb.on_save("best", self.out / BEST_DIR, step)

    def _write_log(self, records: list[dict], append: dict | None = None) -> None:
        if not self.dist.is_main:
            return
        with self._writing():
            if append is None:
                from .util import atomic_write_text

                atomic_write_text(self.out / LOG_FILE, "".join(json.dumps(r) + "\n" for r in records))
                return
            with open(self.out / LOG_FILE, "a") as f:
                f.write(json.dumps(append) + "\n")

    def run(self) -> TrainResult:
        a, d = self.args, self.dist
        if d.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        self._write_log(self.records)  # a resume continues the log from its step
        if self.cb.on_start and d.is_main:
            self.cb.on_start(
                {
                    "start_step": self.start_step,
                    "steps": a.steps,
                    "global_batch": self.global_batch,
                    "tokens_per_step": self.global_batch * self.block_size,
                    "block_size": self.block_size,
                    "world_size": d.world_size,
                    "params": self.model.num_params(),
                }
            )
        t_start = time.perf_counter()
        step, train_loss, val_loss, skipped = self.start_step, None, None, []
        rate, interrupted = 0.0, False
        tokens_per_step = self.global_batch * self.block_size
        last_saved = self.start_step if self.start_step else -1
        while step < a.steps:
            t0 = time.perf_counter()
            try:
                record = self.step(step)
            except NonFiniteError as e:
                saved = (
                    f"the last checkpoint in {self.out} is from step {last_saved}"
                    if last_saved >= 0
                    else ("nothing was saved")
                )
                raise NonFiniteError(f"{e} ({saved})") from None
            if record.get("skipped"):
                skipped.append(step + 1)
            train_loss = record["train_loss"]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - t0
            rate = tokens_per_step / dt if dt > 0 else 0.0
            step += 1
            last = step == a.steps
            if self.val_data is not None and ((a.eval_every and step % a.eval_every == 0) or last):
                val_loss = self.evaluate()
                record["val_loss"] = val_loss
            if a.sample_every and step % a.sample_every == 0 and d.is_main:
                text = self.sample(step)
                if text is not None:
                    record["sample"] = text
            elapsed = self.elapsed0 + time.perf_counter() - t_start
            record.update(tokens_per_s=rate, elapsed_s=elapsed)
            tokens = self.tokens0 + (step - self.start_step) * tokens_per_step
            if "val_loss" in record and (self.best_val is None or val_loss < self.best_val):  # type: ignore[operator]
                self.best_val, self.best_step = val_loss, step
                self.save_best(step)
            self._write_log([], record)
            self.records.append(record)
            if self.cb.on_step and d.is_main:
                self.cb.on_step(record)
            stop = d.all_reduce_max(torch.tensor(1.0 if self._stop else 0.0, device=self.device))
            if (bool(stop) or (a.stop_at is not None and step >= a.stop_at)) and not last:
                interrupted = True
            if last or interrupted or (a.save_every and step % a.save_every == 0):
                self.save(step, elapsed, tokens)
                last_saved = step
            if interrupted:
                break
        elapsed = self.elapsed0 + time.perf_counter() - t_start
        return TrainResult(
            start_step=self.start_step,
            step=step,
            interrupted=interrupted,
            train_loss=train_loss,
            val_loss=val_loss,
            best_val_loss=self.best_val,
            best_step=self.best_step,
            elapsed_s=elapsed,
            tokens_per_s=rate,
            skipped_steps=skipped,
        )
