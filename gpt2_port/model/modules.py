"""GPT-2's modules, written from scratch: LayerNorm, causal self-attention with separate q/k/v, the tanh-GELU MLP and
the pre-LN block (`x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`).

Module names follow Hugging Face (`ln_1`, `attn`, `mlp.c_fc`, `c_proj`) so that per-layer activations line up with
the reference. Dropout sits at transformers' sites (attention probabilities, attention output, MLP output) and is
active in train mode only. Named taps expose every intermediate to `record` and `edit` (taps.py); with nothing
recording or editing, a tap is one `is None` test and no name is built. q, k and v are computed as c_attn computes
them (c_attn.py). Shapes: B batch, T new tokens, S keys (past + new), C n_embd, nh heads, hs head size.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GPT2Config
from .c_attn import fused_qkv, project_qkv, qkv_tied, tie_qkv
from .fused import gelu_tanh
from .lowp import attention, linear
from .masks import causal
from .taps import MANUAL_ATTENTION_POINTS, Taps

AttnImpl = Literal["sdpa", "manual"]
Kernels = Literal["reference", "fast"]


class Cache(Protocol):
    """What attention asks of a key/value cache (generate/cache.py's KVCache is one)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., C) -> (..., C)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written as OpenAI (and transformers' `gelu_new`) write it, op for op."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def wants_grad(m: nn.Module) -> bool:
    """True in train mode, or when autograd is recording and a parameter needs a gradient: no inference shortcuts."""
    return m.training or (torch.is_grad_enabled() and any(p.requires_grad for p in m.parameters()))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int, taps: Taps) -> None:
        super().__init__()
        e = cfg.n_embd
        self.q_proj = nn.Linear(e, e)
        self.k_proj = nn.Linear(e, e)
        self.v_proj = nn.Linear(e, e)
        self.c_proj = nn.Linear(e, e)
        self.attn_dropout = nn.Dropout(cfg.attn_pdrop)
        self.resid_dropout = nn.Dropout(cfg.resid_pdrop)
        self.n_head, self.head_dim, self.layer = cfg.n_head, cfg.head_dim, layer
        self.impl: AttnImpl = "sdpa"
        self.taps, self.tag = taps, f"block.{layer}.attn"
        self.manual_points = tuple(f"block.{layer}.{p}" for p in MANUAL_ATTENTION_POINTS)  # sdpa never forms them

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        """A move or cast (`.to`, `.cuda`, `.half`, ...) converts each parameter on its own, which would leave q, k
        and v three tensors: when they were views of one c_attn before, they are made views of one again (inference
        then keeps c_attn's one matmul, the reference's arithmetic)."""
        tied = qkv_tied(self.q_proj, self.k_proj, self.v_proj)
        out = super()._apply(fn, recurse)
        if tied is not None and qkv_tied(self.q_proj, self.k_proj, self.v_proj) != tied:
            tie_qkv(self.q_proj, self.k_proj, self.v_proj, tied)
        fused_qkv(self.q_proj, self.k_proj, self.v_proj)  # the view it keeps now of the new tensors, not the old ones
        return out

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, nh, T, hs)
        B, T, _ = t.shape
        return t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) -> q, k, v (B, T, C) each, through c_attn's arithmetic: one (B*T, C) @ (C, 3C) matmul."""
        return project_qkv(x, self.q_proj, self.k_proj, self.v_proj, grad=wants_grad(self))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (self._heads(t) for t in self.project(x))  # (B, nh, T, hs) each
        rec = self.taps.rec  # None unless model.record() or model.edit() is active
        if rec is not None:
            q, k, v = rec(f"{self.tag}.q", q), rec(f"{self.tag}.k", k), rec(f"{self.tag}.v", v)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, nh, S, hs)
        scale = self.head_dim**-0.5
        p_drop = self.attn_dropout.p if self.training else 0.0
        if self.impl == "sdpa" and (rec is None or not any(map(rec.wants, self.manual_points))):
            causal_only = True if mask is None and T > 1 else False  # a branch: a bool where T is symbolic (compile)
            y = attention(x, q, k, v, attn_mask=mask, dropout_p=p_drop, is_causal=causal_only, scale=scale)
        else:  # the reference's eager arithmetic: (q @ k^T) * scale, masked, softmax, dropout, @ v
            att = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, nh, T, S)
            keep = mask if mask is not None else causal(T, k.shape[2], x.device)
            att = att.masked_fill(~keep, torch.finfo(att.dtype).min)
            if rec is not None:
                att = rec(f"{self.tag}.scores", att)
            att = F.softmax(att, dim=-1).to(v.dtype)
            if rec is not None:
                att = rec(f"{self.tag}.probs", att)
            y = torch.matmul(self.attn_dropout(att), v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side
        if rec is not None:
            y = rec(f"{self.tag}.merged", y)
        y = linear(self.c_proj, y)
        if rec is not None:
            y = rec(f"{self.tag}.c_proj", y)
        return self.resid_dropout(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int, taps: Taps) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.d_mlp)
        self.c_proj = nn.Linear(cfg.d_mlp, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.resid_pdrop)
        self.taps, self.tag = taps, f"block.{layer}.mlp"
        self.kernels: Kernels = "reference"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        act = gelu_tanh if self.kernels == "fast" and wants_grad(self) else gelu_new
        h = linear(self.c_fc, x)  # (B, T, 4C)
        rec = self.taps.rec
        if rec is not None:
            h = rec(f"{self.tag}.pre", h)
        h = act(h)
        if rec is not None:
            h = rec(f"{self.tag}.act", h)
        y = linear(self.c_proj, h)
        if rec is not None:
            y = rec(f"{self.tag}.c_proj", y)
        return self.dropout(y)


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int, taps: Taps) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, layer, taps)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, layer, taps)
        self.taps, self.tag = taps, f"block.{layer}"

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        rec = self.taps.rec  # (B, T, C) -> (B, T, C)
        h = self.ln_1(x)
        if rec is not None:
            h = rec(f"{self.tag}.ln_1", h)
        x = x + self.attn(h, mask, cache)
        if rec is not None:
            x = rec(f"{self.tag}.resid_attn", x)
        h = self.ln_2(x)
        if rec is not None:
            h = rec(f"{self.tag}.ln_2", h)
        x = x + self.mlp(h)
        if rec is not None:
            x = rec(self.tag, x)
        return x
