"""Which SDPA kernel a forward ran, as `gpt2-port train` names it in its first lines (model/attention_kernel.py)."""

from __future__ import annotations

import torch
from conftest import TINY

from gpt2_port.model import GPT2
from gpt2_port.model.attention_kernel import attention_kernels

CPU = torch.device("cpu")


def test_the_cpu_flash_kernel_the_math_kernel_under_dropout_and_none_for_the_hand_written_attention() -> None:
    """Without dropout the CPU's flash kernel runs; with dropout in train mode SDPA runs its composite math kernel,
    which no dispatch mode sees as one op (it was reported as no SDPA call at all, "hand-written"); the manual
    attention calls no SDPA. The random generators are left as they were."""
    model = GPT2(TINY.with_dropout(0.1)).init_weights(0).eval()
    ids = torch.zeros(1, 16, dtype=torch.long)
    forward = lambda: model(ids, hidden_only=True)  # noqa: E731
    assert attention_kernels(forward, CPU) == ["flash (CPU)"]  # eval mode: no dropout
    model.train()
    state = torch.get_rng_state()
    assert attention_kernels(forward, CPU) == ["math"]
    assert torch.equal(torch.get_rng_state(), state)
    model.set_dropout(0.0)
    assert attention_kernels(forward, CPU) == ["flash (CPU)"]
    model.set_attn_impl("manual")
    assert attention_kernels(forward, CPU) == []


def test_a_probe_runs_with_gradients_off_unless_asked_as_a_training_step_runs() -> None:
    seen = []
    probe = lambda: seen.append(torch.is_grad_enabled())  # noqa: E731
    assert attention_kernels(probe, CPU) == [] and attention_kernels(probe, CPU, grad=True) == []
    with torch.no_grad():
        attention_kernels(probe, CPU, grad=True)
    assert seen == [False, True, True]
