"""GPT-2 written from scratch: embeddings, LayerNorm, causal self-attention with separate q/k/v, tanh-GELU MLP,
pre-LN residual blocks, final LayerNorm, and a head tied to `wte`.

Module names follow Hugging Face (`wte`, `wpe`, `h.{i}.ln_1`, `attn`, `mlp.c_fc`, `ln_f`) so that per-layer
activations line up with the reference. Named taps (`model.record()`) expose every intermediate for the checker.
Shapes: B batch, T new tokens, S keys (past + new), C n_embd, nh heads, hs head size, V vocab.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPT2Config

AttnImpl = Literal["sdpa", "manual"]


class Recorder:
    """Collects named activations. `names`: exact names, or prefixes ending in '.', or None for everything."""

    def __init__(self, names: Iterable[str] | Callable[[str], bool] | None = None) -> None:
        self.acts: dict[str, torch.Tensor] = {}
        if names is None or callable(names):
            self._pred = names
        else:
            wanted = set(names)
            self._pred = lambda n: n in wanted or any(w.endswith(".") and n.startswith(w) for w in wanted)

    def wants(self, name: str) -> bool:
        return self._pred is None or self._pred(name)

    def __call__(self, name: str, t: torch.Tensor) -> None:
        if self.wants(name):
            self.acts[name] = t.detach()


class KVCache:
    """A static key/value cache: preallocated `[n_layer, B, nh, max_len, hs]` tensors and a fill length."""

    def __init__(
        self, cfg: GPT2Config, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (cfg.n_layer, batch, cfg.n_head, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # tokens already stored
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the current length; return all keys/values (B, nh, S, hs)."""
        start, end = self.length, self.length + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def reorder(self, index: torch.Tensor) -> None:
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)


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


