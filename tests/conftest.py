"""Shared fixtures: tiny and full-size random checkpoints in both layouts, and the official tokenizer files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2_port.config import GPT2Config
from gpt2_port.io.demo import write_demo_checkpoint
from gpt2_port.io.safetensors_io import SafetensorsFile
from gpt2_port.model import GPT2

# Where there is no GPU, triton (pyproject's dev extra) runs its kernels in its interpreter, on the CPU: the tests of
# the decode step's GPU kernels (tests/test_gpu_kernels.py) run them so. Its own @triton.jit helpers (tl.sum...) read
# this when triton is first imported, so it is set before that, for this process and the commands it starts.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = (
    "NOT RUN: needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False); run "
    "`.venv/bin/python -m pytest -m cuda` on a machine with one"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` are reported NOT RUN, with the reason, where there is no GPU (never silently dropped)."""
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


def hide_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA for the rest of a test: torch.cuda.is_available() is False in this process, and the commands it starts
    see no device (CUDA_VISIBLE_DEVICES empty)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True)
def _cpu_unless_marked_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests not marked `cuda` are CPU tests on every machine. Where a GPU is, `--device auto` (generate's, eval's and
    parity's default) would move them onto it, against expectations made for the CPU; so they see none. The `cuda`
    tests have the GPU."""
    if request.node.get_closest_marker("cuda") is None and torch.cuda.is_available():
        hide_cuda(monkeypatch)


SHARED_TOKENIZER = REPO.parent / "shared" / "gpt2-tokenizer"

TINY = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128)


def chaotic_model(cfg: GPT2Config, seed: int) -> GPT2:
    """Random weights large enough that greedy text keeps changing (GPT-2's 0.02 init, untrained, repeats one token
    forever, which would make equality tests weak); LayerNorm gains around 1. Separate q/k/v (no fused c_attn)."""
    torch.manual_seed(seed)
    return chaotic_weights(GPT2(cfg))


def chaotic_weights(m: GPT2, generator: torch.Generator | None = None) -> GPT2:
    """m in eval mode, no gradients, its weights chaotic_model's (drawn from `generator`, else the global one), in
    place: a model in the official layout keeps q, k and v views of its one c_attn."""
    m = m.eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in m.named_parameters():
            base = 1.0 if "ln_" in name and name.endswith("weight") else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return m


def summed_in_order(sums: torch.Tensor) -> torch.Tensor:
    """(P, ...) partial sums added first to last, as norm_linear.py's kernels add a projection's partials."""
    total = sums[0]
    for part in sums[1:]:
        total = total + part
    return total


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """../shared/gpt2-tokenizer (encoder.json + vocab.bpe). CI has it beside the checkout; its absence is an error."""
    if not (SHARED_TOKENIZER / "encoder.json").is_file():
        raise FileNotFoundError(
            f"{SHARED_TOKENIZER} is missing: the tests need ../shared/gpt2-tokenizer beside the repo"
        )
    return SHARED_TOKENIZER


@pytest.fixture(scope="session")
def tiny_official(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A tiny random checkpoint in the exact official layout (no prefix, mask buffers, no lm_head), with tokenizer."""
    d = tmp_path_factory.mktemp("tiny_official")
    return write_demo_checkpoint(d, config=TINY, seed=1, tokenizer_dir=tokenizer_dir)


def weights(d: Path) -> dict[str, torch.Tensor]:
    """The tensors of d/model.safetensors, copied out of the file (a run may overwrite it)."""
    st = SafetensorsFile(d / "model.safetensors")
    return {k: st.get(k).clone() for k in st.keys()}


def save_hf(d: Path, cfg: GPT2Config, seed: int = 0, randomize: bool = True) -> Path:
    """A random checkpoint as transformers' save_pretrained writes it ('transformer.' prefix, no buffers)."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    hf_cfg = HFConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures",)})
    m = GPT2LMHeadModel(hf_cfg).eval()
    if randomize:  # transformers initialises biases to 0 and LN to 1; make every tensor matter
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("bias") or "ln_" in name:
                    p.add_(0.05 * torch.randn_like(p))
    m.save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    d = tmp_path_factory.mktemp("tiny_hf")
    save_hf(d, TINY, seed=2)
    for src, dst in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
        (d / dst).write_bytes((tokenizer_dir / src).read_bytes())
    return d


@pytest.fixture(scope="session")
def tiny_hf_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny_hf_untied")
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, tie_word_embeddings=False)
    save_hf(d, cfg, seed=3)
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is False
    return d


@pytest.fixture(scope="session")
def ckpt124(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A full-size 124M random checkpoint in the official layout (548 MB, written once per session)."""
    d = tmp_path_factory.mktemp("gpt2_124m")
    return write_demo_checkpoint(d, size="gpt2", seed=0, tokenizer_dir=tokenizer_dir)


def lowp_operands(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, 256), a (512, 256) weight and a (512,) bias in `dtype`, seeded by `rows`."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 256, generator=g), torch.randn(512, 256, generator=g), torch.randn(512, generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def decode_steps(model: GPT2, ids: torch.Tensor, mask: torch.Tensor | None, n: int, plan: bool) -> list[torch.Tensor]:
    """Prefill through forward, then n one-token steps (DecodePlan or forward), feeding back a fixed token pattern;
    each step's (B, 1, C) hidden state."""
    from gpt2_port.generate.cache import KVCache
    from gpt2_port.model.decode import DecodePlan

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


def greedy_heads() -> list:
    """The fast greedy heads as test parameters: the screened one reported NOT RUN, with the reason, where oneDNN has
    no packed bf16 kernel (the transposed one is then what generate uses)."""
    from gpt2_port.generate.greedy_head import ScreenedHead, TransposedHead

    no_bf16 = pytest.mark.skipif(
        not ScreenedHead.available(),
        reason="NOT RUN: ScreenedHead needs oneDNN's packed bf16 kernel (AVX512-BF16 or AMX, and ONEDNN_MAX_CPU_ISA "
        "not holding oneDNN below them); this machine or configuration has none, so generate uses TransposedHead",
    )
    return [pytest.param(TransposedHead, id="transposed"), pytest.param(ScreenedHead, marks=no_bf16, id="screened")]


# The draw's own rounding, in log terms: it takes the argmax of softmax(s) / q in float32, where s - log q is exact
# arithmetic's; the softmax and the division each move a ratio by a few units of 2^-24 (worst bound ~5e-7), taken x20.
DRAW_ROUNDING = 1e-5


def hf_greedy(hf_model, ids: torch.Tensor, mask: torch.Tensor | None, n: int, **kw):  # noqa: ANN001, ANN003, ANN201
    """transformers' greedy generate of n new tokens (a mask of ones by default, pad id 50256), with each step's
    scores (`output_scores`, `return_dict_in_generate`)."""
    mask = torch.ones_like(ids) if mask is None else mask
    kw = {"pad_token_id": 50256, **kw}
    return hf_model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **kw,
    )


