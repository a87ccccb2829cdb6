"""GPT-2 written from scratch: embeddings, LayerNorm, causal self-attention with separate q/k/v, tanh-GELU MLP,
pre-LN residual blocks, final LayerNorm, and a head tied to `wte`.

Module names follow Hugging Face (`wte`, `wpe`, `drop`, `h.{i}.ln_1`, `attn`, `mlp.c_fc`, `ln_f`) so that per-layer
activations line up with the reference. Dropout sits at transformers' four sites (embeddings, attention
probabilities, attention output, MLP output) and is active in train mode only. Named taps (`model.record()`) expose
every intermediate for the checker. q, k and v are computed as c_attn computes them (gpt2_port/c_attn.py). The
inference shortcuts elsewhere (decode.py's DecodePlan, generate's fast greedy head, the fused c_attn view, int8) ask
`wants_grad` first and never run in train mode or when a gradient is wanted. Shapes: B batch, T new tokens, S keys
(past + new), C n_embd, nh heads, hs head size, V vocab.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .c_attn import project_qkv
from .config import GPT2Config
from .errors import UsageError
from .fused import gelu_tanh, linear_cross_entropy
from .init import init_tensor_
from .kv_cache import KVCache
from .loss import check_labels, cross_entropy, shift_labels
from .masks import build_mask, causal, positions_from_mask
from .taps import Recorder, Taps

AttnImpl = Literal["sdpa", "manual"]
Kernels = Literal["reference", "fast"]


class CausalLMOutput(NamedTuple):
    loss: torch.Tensor  # scalar, float32: transformers' causal-LM loss
    logits: torch.Tensor | None  # (B, T, V); None when the fast kernels computed the loss without them


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

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, nh, T, hs)
        B, T, _ = t.shape
        return t.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) -> q, k, v (B, T, C) each, through c_attn's arithmetic: one (B*T, C) @ (C, 3C) matmul."""
        return project_qkv(x, self.q_proj, self.k_proj, self.v_proj, grad=wants_grad(self))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (self._heads(t) for t in self.project(x))  # (B, nh, T, hs) each
        tap, tag = self.taps, self.tag
        tap(f"{tag}.q", q), tap(f"{tag}.k", k), tap(f"{tag}.v", v)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, nh, S, hs)
        scale = self.head_dim**-0.5
        p_drop = self.attn_dropout.p if self.training else 0.0
        if self.impl == "sdpa" and not tap.wants(f"{tag}.probs"):
            causal_only = mask is None and T > 1
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p_drop, is_causal=causal_only, scale=scale
            )
        else:  # the reference's eager arithmetic: (q @ k^T) * scale, masked, softmax, dropout, @ v
            att = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, nh, T, S)
            keep = mask if mask is not None else causal(T, k.shape[2], x.device)
            att = F.softmax(att.masked_fill(~keep, torch.finfo(att.dtype).min), dim=-1).to(v.dtype)
            tap(f"{tag}.probs", att)
            y = torch.matmul(self.attn_dropout(att), v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): heads side by side
        tap(f"{tag}.merged", y)
        y = self.c_proj(y)
        tap(f"{tag}.c_proj", y)
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
        h = act(self.c_fc(x))  # (B, T, 4C)
        self.taps(f"{self.tag}.act", h)
        y = self.c_proj(h)
        self.taps(f"{self.tag}.c_proj", y)
        return self.dropout(y)


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer: int, taps: Taps) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg, layer, taps)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, layer, taps)
        self.taps, self.tag = taps, f"block.{layer}"

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        tap, t = self.taps, self.tag  # (B, T, C) -> (B, T, C)
        h = self.ln_1(x)
        tap(f"{t}.ln_1", h)
        x = x + self.attn(h, mask, cache)
        tap(f"{t}.resid_attn", x)
        h = self.ln_2(x)
        tap(f"{t}.ln_2", h)
        x = x + self.mlp(h)
        tap(t, x)
        return x


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.taps = Taps()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)
        self.h = nn.ModuleList(Block(cfg, i, self.taps) for i in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        # Tied: no lm_head module at all, the head *is* wte.weight (one tensor). Untied: its own Linear.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False  # recompute each block in backward (train mode only)
        self.kernels: Kernels = "reference"  # "fast": gpt2_port.fused's kernels when training

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

    def save_pretrained(self, directory: str, tokenizer_dir: str | None = None) -> None:
        """Write the official layout (config.json, model.safetensors, tokenizer files when known): see load.py."""
        from .load import save_pretrained

        save_pretrained(self, directory, tokenizer_dir)

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
            raise UsageError(f"attention implementation must be 'sdpa' or 'manual', got {impl!r}")
        for b in self.h:
            b.attn.impl = impl

    def set_kernels(self, kernels: Kernels) -> GPT2:
        """'reference' (default: transformers' arithmetic op for op, bit-identical gradients) or 'fast'
        (gpt2_port.fused): the one-kernel tanh GELU when training, and the head fused with the loss in any forward
        given labels or targets (no logits are made; the output's logits are None). A forward that returns logits
        without training is the reference arithmetic, bit for bit."""
        if kernels not in ("reference", "fast"):
            raise UsageError(f"kernels must be 'reference' or 'fast', got {kernels!r}")
        self.kernels = kernels
        for b in self.h:
            b.mlp.kernels = kernels
        return self

    def set_dropout(self, p: float) -> GPT2:
        """Set every dropout rate (embeddings, attention probabilities, residual branches) to p; config follows."""
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0 <= p < 1):
            raise UsageError(f"dropout must be a number in [0, 1), got {p!r}")
        self.config = self.config.with_dropout(float(p))
        for m in self.modules():
            if isinstance(m, nn.Dropout):
                m.p = float(p)
        return self

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> GPT2:
        """Initialise every parameter for training from scratch (gpt2_port.init: transformers' and nanoGPT's rule)."""
        g = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        for name, p in self.named_parameters():
            init_tensor_(name, p, self.config, g)
        return self

    @contextlib.contextmanager
    def record(
        self, names: Iterable[str] | Callable[[str], bool] | None = None, keep_graph: bool = False
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Capture named activations during forward passes inside the block:

        `embed`, `block.{i}.ln_1`, `block.{i}.attn.{q,k,v}` (B, nh, T, hs), `block.{i}.attn.probs` (asked for by name;
        uses the manual path), `block.{i}.attn.merged` (before c_proj), `block.{i}.attn.c_proj`, `block.{i}.resid_attn`,
        `block.{i}.ln_2`, `block.{i}.mlp.act`, `block.{i}.mlp.c_proj`, `block.{i}` (block output), `ln_f`, `logits`.
        An unknown name raises UsageError listing the valid ones. `keep_graph=True` keeps the tensors in the autograd
        graph with their gradients retained (read `acts[name].grad` after backward).
        """
        rec = Recorder(names, self.config.n_layer, keep_graph)
        prev, self.taps.rec = self.taps.rec, rec
        try:
            yield rec.acts
        finally:
            self.taps.rec = prev

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        hidden_only: bool = False,
        labels: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor | CausalLMOutput:
        """(B, T) token ids -> (B, T, V) logits ((B, 1, V) with last_only; ln_f's (B, T|1, C) with hidden_only).

        attention_mask: (B, S) 1 for real tokens, 0 for (left) padding, S = cached + new tokens.
        position_ids: (B, T); derived from attention_mask when it is given, else counted from the cache length.
        labels: (B, T) as transformers takes them (shifted inside, -100 ignored): returns CausalLMOutput(loss, logits).
        targets: (B, T) already aligned with the positions (nanoGPT's y windows, -100 ignored): the same output.
        num_items_in_batch: with labels or targets, the loss is their summed NLL divided by this count instead of
            their mean (transformers' kwarg: one divisor over the micro-batches of a gradient-accumulation step).
        """
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        S = past + T
        V = self.config.vocab_size
        if S > self.config.n_positions:
            raise UsageError(f"sequence of {S} tokens exceeds the context of {self.config.n_positions}")
        if input_ids.numel() and not (0 <= int(input_ids.min()) and int(input_ids.max()) < V):
            bad = int(input_ids.min()) if int(input_ids.min()) < 0 else int(input_ids.max())
            raise UsageError(f"input_ids: token id {bad} is out of range (expected 0 <= id < {V})")
        if labels is not None and targets is not None:
            raise UsageError("pass labels (shifted inside) or targets (already aligned), not both")
        if num_items_in_batch is not None:
            if labels is None and targets is None:
                raise UsageError("num_items_in_batch divides a loss: pass labels or targets with it")
            n = num_items_in_batch
            on_host = not torch.is_tensor(n) or n.device.type == "cpu"  # checked without a device sync
            if on_host and not float(n) > 0:
                raise UsageError(f"num_items_in_batch must be a positive count of targets, got {float(n):g}")
        for t in (labels, targets):
            if t is not None:
                check_labels(t, input_ids, self.config.vocab_size, partial=last_only or hidden_only)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, past:]
            else:
                position_ids = torch.arange(past, S, device=input_ids.device)[None]
        x = self.drop(self._embed_tokens(input_ids) + self.wpe(position_ids))  # (B, T, C)
        self.taps("embed", x)
        mask = build_mask(attention_mask, T, S, input_ids.device)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.h:
            x = checkpoint(block, x, mask, cache, use_reentrant=False) if recompute else block(x, mask, cache)
        if cache is not None:
            cache.length = S
        x = self.ln_f(x)
        self.taps("ln_f", x)
        if last_only:
            x = x[:, -1:]
        if hidden_only:
            return x
        if labels is not None:
            targets = shift_labels(labels)
        if targets is not None and self._fused_loss():
            bias = None if self.lm_head is None else self.lm_head.bias
            return CausalLMOutput(linear_cross_entropy(x, self.head_weight, bias, targets, num_items_in_batch), None)
        logits = self.head(x)  # (B, T, V)
        self.taps("logits", logits)
        if targets is not None:
            return CausalLMOutput(cross_entropy(logits, targets, num_items=num_items_in_batch), logits)
        return logits

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """wte rows. Fast kernels, training, tied head: the rows' gradient goes to wte as a sparse (B*T rows) tensor
        added into the head's dense one, instead of a dense (V, C) gradient made, filled and summed."""
        if self.kernels == "fast" and self.lm_head is None and wants_grad(self) and self.wte.weight.requires_grad:
            return F.embedding(input_ids, self.wte.weight, sparse=True)
        return self.wte(input_ids)

    def _fused_loss(self) -> bool:
        """The head fused with the loss: fast kernels, float32 without autocast, nobody asking for the logits (a
        forward given labels or targets; with gradients or without, as a validation loss is)."""
        return (
            self.kernels == "fast"
            and self.dtype == torch.float32
            and not torch.is_autocast_enabled(self.device.type)
            and (self.lm_head is None or type(self.lm_head) is nn.Linear)
            and not self.taps.wants("logits")
        )

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

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **options) -> torch.Tensor:
        """LongTensor (B, T + new) as transformers' generate returns; the options: gpt2_port.generate.generate_full."""
        from .generate import generate

        return generate(self, input_ids, max_new_tokens, **options)
