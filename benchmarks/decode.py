"""Greedy decode loops the benchmark times: ours through `model.generate`, transformers'
`generate`, and a static-shape step (fixed-size KV buffers, position as a tensor) that CUDA graphs can capture.

Every loop returns the generated token ids, so a run can check that both implementations produced the same text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpt2_port.errors import UsageError
from gpt2_port.generate.cache import KVCache
from gpt2_port.model import GPT2
from gpt2_port.model.decode import DecodePlan


@torch.inference_mode()
def greedy_ours(model: GPT2, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """(B, P) prompt -> (B, new_tokens) greedy continuation through the product path, `model.generate`
    (static KV cache; for float32 on CPU the proven-exact fast greedy head), no EOS stop."""
    out = model.generate(ids, new_tokens, do_sample=False, eos_token_id=None)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate produced {out.shape[1] - ids.shape[1]} tokens, asked for {new_tokens}")
    return out[:, ids.shape[1] :]


@torch.inference_mode()
def greedy_hf(ref: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers' generate, greedy, exactly new_tokens (no EOS stop), default dynamic cache."""
    out = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=None,
        do_sample=False,
        num_beams=1,
        pad_token_id=50256,
        eos_token_id=None,
    )
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, asked for {new_tokens}")
    return out[:, ids.shape[1] :]


class StaticDecoder:
    """One-token decode steps over fixed-size KV buffers: every tensor keeps its shape from step to step, and the
    position lives in a tensor, so a step can be captured once as a CUDA graph and replayed.

    The block step is gpt2_port.model.decode's `LayerStep` (the one DecodePlan runs, checked bit for bit against
    `Block.forward`); only the attention differs: it stores k, v with index_copy_ at the position tensor and attends
    over all `max_len` slots with a mask of the filled ones. `step()` runs eagerly anywhere; `capture()` records it
    as a CUDA graph (CUDA only).
    """

    def __init__(self, model: GPT2, batch: int, max_len: int) -> None:
        cfg = model.config
        if max_len > cfg.n_positions:
            raise UsageError(f"max_len {max_len} exceeds the context of {cfg.n_positions}")
        self.model, self.batch, self.max_len = model, batch, max_len
        self.plan = DecodePlan(model)
        dev, dt = model.device, model.dtype
        shape = (cfg.n_layer, batch, cfg.n_head, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dt, device=dev)  # (L, B, nh, max_len, hs)
        self.v = torch.zeros(shape, dtype=dt, device=dev)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # the step's input token
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # the step's position
        self.slots = torch.arange(max_len, device=dev)
        self.n = 0  # host copy of pos (no device sync per step)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Run the prompt (B, P) through the regular forward, copy its keys/values in; -> (B, 1, V) last logits."""
        B, P = ids.shape
        cache = KVCache(self.model.config, B, P, self.model.dtype, ids.device)
        logits = self.model(ids, cache=cache, last_only=True)
        self.k[:, :, :, :P] = cache.k
        self.v[:, :, :, :P] = cache.v
        self.pos.fill_(P)
        self.n = P
        return logits

    def _step(self) -> torch.Tensor:
        mask = (self.slots <= self.pos)[None, None, None]  # (1, 1, 1, max_len): filled slots and this one

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # (B, nh, 1, hs)
            self.k[i].index_copy_(2, self.pos, k)
            self.v[i].index_copy_(2, self.pos, v)
            return F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, scale=self.plan.scale)

        h = self.plan.run(self.plan.embed(self.tok, self.pos), attend)  # (B, 1, C)
        return self.model.head(h)  # (B, 1, V)

    @torch.inference_mode()
    def step(self, tok: torch.Tensor) -> torch.Tensor:
        """Feed tok (B, 1) at the current position; -> (B, 1, V) logits; the position advances by one."""
        if self.n >= self.max_len:
            raise UsageError(f"the static cache is full ({self.max_len} tokens)")
        self.tok.copy_(tok)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._step()
        self.pos += 1
        self.n += 1
        return logits  # type: ignore[return-value]

    def capture(self, warmup: int = 2) -> None:
        """Record one step as a CUDA graph (the model and buffers must be on CUDA). Positions are not consumed."""
        if self.k.device.type != "cuda" or not torch.cuda.is_available():
            raise UsageError(
                f"CUDA graphs need the model on a CUDA device (it is on {self.k.device}); "
                "the eager static step works on any device"
            )
        pos0 = self.pos.clone()
        k0, v0 = self.k.clone(), self.v.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(s):
            for _ in range(warmup):  # warm-up runs on a side stream, as torch.cuda.graph asks
                self._step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(g):
            self.logits = self._step()
        self.graph = g
        self.pos.copy_(pos0)  # capture wrote into the caches at pos0; restore them
        self.k.copy_(k0)
        self.v.copy_(v0)


@torch.inference_mode()
def greedy_static(model: GPT2, ids: torch.Tensor, new_tokens: int, cuda_graph: bool = False) -> torch.Tensor:
    """Greedy decode through StaticDecoder (captured as a CUDA graph when cuda_graph)."""
    B, P = ids.shape
    dec = StaticDecoder(model, B, P + new_tokens)
    logits = dec.prefill(ids)
    if cuda_graph:
        dec.capture()
    out = torch.empty(B, new_tokens, dtype=torch.long, device=ids.device)
    for i in range(new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out[:, i : i + 1] = nxt
        if i + 1 < new_tokens:
            logits = dec.step(nxt)
    return out