def norm_ulps(
    y: torch.Tensor, s: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float
) -> tuple[float, float, float]:
    """A layer norm `y` of the rounded residual sum `s` (weight w, bias b) against torch's: the largest distance from
    torch's `F.layer_norm(s)`, and ours and torch's largest from float64's, each in ulps of the dtype at the size of
    the value's larger term (|w * normed| or |b|: where the two nearly cancel, y is small and its own ulp says nothing
    of the error)."""
    want = F.layer_norm(s, s.shape[-1:], w, b, eps)
    normed = F.layer_norm(s.double(), s.shape[-1:], eps=eps)
    truth = normed * w.double() + b.double()
    t = (normed * w.double()).abs().maximum(b.double().abs()).to(s.dtype)
    ulp = (torch.nextafter(t, torch.full_like(t, float("inf"))) - t).double()
    apart = ((y.double() - want.double()).abs() / ulp).max().item()
    return apart, ((y.double() - truth).abs() / ulp).max().item(), ((want.double() - truth).abs() / ulp).max().item()


def attention_inputs(dtype: torch.dtype, hs: int, L: int = 130, seed: int = 0) -> tuple:
    """q and kv as LayerStep makes them (views of one (B, 1, 3C) c_attn output), a layer's cache of L slots (130: two
    blocks of 64 and a part), its additive mask (row 0 left-padded past the first block, so a block all masked comes
    first; row 1 seeing every slot up to the token's), and the token's slot."""
    B, nh = 2, 3
    C = nh * hs
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, 1, 3 * C, generator=g).to(dtype)
    q = qkv[..., :C].view(B, 1, nh, hs).transpose(1, 2)  # (B, nh, 1, hs)
    kv = qkv[..., C:].view(B, 1, 2, nh, hs).permute(2, 0, 3, 1, 4)  # (2, B, nh, 1, hs)
    layer = torch.randn(2, B, nh, L, hs, generator=g).to(dtype)
    slot = torch.tensor([L - 10])
    bias = torch.full((B, L), float("-inf"))
    bias[0, 70 : L - 9] = 0.0
    bias[1, : L - 9] = 0.0
    return q, kv, layer, bias.to(dtype), slot


