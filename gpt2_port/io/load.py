"""Reading a checkpoint into what the model is built from: its config and its tensors in the scratch layout.

`read_checkpoint` locates the files (checkpoint.py, hub.py), reads the config and converts every tensor through the
adapter without copying (memory-mapped views); `read_state` then brings the tensors to the dtype and device asked
for, each checkpoint tensor once, so that q, k and v stay views of one c_attn tensor wherever they land (one matmul
where transformers runs one, on any device). Building the module itself (meta device + `assign=True`) is
`GPT2.from_pretrained`'s job; nothing here imports the model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from ..config import GPT2Config, check_against_shapes, infer_from_shapes, read_config_json
from ..devices import parse_device, parse_dtype
from ..errors import CheckpointError, ConfigError, UsageError
from . import adapter
from .checkpoint import Checkpoint, LazyStateDict, locate

log = logging.getLogger(__name__)


def read_config(ckpt: Checkpoint, sd: LazyStateDict) -> GPT2Config:
    if ckpt.config_file is not None:
        return read_config_json(ckpt.config_file)
    log.info("%s: no config.json; inferring the config from tensor shapes", ckpt.source)
    return infer_from_shapes(sd.shapes())


@dataclass
class LoadReport:
    """What a load did: for `inspect`, the CLI's timing line, and the checker."""

    checkpoint: Checkpoint
    config: GPT2Config
    conversion: adapter.Conversion
    file_bytes: int
    load_s: float = 0.0
    nonfinite: list[str] = field(default_factory=list)


def read_checkpoint(model: str | os.PathLike[str], revision: str | None = None) -> tuple[LazyStateDict, LoadReport]:
    """Locate, read and convert a checkpoint (memory-mapped views, nothing copied): what `inspect` shows."""
    ckpt = locate(model, revision)
    sd = LazyStateDict(ckpt)
    cfg = read_config(ckpt, sd)
    if ckpt.config_file is not None:  # names the config.json key the weights contradict (and bounds n_layer)
        check_against_shapes(cfg, sd.shapes(), source=str(ckpt.config_file))
    try:
        conv = adapter.hf_to_scratch(sd, cfg)
    except (CheckpointError, ConfigError) as e:
        where = ckpt.weight_files[0] if len(ckpt.weight_files) == 1 else ckpt.root
        hint = ""
        if ckpt.config_file is not None and "expected shape" in str(e):
            hint = (
                f" (shapes expected from {ckpt.config_file.name}: n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
                f"n_positions={cfg.n_positions}, vocab_size={cfg.vocab_size})"
            )
        raise type(e)(f"{where}: {e}{hint}") from None
    return sd, LoadReport(ckpt, cfg, conv, sd.nbytes())


def nonfinite_tensors(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of tensors holding NaN or Inf (one host sync per tensor: for error messages and checks, not hot loops)."""
    return [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def listed(names: Sequence[str], most: int = 8) -> str:
    """The first `most` names, comma-separated, and how many more."""
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


Layout = Literal["auto", "checkpoint", "contiguous"]
LAYOUTS = get_args(Layout)


def contiguous_layout(layout: Layout, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the weights get [out, in] contiguous copies (q, k and v the row blocks of one [3C, C] copy of c_attn,
    so that inference keeps its one matmul) instead of views of the checkpoint's [in, out] tensors. "auto": only for
    bfloat16/float16 on the CPU, where torch's matmul on the transposed view runs 13-20x slower than on a contiguous
    weight (2-core AVX2, torch 2.13: a (768 -> 3072) bf16 linear of one token takes 5.7 ms on the view, 0.34 ms
    contiguous; float32 takes 0.43 ms on either; BENCHMARKS.md, "bfloat16 decode on the CPU"). "checkpoint" keeps
    the views (the parity checker: the same calls as transformers' Conv1D)."""
    if layout not in LAYOUTS:
        raise UsageError(f"layout {layout!r}: expected one of {', '.join(map(repr, LAYOUTS))}")
    if layout == "auto":
        return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    return layout == "contiguous"


def read_state(
    model: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    revision: str | None = None,
    check_finite: bool = False,
    layout: Layout = "auto",
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """The scratch state dict of a checkpoint in `dtype` on `device`, and the report of the load.

    On the CPU in the file's dtype the tensors are views of the memory-mapped file (a float32 load peaks at about one
    copy of the weights). Otherwise each checkpoint tensor is converted once and the adapter's views are taken of the
    result, so the three projections split from c_attn still share its storage (with a contiguous layout, as row
    blocks of one contiguous [3C, C] copy, every other weight its own contiguous copy: `contiguous_layout`).
    """
    dt, dev = parse_dtype(dtype), parse_device(device)
    contiguous = contiguous_layout(layout, dt, dev)  # an unknown layout is refused before the read (or a download)
    sd, report = read_checkpoint(model, revision)
    conv = report.conversion
    sd.release(conv.dropped)  # checked and discarded (mask buffers): out of the RSS, 4 MB per layer
    sd.prefetch(k for k in sd if k not in conv.dropped)  # cold cache: one sequential read, not page faults
    if check_finite:
        report.nonfinite = nonfinite_tensors(conv.state)
    state = conv.state
    if contiguous or dev.type != "cpu" or any(t.dtype != dt for t in state.values()):
        move = lambda t: t.to(device=dev, dtype=dt)  # noqa: E731
        state = adapter.convert_sources(conv, sd, report.config, move, contiguous)
    # The model will hold the tensors. The report keeps no reference to them, or the file's mapping would outlive
    # parameters replaced later (a training run gives each its own memory): a second copy of the weights in the RSS.
    conv.state = {}
    return state, report