def fused_qkv(q: nn.Module, k: nn.Module, v: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (3C, C) weight and (3C,) bias that q/k/v are adjacent views of, or None.

    An official checkpoint stores one c_attn and loads as three views into it (no copy); one matmul over the whole is
    then the reference's own c_attn arithmetic, and decodes faster than three strided ones (measured ~30% less time).
    """
    if not all(type(m) is nn.Linear and m.bias is not None for m in (q, k, v)):
        return None
    wq, wk, wv, bq, bk, bv = q.weight, k.weight, v.weight, q.bias, k.bias, v.bias
    C = wq.shape[1]
    if not (wq.shape == wk.shape == wv.shape == (C, C) and wq.dtype == wk.dtype == wv.dtype == bq.dtype):
        return None
    ws, bs = wq.untyped_storage().data_ptr(), bq.untyped_storage().data_ptr()
    wo, bo = wq.storage_offset(), bq.storage_offset()
    for i, (w, b) in enumerate(((wk, bk), (wv, bv)), start=1):
        if w.untyped_storage().data_ptr() != ws or w.storage_offset() != wo + i * C:
            return None
        if b.untyped_storage().data_ptr() != bs or b.storage_offset() != bo + i * C:
            return None
    if not wq.stride() == wk.stride() == wv.stride() == (1, 3 * C):
        return None
    if not bq.stride() == bk.stride() == bv.stride() == (1,):
        return None
    return wq.as_strided((3 * C, C), (1, 3 * C)), bq.as_strided((3 * C,), (1,))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int) -> None:
        super().__init__()
        e = cfg.n_embd
        self.q_proj = nn.Linear(e, e)
        self.k_proj = nn.Linear(e, e)
        self.v_proj = nn.Linear(e, e)
        self.c_proj = nn.Linear(e, e)
        self.n_head, self.head_dim, self.layer = cfg.n_head, cfg.head_dim, layer
        self.impl: AttnImpl = "sdpa"

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, nh, T, hs)
        B, T, _ = t.shape
        return t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None, rec: Recorder | None, tag: str
    ) -> torch.Tensor:
        B, T, C = x.shape
        qkv = fused_qkv(self.q_proj, self.k_proj, self.v_proj)
        if qkv is not None:  # one (B, T, 3C) matmul, split
            q, k, v = (self._heads(t) for t in F.linear(x, *qkv).split(C, dim=-1))
        else:
            q, k, v = self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
        if rec is not None:
            rec(f"{tag}.q", q), rec(f"{tag}.k", k), rec(f"{tag}.v", v)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, nh, S, hs)
        scale = self.head_dim**-0.5
        want_probs = rec is not None and rec.wants(f"{tag}.probs")
        if self.impl == "sdpa" and not want_probs:
            if mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=scale)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:  # the reference's eager arithmetic: (q @ k^T) * scale, masked, softmax, @ v
            att = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, nh, T, S)
            if mask is None:
                mask = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - T)
            att = att.masked_fill(~mask, torch.finfo(att.dtype).min)
            att = F.softmax(att, dim=-1).to(v.dtype)
            if rec is not None:
                rec(f"{tag}.probs", att)
            y = torch.matmul(att, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side
        if rec is not None:
            rec(f"{tag}.merged", y)
        y = self.c_proj(y)
        if rec is not None:
            rec(f"{tag}.c_proj", y)
        return y


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.d_mlp)
        self.c_proj = nn.Linear(cfg.d_mlp, cfg.n_embd)

    def forward(self, x: torch.Tensor, rec: Recorder | None, tag: str) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        h = gelu_new(self.c_fc(x))  # (B, T, 4C)
        if rec is not None:
            rec(f"{tag}.act", h)
        y = self.c_proj(h)
        if rec is not None:
            rec(f"{tag}.c_proj", y)
        return y


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, layer)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)
        self.tag = f"block.{layer}"

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None, rec: Recorder | None
    ) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        t = self.tag
        h = self.ln_1(x)
        if rec is not None:
            rec(f"{t}.ln_1", h)
        x = x + self.attn(h, mask, cache, rec, f"{t}.attn")
        if rec is not None:
            rec(f"{t}.resid_attn", x)
        h = self.ln_2(x)
        if rec is not None:
            rec(f"{t}.ln_2", h)
        x = x + self.mlp(h, rec, f"{t}.mlp")
        if rec is not None:
            rec(t, x)
        return x


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) 0/1 mask, left-padded -> (B, S) position ids: 0 at each row's first real token, pads at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_mask(attention_mask: torch.Tensor | None, T: int, S: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (B|1, 1, T, S) mask: causal, and keys that are padding hidden. None when plain causal suffices."""
    if attention_mask is None:
        if T == S or T == 1:  # plain causal, or one query that sees every key (a decode step)
            return None
        return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)[None, None]
    if attention_mask.shape[-1] != S:
        raise ValueError(f"attention_mask has {attention_mask.shape[-1]} columns, expected {S} (past + new tokens)")
    causal = torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)  # (T, S)
    mask = causal[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    # A padding query would see no key at all; let every query see itself so softmax stays finite.
    diag = torch.zeros(T, S, dtype=torch.bool, device=device)
    diag[torch.arange(T), torch.arange(S - T, S)] = True
    return mask | diag[None, None]


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        # Tied: no lm_head module at all, the head *is* wte.weight (one tensor). Untied: its own Linear.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self._rec: Recorder | None = None

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        revision: str | None = None,
    ) -> GPT2:
        """Load a checkpoint (local directory, .safetensors file, or Hub id); `model.load_report` tells how it went."""
        from .load import from_pretrained

        m, report = from_pretrained(model, dtype=dtype, device=device, revision=revision)
        m.load_report = report
        return m

    @property
    def head_weight(self) -> torch.Tensor:
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    def set_attn_impl(self, impl: AttnImpl) -> None:
        """'sdpa' (default, torch's fused kernels) or 'manual' (the reference's eager arithmetic, hand-written)."""
        if impl not in ("sdpa", "manual"):
            raise ValueError(f"attention implementation must be 'sdpa' or 'manual', got {impl!r}")
        for b in self.h:
            b.attn.impl = impl

    @contextlib.contextmanager
    def record(self, names: Iterable[str] | Callable[[str], bool] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Capture named activations during forward passes inside the block:

        `embed`, `block.{i}.ln_1`, `block.{i}.attn.{q,k,v}` (B, nh, T, hs), `block.{i}.attn.probs` (asked for by name;
        uses the manual path), `block.{i}.attn.merged` (before c_proj), `block.{i}.attn.c_proj`, `block.{i}.resid_attn`,
        `block.{i}.ln_2`, `block.{i}.mlp.act`, `block.{i}.mlp.c_proj`, `block.{i}` (block output), `ln_f`, `logits`.
        """
        rec = Recorder(names)
        prev, self._rec = self._rec, rec
        try:
            yield rec.acts
        finally:
            self._rec = prev

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        """(B, T) token ids -> (B, T, V) logits ((B, 1, V) with last_only; ln_f's (B, T|1, C) with hidden_only).

        attention_mask: (B, S) 1 for real tokens, 0 for (left) padding, S = cached + new tokens.
        position_ids: (B, T); derived from attention_mask when it is given, else counted from the cache length.
        """
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        S = past + T
        if S > self.config.n_positions:
            raise ValueError(f"sequence of {S} tokens exceeds the context of {self.config.n_positions}")
        if input_ids.numel() and not (0 <= int(input_ids.min()) and int(input_ids.max()) < self.config.vocab_size):
            from .errors import UsageError

            bad = int(input_ids.min()) if int(input_ids.min()) < 0 else int(input_ids.max())
            raise UsageError(f"input_ids: token id {bad} is out of range (expected 0 <= id < {self.config.vocab_size})")
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, past:]
            else:
                position_ids = torch.arange(past, S, device=input_ids.device)[None]
        rec = self._rec
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, C)
        if rec is not None:
            rec("embed", x)
        mask = build_mask(attention_mask, T, S, input_ids.device)
        for block in self.h:
            x = block(x, mask, cache, rec)
        if cache is not None:
            cache.length = S
        x = self.ln_f(x)
        if rec is not None:
            rec("ln_f", x)
        if last_only:
            x = x[:, -1:]
        if hidden_only:
            return x
        logits = self.head(x)  # (B, T, V)
        if rec is not None:
            rec("logits", logits)
        return logits

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) final hidden states -> (..., V) logits. A replaced head (e.g. quantize's int8 head) is a module.

        One 2-D matmul over the rows, as transformers' head runs: x[:, -1:] is not contiguous, and a 3-D F.linear
        on it with a weight that needs no grad goes through bmm instead (measured: not bit-identical for B > 1,
        and 1.8x slower at 8 x 768 x 50257).
        """
        if self.lm_head is not None and type(self.lm_head) is not nn.Linear:
            return self.lm_head(x)
        w = self.head_weight
        b = None if self.lm_head is None else self.lm_head.bias
        return F.linear(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])  # (N, C) -> (..., V)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied head is one parameter, counted once

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | None = 50256,
        **kwargs,
    ) -> torch.Tensor:
        """LongTensor (B, T + new) as transformers' generate returns; see gpt2_port.generate for every option."""
        from .generate import generate

        return generate(
            self,
            input_ids,
            max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            seed=seed,
            attention_mask=attention_mask,
            eos_token_id=eos_token_id,
            **kwargs,
        )
