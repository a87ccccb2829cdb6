"""The trainer state that makes a resume exact: safetensors for the tensors, JSON for the rest, never a pickle.

`trainer_state.safetensors` holds AdamW's moments and step count per parameter (keyed by parameter name, so the
state outlives the process and the number of processes) and every random generator's state: torch's CPU generator,
each CUDA device's, and the data sampler's. `trainer_state.json` holds the step, the schedule and the arguments, the
model config (a resume into another model is refused), the data position, the best validation loss, the grad
scaler's state, and the elapsed time. The weights are the model files beside them (`save_pretrained`'s layout).
Python's `random` and numpy's global generator are not used by the loop, so there is nothing of theirs to keep.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, UsageError
from ..files import atomic_write_text
from ..io.safetensors_io import SafetensorsFile, write_safetensors
from .args import TrainArgs, is_int, is_number

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
FORMAT = "gpt2_port.trainer_state/1"
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class TrainerState:
    step: int  # optimizer steps completed since the start of training
    model_config: dict[str, Any]  # the model's config.json (to_hf_dict), to refuse a resume into another model
    args: dict[str, Any]  # the training arguments of the run that saved it
    world_size: int
    batches_drawn: int
    best_val_loss: float | None = None
    best_step: int | None = None
    elapsed_s: float = 0.0
    tokens_seen: int = 0
    scaler: dict[str, Any] | None = None
    train_tokens: int | None = None  # the length of train.bin, to tell other data from moved data on a resume
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # optimizer moments and RNG states

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "tensors"}
        return {"format": FORMAT, **d}

    def check_steps(self, steps: int, source: str | os.PathLike[str]) -> None:
        """UsageError unless a run of `steps` steps can continue from this state (saved in `source`)."""
        if self.step > steps:
            raise UsageError(f"--steps {steps}: the run in {source} is already at step {self.step}")


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW's state by parameter name: optim.{name}.exp_avg / .exp_avg_sq / .step (steps as a (1,) tensor)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        st = optimizer.state.get(p)
        if not st:
            continue
        for k in MOMENTS:
            out[f"optim.{name}.{k}"] = st[k].detach()
        out[f"optim.{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).cpu()
    return out


def load_optimizer_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], source: Path
) -> None:
    """Put the saved moments back on each parameter (same names and shapes, or a CheckpointError naming the key), on
    the parameter's device whatever device they were saved from. The step count goes where torch's AdamW keeps it:
    beside the parameter for the fused (and capturable) kernels, which refuse a CPU step with a CUDA parameter,
    else a CPU scalar."""
    on_param: dict[int, bool] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            on_param[id(p)] = bool(group.get("fused") or group.get("capturable"))
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        keys = [f"optim.{name}.{k}" for k in (*MOMENTS, "step")]
        missing = [k for k in keys if k not in tensors]
        if len(missing) == 3:
            continue  # never stepped (no state yet)
        if missing:
            raise CheckpointError(f"{source}: {missing[0]} is missing (the optimizer state is incomplete)")
        st = {}
        for k in MOMENTS:
            t = tensors[f"optim.{name}.{k}"]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{source}: optim.{name}.{k} has shape {tuple(t.shape)}, the parameter {tuple(p.shape)}"
                )
            st[k] = torch.empty_like(p, memory_format=torch.preserve_format).copy_(t)
        step = tensors[f"optim.{name}.step"].reshape(()).to(torch.float32)
        st["step"] = step.to(p.device).clone() if on_param.get(id(p)) else step.cpu().clone()
        optimizer.state[p] = st


RNG_TORCH, RNG_DATA = "rng.torch_cpu", "rng.data"  # the generator states every trainer state holds (and restores)


def rng_tensors(data_state: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch's CPU and CUDA generator states, and the data sampler's (`GlobalBatchSampler.state()`)."""
    out = {RNG_TORCH: torch.get_rng_state(), RNG_DATA: data_state}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def restore_rng(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Restore torch's CPU and CUDA generators; return the data sampler's state (for `GlobalBatchSampler.restore`)."""
    torch.set_rng_state(tensors[RNG_TORCH])
    cuda_keys = [k for k in tensors if k.startswith("rng.cuda.")]
    cuda = [tensors[k] for k in sorted(cuda_keys, key=lambda k: int(k.rsplit(".", 1)[1]))]  # by device: 2 before 10
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    return tensors[RNG_DATA]


def save(state: TrainerState, directory: Path) -> None:
    """Write both files into `directory` (the caller renames the directory's files into place)."""
    entries = [(k, tuple(t.shape), t.dtype, lambda t=t: t.cpu()) for k, t in sorted(state.tensors.items())]
    write_safetensors(directory / STATE_TENSORS, entries, metadata={"format": FORMAT})
    atomic_write_text(directory / STATE_JSON, json.dumps(state.to_json(), indent=2) + "\n")


def _is_finite(v: object) -> bool:
    return is_number(v) and math.isfinite(v)


# Each field of trainer_state.json with its check and what it must be (None is allowed only where listed)
_FIELDS: dict[str, tuple[Any, str]] = {
    "step": (lambda v: is_int(v) and v >= 0, "a non-negative integer"),
    "model_config": (lambda v: isinstance(v, dict), "a JSON object"),
    "args": (lambda v: isinstance(v, dict), "a JSON object"),
    "world_size": (lambda v: is_int(v) and v >= 1, "a positive integer"),
    "batches_drawn": (lambda v: is_int(v) and v >= 0, "a non-negative integer"),
    "best_val_loss": (lambda v: v is None or _is_finite(v), "a finite number or null"),
    "best_step": (lambda v: v is None or (is_int(v) and v >= 0), "a non-negative integer or null"),
    "elapsed_s": (lambda v: _is_finite(v) and v >= 0, "a non-negative number"),
    "tokens_seen": (lambda v: is_int(v) and v >= 0, "a non-negative integer"),
    "scaler": (lambda v: v is None or isinstance(v, dict), "a JSON object or null"),
    "train_tokens": (lambda v: v is None or (is_int(v) and v >= 0), "a non-negative integer or null"),
}


def _check_fields(meta: dict[str, Any], source: Path) -> None:
    """CheckpointError naming the file and the key for a value of the wrong type or range (before any of it is
    used, so a bad state stops a resume before anything is written)."""
    for key, (ok, expected) in _FIELDS.items():
        if key in meta and not ok(meta[key]):
            raise CheckpointError(f"{source}: {key} must be {expected}, got {meta[key]!r}")
    if meta.get("best_step") is not None and meta["best_step"] > meta.get("step", 0):
        raise CheckpointError(f"{source}: best_step {meta['best_step']} is after step {meta.get('step')}")


def _check_args(saved: dict[str, Any], source: Path) -> None:
    """The saved training settings, each of the right type and range (the message names the key, not the flag)."""
    try:
        TrainArgs.from_saved(saved, str(source)).validate(str(source))
    except UsageError as e:
        raise CheckpointError(str(e)) from None


def _check_rng(tensors: dict[str, torch.Tensor], source: Path) -> None:
    for key in (RNG_TORCH, RNG_DATA):
        t = tensors.get(key)
        if t is None:
            raise CheckpointError(f"{source}: {key} is missing (expected a random generator's state)")
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise CheckpointError(
                f"{source}: {key} is {str(t.dtype).removeprefix('torch.')} of shape {tuple(t.shape)}, expected a "
                "generator's state (uint8, one dimension)"
            )


def load(directory: str | os.PathLike[str]) -> TrainerState:
    """The trainer state saved in `directory`, every field checked (CheckpointError naming the file and the key)."""
    d = Path(directory)
    jf, tf = d / STATE_JSON, d / STATE_TENSORS
    if not d.is_dir():
        raise CheckpointError(f"--resume {d}: not a directory (expected the --out of an earlier train run)")
    if not jf.is_file() or not tf.is_file():
        raise CheckpointError(
            f"--resume {d}: no {STATE_JSON} + {STATE_TENSORS} (expected the --out of an earlier train run)"
        )
    try:
        meta = json.loads(jf.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{jf}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{jf}: not a gpt2_port trainer state (expected format {FORMAT!r})")
    meta.pop("format")
    _check_fields(meta, jf)
    try:
        state = TrainerState(**meta)
    except TypeError as e:
        raise CheckpointError(f"{jf}: unexpected contents ({e})") from None
    _check_args(state.args, jf)
    with SafetensorsFile(tf) as st:
        state.tensors = {k: st.get(k).clone() for k in st.keys()}
    _check_rng(state.tensors, tf)
    return state
