"""Build a GPT2 from a checkpoint: locate its files (checkpoint.py, hub.py), convert them (adapter.py), fill the model.

The model is built on the meta device and filled with `load_state_dict(assign=True)` from memory-mapped tensors,
so a float32 load peaks at about one copy of the weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import adapter
from .checkpoint import Checkpoint, LazyStateDict, locate
from .config import GPT2Config, check_against_shapes, infer_from_shapes, read_config_json
from .devices import parse_device, parse_dtype
from .errors import CheckpointError, ConfigError, UsageError
from .model import GPT2
from .safetensors_io import write_safetensors
from .tokenizer import find_files
from .util import atomic_write_bytes, atomic_write_text

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
    # The model holds the tensors now. The report keeps no reference to them, or the file's mapping would outlive
    # parameters replaced later (a training run gives each its own memory): a second copy of the weights in the RSS.
    report.conversion.state = {}
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


def save_pretrained(
    model: GPT2,
    directory: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write `model` in the official layout, loadable by transformers' and gpt2_port's `from_pretrained`.

    `config.json` (with the dropout and init fields); `model.safetensors` in float32 or the model's dtype, Conv1D
    weights as [in, out], q/k/v fused back into `c_attn`, no mask buffers; tied head: un-prefixed keys and no
    `lm_head` (as openai-community/gpt2 ships), untied: transformers' `save_pretrained` layout (`transformer.`
    prefix, `lm_head.weight`). Tokenizer files (vocab.json, merges.txt) are copied beside the weights from
    `tokenizer_dir`, else from the checkpoint the model was loaded from, when either has them. Every file is written
    atomically; tensors are streamed one at a time.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory (save_pretrained writes a checkpoint directory)")
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    prefix = "" if cfg.tie_word_embeddings else "transformer."
    state = {k: v for k, v in model.state_dict().items()}
    tensors = adapter.hf_tensors(state, cfg, prefix)
    shapes = {k: tuple(make().shape) for k, make in tensors}  # views and small cats: cheap next to the write

    def on_cpu(make):  # noqa: ANN001, ANN202
        return lambda: make().cpu()

    entries = [(k, shapes[k], model.dtype, on_cpu(make)) for k, make in tensors]
    write_safetensors(out / "model.safetensors", entries, metadata={"format": "pt"})
    atomic_write_text(out / "config.json", json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    src = _tokenizer_source(model, tokenizer_dir)
    if src is not None:
        for name, f in zip(("vocab.json", "merges.txt"), src):
            if f.resolve() != (out / name).resolve():
                atomic_write_bytes(out / name, f.read_bytes())
    log.info("saved %s (%s params) to %s", cfg, f"{model.num_params():,}", out)
    return out


def _tokenizer_source(model: GPT2, tokenizer_dir: str | os.PathLike[str] | None) -> tuple[Path, Path] | None:
    if tokenizer_dir is not None:
        d = Path(tokenizer_dir)
        found = find_files(d)
        if found is not None:
            return found
        raise UsageError(f"tokenizer directory {d}: no vocab.json + merges.txt (or encoder.json + vocab.bpe)")
    report = getattr(model, "load_report", None)
    return None if report is None else report.checkpoint.tokenizer_files()
