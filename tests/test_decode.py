"""DecodePlan: one-token steps without module dispatch give bit-identical hidden states to the forward pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, chaotic_model

from gpt2_port.decode import DecodePlan
from gpt2_port.generate import generate_full
from gpt2_port.kv_cache import KVCache
from gpt2_port.load import from_pretrained
from gpt2_port.model import GPT2, fused_qkv
from gpt2_port.quantize import quantize_int8


def _chaotic(seed: int = 3) -> GPT2:
    return chaotic_model(TINY, seed)


@pytest.fixture(scope="module")
def official(tiny_official: Path) -> GPT2:
    m, _ = from_pretrained(tiny_official)
    a = m.h[0].attn
    assert fused_qkv(a.q_proj, a.k_proj, a.v_proj) is not None  # the plan's one-matmul c_attn path
    return m


def _steps(model: GPT2, ids: torch.Tensor, mask: torch.Tensor | None, n: int, plan: bool) -> list[torch.Tensor]:
    """Prefill through forward, then n one-token steps (plan or forward), feeding back a fixed token pattern."""
    B, T = ids.shape
    cache = KVCache(model.config, B, T + n, model.dtype, "cpu")
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, hidden_only=True)
        p = DecodePlan.for_model(model) if plan else None
        out = []
        for i in range(n):
            tok = ((ids[:, -1:] * 7 + 13 * i) % model.config.vocab_size).contiguous()  # (B, 1)
            m = None if mask is None else torch.cat([mask, torch.ones(B, i + 1, dtype=mask.dtype)], dim=1)
            if p is not None:
                out.append(p.step(tok, cache, m))
            else:
                out.append(model(tok, attention_mask=m, cache=cache, hidden_only=True))
    return out


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "left-padded"])
@pytest.mark.parametrize("which", ["official", "chaotic"])
def test_plan_steps_are_bit_identical_to_forward(which: str, padded: bool, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue("official") if which == "official" else _chaotic()
    ids = torch.tensor([[5, 6, 7, 8, 9], [50, 40, 30, 20, 10]]) % model.config.vocab_size
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]) if padded else None
    fast = _steps(model, ids, mask, 12, plan=True)
    slow = _steps(model, ids, mask, 12, plan=False)
    assert len({tuple(h[0, 0, :4].tolist()) for h in slow}) == 12  # the steps do differ
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert a.shape == b.shape == (2, 1, model.config.n_embd)
        assert torch.equal(a, b), f"step {i}: max diff {(a - b).abs().max().item():.3e}"


def test_plan_is_not_used_where_forward_must_run(official: GPT2) -> None:
    assert DecodePlan.for_model(official) is not None
    official.set_attn_impl("manual")
    try:
        assert DecodePlan.for_model(official) is None
    finally:
        official.set_attn_impl("sdpa")
    with official.record(["ln_f"]):
        assert DecodePlan.for_model(official) is None


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generate_with_and_without_the_plan(sample: bool) -> None:
    model = _chaotic()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    kw = dict(do_sample=sample, top_k=20, seed=5, eos_token_id=None) if sample else dict(eos_token_id=None)
    a = generate_full(model, ids, 40, **kw)
    b = generate_full(model, ids, 40, fast_step=False, **kw)
    assert a.extra["fast_step"] and not b.extra["fast_step"]
    assert a.sequences.tolist() == b.sequences.tolist()
    assert len(set(a.sequences[0, 3:].tolist())) > 5


def test_plan_calls_replaced_linears_as_modules(tiny_official: Path) -> None:
    model, _ = from_pretrained(tiny_official)
    quantize_int8(model)
    ids = torch.tensor([[3, 1, 4, 1, 5]]) % model.config.vocab_size
    fast = _steps(model, ids, None, 6, plan=True)
    slow = _steps(model, ids, None, 6, plan=False)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_plan_refuses_to_pass_the_context() -> None:
    model = _chaotic()
    cache = KVCache(model.config, 1, 128, model.dtype, "cpu")
    cache.length = 128
    with pytest.raises(ValueError, match="exceeds the context of 128"):
        DecodePlan(model).step(torch.tensor([[1]]), cache)
