"""MFU's parts (train/throughput.py): the FLOPs per token and the device's peak, looked up by its name."""

from __future__ import annotations

import pytest
import torch

from gpt2_port.config import PRESETS
from gpt2_port.model.gpt2 import GPT2
from gpt2_port.train import throughput


def test_flops_per_token_counts_the_multiplied_weights_and_attention() -> None:
    cfg = PRESETS["gpt2"]
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT2(cfg).parameters()) - cfg.n_positions * cfg.n_embd  # wpe is added only
    assert throughput.flops_per_token(cfg, 1024) == 6 * n + 12 * 12 * 768 * 1024
    assert 6 * 123e6 < throughput.flops_per_token(cfg, 1024) < 6 * 125e6 + 12 * 12 * 768 * 1024


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H100 NVL", "fp16", 835.0),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA H200 NVL", "float32", 417.5),  # TF32 on, as train runs float32 on CUDA
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA L40", "bf16", 181.0),  # not the L4's, whose name it contains
        ("NVIDIA L40S", "bf16", 362.1),
        ("NVIDIA L4", "bf16", 121.0),
    ],
)
def test_the_peak_is_the_most_specific_entry_for_the_device(monkeypatch, name: str, dtype: str, tflops: float):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, what = throughput.peak_flops(torch.device("cuda"), dtype, tf32=True)
    assert peak == tflops * 1e12 and name in what


def test_a_ddp_runs_peak_counts_every_process(monkeypatch) -> None:
    """tokens/s of a DDP run is the global batch's: measured against every process's device, MFU stays per device."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    one, _ = throughput.peak_flops(torch.device("cuda"), "bf16", tf32=True)
    eight, what = throughput.peak_flops(torch.device("cuda"), "bf16", tf32=True, processes=8)
    assert eight == 8 * one and what.startswith("8 x NVIDIA H100")
    assert throughput.mfu(8 * 400_000.0, 1_000, eight) == throughput.mfu(400_000.0, 1_000, one)


def test_every_entry_comes_before_the_entries_its_name_contains() -> None:
    keys = [k for k, _ in throughput.PEAK_TFLOPS]
    for i, k in enumerate(keys):
        assert not any(other in k for other in keys[:i]), f"{k} is shadowed by an earlier, shorter entry"


def test_no_peak_off_cuda_or_for_an_unknown_device(monkeypatch) -> None:
    assert throughput.peak_flops(torch.device("cpu"), "bf16", tf32=True) == (None, "no peak known for cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU 9000")
    assert throughput.peak_flops(torch.device("cuda"), "bf16", tf32=True) == (None, "no peak known for Some GPU 9000")
    assert throughput.mfu(100.0, 10, None) is None and throughput.mfu(100.0, 10, 4000.0) == 0.25
