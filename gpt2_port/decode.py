"""One-token decode steps without module dispatch: the forward pass's own ops, gathered once per `generate` call.

A decode step of GPT-2 124M on a 2-core CPU spends ~20 ms reading weights and, through `GPT2.forward`, another ~2 ms
in Python: module calls, the recorder checks, the q/k/v fusion test, cache indexing, mask and position building,
about 25 module and 40 op dispatches per block. `DecodePlan` looks all of that up once (the weights as tensors, the
fused c_attn view, per-layer cache views) and runs the same aten ops on the same tensors in the same order:

    ln_1 -> one c_attn matmul, split -> cache write -> SDPA over the filled keys -> c_proj -> residual add
    -> ln_2 -> c_fc -> gelu_new (op for op) -> mlp c_proj -> residual add;  ln_f at the end

so a step's hidden state is bit-identical to `model(tok, cache=..., hidden_only=True)` (tests/test_decode.py checks
it bitwise, with and without padding, against the plain forward). It applies when the attention is SDPA and nothing
records activations; anything else (the manual attention, `model.record`) goes through `GPT2.forward`. Linears that
are not plain `nn.Linear` (e.g. int8) are called as modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache
from .masks import build_mask, positions_from_mask
from .model import GPT2, fused_qkv, gelu_new

Linear = Callable[[torch.Tensor], torch.Tensor]  # (M, in) -> (M, out)


def _linear(m: nn.Module) -> Linear:
    """A plain Linear as F.linear over its own weight and bias (the module's forward, less the module call)."""
    if type(m) is nn.Linear:
        w, b = m.weight, m.bias
        return lambda x: F.linear(x, w, b)
    return m


@dataclass
class _Layer:
    ln_1: tuple[torch.Tensor, torch.Tensor]
    qkv: Linear | None  # one (B, C) -> (B, 3C) matmul over the checkpoint's c_attn, when q/k/v are views of it
    q: Linear
    k: Linear
    v: Linear
    c_proj: Linear
    ln_2: tuple[torch.Tensor, torch.Tensor]
    c_fc: Linear
    mlp_proj: Linear


class DecodePlan:
    """The tensors and callables of every layer, looked up once; `step` runs one token per row."""

    def __init__(self, model: GPT2) -> None:
        cfg = model.config
        self.model = model
        self.C, self.nh, self.hs, self.eps = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.layer_norm_epsilon
        self.scale = cfg.head_dim**-0.5
        self.layers: list[_Layer] = []
        for block in model.h:
            a = block.attn
            fused = fused_qkv(a.q_proj, a.k_proj, a.v_proj)
            qkv = None if fused is None else (lambda x, w=fused[0], b=fused[1]: F.linear(x, w, b))
            self.layers.append(
                _Layer(
                    ln_1=(block.ln_1.weight, block.ln_1.bias),
                    qkv=qkv,
                    q=_linear(a.q_proj),
                    k=_linear(a.k_proj),
                    v=_linear(a.v_proj),
                    c_proj=_linear(a.c_proj),
                    ln_2=(block.ln_2.weight, block.ln_2.bias),
                    c_fc=_linear(block.mlp.c_fc),
                    mlp_proj=_linear(block.mlp.c_proj),
                )
            )
        self.ln_f = (model.ln_f.weight, model.ln_f.bias)
        self._views: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None

    @staticmethod
    def for_model(model: GPT2) -> DecodePlan | None:
        """A plan, or None when the forward pass must run instead (manual attention, or activations being recorded)."""
        if model.taps.rec is not None or any(b.attn.impl != "sdpa" for b in model.h):
            return None
        return DecodePlan(model)

    def _cache_views(self, cache: KVCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer (B, nh, max_len, hs) views of the cache, made once per cache."""
        key = id(cache.k)
        if self._views is None or self._views[0] != key:
            n = len(self.layers)
            self._views = (key, [cache.k[i] for i in range(n)], [cache.v[i] for i in range(n)])
        return self._views[1], self._views[2]

    def step(self, input_ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, 1) ids at position cache.length -> (B, 1, C) ln_f output, as `model(..., hidden_only=True)` gives.

        attention_mask: (B, S) over past + this token (left padding), or None when no row is padded.
        """
        m, C, nh, hs, eps = self.model, self.C, self.nh, self.hs, self.eps
        B = input_ids.shape[0]
        past = cache.length
        S = past + 1
        if S > m.config.n_positions:
            raise ValueError(f"sequence of {S} tokens exceeds the context of {m.config.n_positions}")
        if attention_mask is not None:
            pos = positions_from_mask(attention_mask)[:, past:]  # (B, 1)
            mask = build_mask(attention_mask, 1, S, input_ids.device)  # (B, 1, 1, S)
        else:
            pos = torch.arange(past, S, device=input_ids.device)[None]  # (1, 1)
            mask = None
        ks, vs = self._cache_views(cache)
        x = F.embedding(input_ids, m.wte.weight) + F.embedding(pos, m.wpe.weight)  # (B, 1, C)
        for i, L in enumerate(self.layers):
            h = F.layer_norm(x, (C,), *L.ln_1, eps)  # (B, 1, C)
            if L.qkv is not None:
                q, k, v = L.qkv(h).split(C, dim=-1)  # 3 x (B, 1, C)
            else:
                q, k, v = L.q(h), L.k(h), L.v(h)
            q, k, v = (t.view(B, 1, nh, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, 1, hs)
            ks[i].narrow(2, past, 1).copy_(k)
            vs[i].narrow(2, past, 1).copy_(v)
            keys, values = ks[i].narrow(2, 0, S), vs[i].narrow(2, 0, S)  # (B, nh, S, hs)
            if mask is None:
                y = F.scaled_dot_product_attention(q, keys, values, is_causal=False, scale=self.scale)
            else:
                y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
            x = x + L.c_proj(y.transpose(1, 2).reshape(B, 1, C))
            h = F.layer_norm(x, (C,), *L.ln_2, eps)
            x = x + L.mlp_proj(gelu_new(L.c_fc(h)))
        cache.length = S
        return F.layer_norm(x, (C,), *self.ln_f, eps)  # (B, 1, C)
