"""A training run's settings: defined once, validated, saved with every checkpoint, and restored by a resume.

`TrainArgs` is what `trainer_state.json` keeps under "args". A resume starts from the saved settings; a setting the
user gives again on the command line overrides its saved value, and every override that makes the run differ from
the one an uninterrupted run would have been is named with its old and new value (`resume_changes`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..devices import DTYPES
from ..errors import UsageError
from ..model.fused import check_pad_multiple
from .schedule import lr_at

DTYPE_CHOICES = ("float32", "bf16", "fp16")
_CHOICE_OF = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def train_dtype(name: str) -> str:
    """A training dtype as DTYPE_CHOICES spells it, from any name the other commands take (devices.DTYPES: bfloat16,
    float16, ...); another name is returned as given, for argparse's choices to refuse."""
    dt = DTYPES.get(name.lower())
    return name if dt is None else _CHOICE_OF[dt]


KERNEL_CHOICES = ("auto", "reference", "fast")
SCHEDULES = ("cosine", "constant")
SEED_LIMIT = 2**63  # seeds are 0 <= seed < 2**63, so seed + step stays within what torch's generators take (< 2**64)


def is_int(v: object) -> bool:
    """An integer read from JSON or argparse (a bool is not one)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    """An int or a float (a bool is not one); inf and nan included."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class TrainArgs:
    data: str | None = None  # the directory with train.bin (and val.bin); saved, so a resume finds it
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
    # "auto": reference in float32 (bit-identical to transformers), fast under bf16/fp16 autocast (its error is far
    # inside transformers' own bf16 noise there); see `resolved_kernels` and docs/training.md
    kernels: str = "auto"
    # the fast kernels' fused head-and-loss over a vocabulary padded to a multiple of this (1: none); None: 64 on
    # CUDA (GPU GEMMs take their fast kernels on aligned sizes: nanoGPT's 50304), none elsewhere (on this CPU no
    # gain beyond the noise: benchmarks/head_padding.py); see `resolved_pad_vocab`
    pad_vocab: int | None = None
    eval_every: int = 50  # 0: never (the last step still evaluates when val.bin is given)
    eval_batches: int = 20
    save_every: int = 0  # 0: only at the end (and on Ctrl-C)
    sample_every: int = 0  # 0: never
    seed: int = 1337
    dtype: str = "float32"
    skip_nonfinite: bool = False
    compile: bool = False  # torch.compile the training and evaluation forward (fullgraph)
    tf32: bool = True  # CUDA only: float32 matmuls on TF32 tensor cores
    # torch.use_deterministic_algorithms for the run: on CUDA the attention backward without atomics and cuBLAS with
    # a fixed workspace, so the same run (and a resume) gives the same bits; slower (setup.deterministic_kernels)
    deterministic: bool = False
    stop_at: int | None = None  # this invocation only: stop after this step with a resumable state
    # this invocation only: queue step k + 1 before reading step k's loss (the AdamW step skipped on the device when
    # a step is not finite); None: on CUDA (Trainer._resolve_overlap). The same weights either way.
    overlap: bool | None = None

    def validate(self, source: str | None = None) -> None:
        """UsageError naming the setting when one has the wrong type or range. `source`: the trainer_state.json the
        settings were read from, named with the key (args.NAME) instead of the flag (--name)."""

        def bad(name: str, expected: str, value: object) -> UsageError:
            where = f"--{name.replace('_', '-')}" if source is None else f"{source}: args.{name}"
            return UsageError(f"{where} must be {expected}, got {value!r}")

        for name in ("steps", "batch_size", "grad_accum", "eval_batches"):
            if not is_int(v := getattr(self, name)) or v < 1:
                raise bad(name, "a positive integer", v)
        for name in ("warmup", "eval_every", "save_every", "sample_every"):
            if not is_int(v := getattr(self, name)) or v < 0:
                raise bad(name, "a non-negative integer", v)
        if not is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
            raise bad("seed", f"an integer in 0..{SEED_LIMIT - 1} (2**63 - 1)", self.seed)
        for name in ("block_size", "stop_at"):
            if (v := getattr(self, name)) is not None and (not is_int(v) or v < 1):
                raise bad(name, "a positive integer", v)
        if self.data is not None and not isinstance(self.data, str):
            raise bad("data", "a directory path", self.data)
        for name in ("grad_checkpointing", "skip_nonfinite", "compile", "tf32", "deterministic"):
            if not isinstance(v := getattr(self, name), bool):
                raise bad(name, "true or false", v)
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise bad("overlap", "true, false or unset", self.overlap)
        for name in ("lr", "min_lr", "beta1", "beta2", "eps", "weight_decay", "clip", "dropout"):
            if (v := getattr(self, name)) is not None and not is_number(v):
                raise bad(name, "a number", v)
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise bad("lr", "a positive number", self.lr)
        if self.min_lr is not None and not (0 <= self.min_lr <= self.lr):
            raise bad("min_lr", f"in [0, --lr={self.lr}]", self.min_lr)
        if self.schedule not in SCHEDULES:
            raise bad("schedule", "'cosine' or 'constant'", self.schedule)
        for name in ("beta1", "beta2"):
            if not (0 <= getattr(self, name) < 1):
                raise bad(name, "in [0, 1)", getattr(self, name))
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise bad("eps", "positive", self.eps)
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise bad("weight_decay", ">= 0", self.weight_decay)
        if not (self.clip >= 0 and math.isfinite(self.clip)):
            raise bad("clip", ">= 0 (0: no clipping)", self.clip)
        if self.dropout is not None and not (0 <= self.dropout < 1):
            raise bad("dropout", "in [0, 1)", self.dropout)
        if self.stop_at is not None and self.stop_at > self.steps:
            raise bad("stop_at", f"at most --steps {self.steps} (it stops the run after that step)", self.stop_at)
        if self.kernels not in KERNEL_CHOICES:
            raise bad("kernels", f"one of {', '.join(KERNEL_CHOICES)}", self.kernels)
        if self.pad_vocab is not None:
            check_pad_multiple(self.pad_vocab, "--pad-vocab" if source is None else f"{source}: args.pad_vocab")
        if self.dtype not in DTYPE_CHOICES:
            raise bad("dtype", f"one of {', '.join(DTYPE_CHOICES)}", self.dtype)

    @property
    def final_min_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def resolved_kernels(self) -> str:
        """The kernel set that runs: "auto" is the reference arithmetic in float32 and the fast kernels under
        mixed precision."""
        if self.kernels != "auto":
            return self.kernels
        return "reference" if self.dtype == "float32" else "fast"

    def resolved_pad_vocab(self, device_type: str) -> int:
        """The multiple the fused head's vocabulary is padded to on this device (1: none; only the fast kernels
        fuse the head)."""
        if self.pad_vocab is not None:
            return self.pad_vocab
        return 64 if device_type == "cuda" else 1

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.lr, self.final_min_lr, self.warmup, self.steps, self.schedule)  # type: ignore[arg-type]

    def saved(self) -> dict[str, Any]:
        """What trainer_state.json keeps: every setting but the per-invocation ones."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in PER_INVOCATION}

    @classmethod
    def from_saved(cls, saved: dict[str, Any], source: str) -> TrainArgs:
        """The settings of a saved run; keys this version does not know are refused, missing ones take defaults
        (a state written before they existed)."""
        known = {f.name for f in dataclasses.fields(cls)} - PER_INVOCATION
        unknown = sorted(set(saved) - known - PER_INVOCATION)
        if unknown:
            raise UsageError(
                f"{source}: unknown training setting(s) {', '.join(unknown)} (written by a newer gpt2-port?)"
            )
        return cls(**{k: v for k, v in saved.items() if k in known})


PER_INVOCATION = {"stop_at", "overlap"}

# What a changed setting does to a resumed run, by setting (the rest change the trained weights).
_LOG_ONLY = {"eval_every", "eval_batches", "save_every", "sample_every"}  # what is evaluated, saved and logged
_NEUTRAL = {"data", "grad_checkpointing", "skip_nonfinite"}  # the same weights (data: checked apart)


def resume_changes(saved: TrainArgs, now: TrainArgs, saved_world: int, world: int) -> list[str]:
    """One line per setting of `now` that differs from the saved run's and makes this run differ from the one an
    uninterrupted run would have been: the setting as a flag, its old and new value, and what it changes."""
    out = []
    for f in dataclasses.fields(TrainArgs):
        name = f.name
        if name in PER_INVOCATION | _NEUTRAL:
            continue
        old, new = getattr(saved, name), getattr(now, name)
        if old == new:
            continue
        if name == "steps" and now.schedule == "constant" and now.warmup < min(old, new):
            continue  # a constant schedule after warmup does not depend on the length of the run
        if name == "kernels" and saved.resolved_kernels == now.resolved_kernels:
            continue
        if name == "pad_vocab" and saved.resolved_kernels == now.resolved_kernels == "reference":
            continue  # only the fast kernels' fused head is padded
        flag = "--" + name.replace("_", "-")
        if name in _LOG_ONLY:
            effect = "evaluations, samples and checkpoints follow the new value from here on"
        elif name == "steps":
            effect = f"the {now.schedule} schedule now spans {new} steps, so the learning rates differ from here on"
        elif name == "deterministic":
            effect = (
                "on a GPU the deterministic kernels sum in another order than the default ones, so the weights are "
                "no longer bit for bit those of an uninterrupted run"
            )
        elif name == "compile":
            # measured with inductor on the CPU: 24 of 28 tensors differ after 6 steps without dropout (rel 4e-5),
            # all of them with dropout 0.1 (rel 0.1); a run kept compiled or kept eager resumes bit for bit
            effect = (
                "compiled and eager steps round differently and draw different dropout masks, so the weights are "
                "no longer bit for bit those of an uninterrupted run"
            )
        else:
            effect = "the run is no longer the one an uninterrupted run would have been"
        out.append(f"resuming with {flag} {new!r} where the saved run used {old!r}: {effect}")
    before, after = saved.batch_size * saved.grad_accum * saved_world, now.batch_size * now.grad_accum * world
    if saved_world != world and before != after:
        out.append(
            f"resuming on {world} process(es) where the saved run used {saved_world}: the global batch is now "
            f"{after} windows instead of {before}: the run is no longer the one an uninterrupted run would have been"
        )
    return out
