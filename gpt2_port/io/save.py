"""Writing a state dict in the official layout, loadable by transformers' and gpt2_port's `from_pretrained`.

`config.json` (with the dropout and init fields); `model.safetensors` in the tensors' dtype, Conv1D weights as
[in, out], q/k/v fused back into `c_attn`, no mask buffers; tied head: un-prefixed keys and no `lm_head` (as
openai-community/gpt2 ships), untied: transformers' `save_pretrained` layout (`transformer.` prefix, `lm_head.weight`).
Tokenizer files (vocab.json, merges.txt) are copied beside the weights when given. Every file is written through
files.atomic_open; tensors are streamed one at a time, so a 6 GB checkpoint never holds a second copy in memory.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ..config import GPT2Config
from ..errors import UsageError
from ..files import atomic_write_bytes, atomic_write_text
from . import adapter
from .safetensors_io import write_safetensors

log = logging.getLogger(__name__)


def write_checkpoint(
    state: Mapping[str, torch.Tensor],
    cfg: GPT2Config,
    directory: str | os.PathLike[str],
    tokenizer_files: tuple[Path, Path] | None = None,
) -> Path:
    """Write the scratch `state` (every parameter, one dtype) as an official-layout checkpoint in `directory`."""
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory (save_pretrained writes a checkpoint directory)")
    out.mkdir(parents=True, exist_ok=True)
    prefix = "" if cfg.tie_word_embeddings else "transformer."
    tensors = adapter.hf_tensors(state, cfg, prefix)
    shapes = {k: tuple(make().shape) for k, make in tensors}  # views and small cats: cheap next to the write
    dtype = next(iter(state.values())).dtype

    def on_cpu(make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: make().cpu()

    entries = [(k, shapes[k], dtype, on_cpu(make)) for k, make in tensors]
    write_safetensors(out / "model.safetensors", entries, metadata={"format": "pt"})
    atomic_write_text(out / "config.json", json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    if tokenizer_files is not None:
        for name, f in zip(("vocab.json", "merges.txt"), tokenizer_files):
            if f.resolve() != (out / name).resolve():
                atomic_write_bytes(out / name, f.read_bytes())
    log.info("saved %s (%s parameters) to %s", cfg, f"{cfg.num_params():,}", out)
    return out