def same_tokens_where_decided(
    ref: torch.Tensor,
    ref_scores: list[torch.Tensor],
    got: torch.Tensor,
    got_scores: list[torch.Tensor],
    tol: float,
    noise: list[torch.Tensor] | None = None,
    eos: int | None = None,
) -> list[int]:
    """The contract of two token sequences made by paths whose scores differ by rounding (another shape, cache, dtype
    or library): the scores within `tol` of their largest |score| at each step (the paths compute the same function),
    and the tokens equal wherever that decides them. (B, n) new tokens of each, and per step the (B, V) scores each
    token was chosen from (`Generation.scores`, transformers' `output_scores`); noise: a sampled run's Exp(1) draws per
    step (the token is then the argmax of s - log q: `sampling.draw`; no top-k or top-p, which could mask other
    tokens on each side); eos: a row's comparison ends with its EOS token (padding follows).

    At a step where the scores lie within d of each other at every token and the reference's top token leads the next
    by more than 2 d, both paths choose that token, so the tokens must be equal there; where the lead is smaller (a
    near tie) the paths may part, and the row's comparison ends at the first token they do not share (what follows
    depends on the prefix). The reference's tokens are checked to be its scores' choice, so the scores are the ones
    the tokens came from. Returns per row the number of steps compared."""
    compared = []
    for r in range(ref.shape[0]):
        n = 0
        for t in range(min(ref.shape[1], got.shape[1], len(ref_scores), len(got_scores))):
            a, b = ref_scores[t][r].double(), got_scores[t][r].double()
            d = float(torch.where(a == b, 0.0, (a - b).abs()).max())  # equal infinities (masked tokens) count 0
            scale = float(a[a.isfinite()].abs().max())
            what = f"row {r} step {t}: scores {d:.3g} apart, above {tol:g} of their largest {scale:.3g}"
            assert d <= tol * scale, what
            slack = 0.0
            if noise is not None:
                log_q = noise[t][r].double().log()
                a, slack = a - log_q, DRAW_ROUNDING
            top = torch.topk(a, 2).values
            lead = float(top[0] - top[1])
            assert not (lead > slack and int(ref[r, t]) != int(a.argmax())), f"row {r} step {t}: not its scores' choice"
            if int(ref[r, t]) != int(got[r, t]):
                assert not (lead > 2 * d + slack), (
                    f"row {r} step {t}: tokens {int(ref[r, t])} and {int(got[r, t])} differ, but the lead {lead:.3g} "
                    f"exceeds twice the scores' distance {d:.3g}"
                )
                break
            n += 1
            if eos is not None and int(ref[r, t]) == eos:
                break
        compared.append(n)
    return compared


def exp_draws(seed: int, shape: tuple[int, int], steps: int) -> list[torch.Tensor]:
    """The Exp(1) noise a sampled generation seeded with `seed` draws at each step (`sampling.draw`, on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.empty(shape).exponential_(1, generator=g) for _ in range(steps)]


class OpNames(TorchDispatchMode):
    """The aten ops dispatched while it is active, by name (`mul`, `_fused_adamw_`, ...), in order, in `seen`."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class LowPrecisionProducts(TorchDispatchMode):
    """Counts the matrix products run with a bf16/fp16 operand (mm, addmm, bmm, their out= forms) in `count`, and
    the CPU SDPA kernel's forward and backward calls with one in `attention` (SDPA's math kernel, taken with dropout,
    shows as its products)."""

    PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmm_")
    ATTENTION = (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's signature)
        name = func._schema.name
        if name in self.PRODUCTS + self.ATTENTION and any(
            isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) for a in args
        ):
            if name in self.ATTENTION:
                self.attention += 1
            else:
                self.count += 1
        return func(*args, **(kwargs or {}))
