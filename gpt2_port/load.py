"""Build a GPT2 from a checkpoint: locate its files (checkpoint.py, hub.py), convert them (adapter.py), fill the model.

The model is built on the meta device and filled with `load_state_dict(assign=True)` from memory-mapped tensors,
so a float32 load peaks at about one copy of the weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from . import adapter
from .checkpoint import Checkpoint, LazyStateDict, locate
from .config import GPT2Config, check_against_shapes, infer_from_shapes, read_config_json
from .devices import parse_device, parse_dtype
from .errors import CheckpointError, ConfigError
from .model import GPT2

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


def convert_checkpoint(model: str | os.PathLike[str], revision: str | None = None) -> tuple[LazyStateDict, LoadReport]:
    """Locate, read and convert a checkpoint without building a model (what `inspect` shows)."""
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
    """Names of tensors holding NaN or Inf."""
    return [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Skip torch's random init while the model is built on meta (every tensor is then replaced by the checkpoint's).

    On meta, nn.Embedding's normal_ goes through torch._refs and imports torch._dynamo: seconds of a cold load.
    """
    names = ("normal_", "uniform_", "kaiming_uniform_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda t, *args, **kwargs: t)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def from_pretrained(
    model: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    revision: str | None = None,
    check_finite: bool = False,
) -> tuple[GPT2, LoadReport]:
    t0 = time.perf_counter()
    dt = parse_dtype(dtype)
    dev = parse_device(device)
    sd, report = convert_checkpoint(model, revision)
    cfg, state = report.config, report.conversion.state
    sd.release(report.conversion.dropped)  # checked and discarded (mask buffers): out of the RSS, 4 MB per layer
    sd.prefetch(k for k in sd if k not in report.conversion.dropped)  # cold cache: one sequential read, not faults
    if check_finite:
        report.nonfinite = nonfinite_tensors(state)
    with torch.device("meta"), _no_random_init():
        m = GPT2(cfg)
    if any(t.dtype != dt for t in state.values()) or dev.type != "cpu":
        state = {k: t.to(device=dev, dtype=dt) for k, t in state.items()}
    m.load_state_dict(state, strict=True, assign=True)
    m.eval().requires_grad_(False)
    report.load_s = time.perf_counter() - t0
    log.info(
        "loaded %s (%s layers, %s params) as %s on %s in %.2fs",
        model,
        cfg.n_layer,
        f"{m.num_params():,}",
        dt,
        dev,
        report.load_s,
    )
    return m, report
