"""Random-weight GPT-2 checkpoints in the exact official layout (torch and safetensors only).

`config.json` + `model.safetensors` with un-prefixed keys, a float32 causal-mask buffer `h.{i}.attn.bias`
`[1, 1, n_positions, n_positions]` per layer, no `lm_head.weight`, and metadata `{"format": "pt"}`: the layout of
`openai-community/gpt2*`. Tensors are generated one at a time from a seed and streamed to disk, so even gpt2-xl
(6.4 GB) is written without holding the model in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..config import GPT2Config, preset
from ..errors import UsageError
from ..files import atomic_write_bytes, atomic_write_text
from .adapter import hf_shapes
from .safetensors_io import write_safetensors

# The two tokenizer files OpenAI published with GPT-2, and their sha256 (the hashes tiktoken checks).
TOKENIZER_FILES = {
    # snapshot name: (OpenAI's name, sha256)
    "vocab.json": ("encoder.json", "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "merges.txt": ("vocab.bpe", "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}


def _tensor_maker(key: str, shape: tuple[int, ...], cfg: GPT2Config, seed: int):
    """A deterministic random tensor per key (seeded by the key's name), initialised like GPT-2.

    Matrices and `wte` follow the package's init rule (GPT2Config.init_std: N(0, initializer_range), the
    residual projections `c_proj.weight` scaled by 1/sqrt(2 n_layer)). Deliberately different, so that a parity
    check exercises every parameter: LayerNorm gains 1 + N(0, 0.1) rather than 1, biases N(0, 0.02) rather than 0,
    and `wpe` N(0, 0.01), as OpenAI's original TensorFlow code initialised it (transformers uses 0.02).
    """

    def make() -> torch.Tensor:
        # modulo 2**64, the generator's range: small seeds keep their weights, and distinct seeds stay distinct
        mixed = (seed * 1_000_003 + int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)) % (1 << 64)
        g = torch.Generator().manual_seed(mixed)
        if key.endswith("attn.bias") and len(shape) == 4:
            n = shape[-1]
            return torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        if key.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            return 1.0 + 0.1 * torch.randn(shape, generator=g)  # not exactly 1, so the scale is exercised
        if key.endswith(".bias"):
            return 0.02 * torch.randn(shape, generator=g)  # not 0, so the shift is exercised
        std = 0.01 if key == "wpe.weight" else cfg.init_std(key)
        return std * torch.randn(shape, generator=g)

    return make


def write_demo_checkpoint(
    out_dir: str | os.PathLike[str],
    size: str = "gpt2",
    seed: int = 0,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    config: GPT2Config | None = None,
) -> Path:
    """Write a random-weight checkpoint of preset `size` (or `config`) in the official layout; return its directory."""
    cfg = config if config is not None else preset(size)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    shapes = dict(hf_shapes(cfg))
    for i in range(cfg.n_layer):
        shapes[f"h.{i}.attn.bias"] = (1, 1, cfg.n_positions, cfg.n_positions)
    entries = [(k, s, torch.float32, _tensor_maker(k, s, cfg, seed)) for k, s in sorted(shapes.items())]
    write_safetensors(out / "model.safetensors", entries, metadata={"format": "pt"})
    atomic_write_text(out / "config.json", json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer(tokenizer_dir, out)
    return out


def copy_tokenizer(src: str | os.PathLike[str], dst: Path) -> None:
    """Copy GPT-2's vocab.json/merges.txt (or OpenAI's encoder.json/vocab.bpe) into dst, checking their sha256."""
    src = Path(src)
    for snap_name, (openai_name, sha) in TOKENIZER_FILES.items():
        f = src / snap_name if (src / snap_name).is_file() else src / openai_name
        if not f.is_file():
            raise UsageError(f"--tokenizer-from {src}: neither {snap_name} nor {openai_name} found")
        data = f.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha:
            raise UsageError(f"{f}: sha256 {digest[:12]}... is not that of GPT-2's {snap_name} ({sha[:12]}...)")
        atomic_write_bytes(dst / snap_name, data)
