"""Model FLOPs utilisation: the training FLOPs a token costs, against the named device's peak for the dtype.

FLOPs per token, as nanoGPT's `estimate_mfu` and PaLM's appendix B count them: 6N for the matmuls of the forward and
backward passes over the N parameters that multiply (every parameter but the position embeddings, which are only
added; the tied head is wte's matmul), plus 12 * n_layer * n_embd * T for attention's scores and weighted sums over
a window of T tokens. The peaks are the dense tensor-core figures of each vendor's datasheet (no sparsity);
float32 counts at the TF32 peak when TF32 matmuls are on, else at the plain float32 peak. A device not in the table
has no peak, and MFU is then reported as None rather than guessed.
"""

from __future__ import annotations

import torch

from ..config import GPT2Config

# (substring of torch.cuda.get_device_name(), {"bf16", "fp16", "tf32", "fp32"} -> TFLOP/s), most specific first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200 NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM5
    ("H800", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),  # before "L4", which it contains
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
]


def flops_per_token(cfg: GPT2Config, block_size: int) -> int:
    """Training FLOPs (forward and backward) per token at window length `block_size`."""
    n = cfg.num_params() - cfg.n_positions * cfg.n_embd  # position embeddings are added, not multiplied
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * block_size


def peak_flops(device: torch.device, dtype: str, tf32: bool, processes: int = 1) -> tuple[float | None, str]:
    """(peak FLOP/s for training in `dtype` ("float32", "bf16", "fp16") of `processes` devices like `device`, one
    each (a DDP run's global tokens/s is measured against all of them), what it is), or (None, why)."""
    if device.type != "cuda":
        return None, f"no peak known for {device.type}"
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            kind = {"bf16": "bf16", "fp16": "fp16"}.get(dtype, "tf32" if tf32 else "fp32")
            what = f"{name} {kind} dense peak {peaks[kind]:g} TFLOP/s"
            return peaks[kind] * 1e12 * processes, what if processes == 1 else f"{processes} x {what}"
    return None, f"no peak known for {name}"


def mfu(tokens_per_s: float, per_token: int, peak: float | None) -> float | None:
    """The share of the peak that tokens_per_s of training reaches (None without a peak)."""
    return None if peak is None else tokens_per_s * per_token / peak
