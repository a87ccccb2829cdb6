"""Key/value caches for incremental decoding: the preallocated cache the forward fills (a fill length on the host),
and its fixed-shape variant whose step inputs live on the device, so a decode step can be captured once as a CUDA
graph and replayed for every token."""

from __future__ import annotations

import math

import torch

from ..config import GPT2Config

STATIC_LEN_MULTIPLE = 64  # a static cache's slots: prompt + new tokens rounded up to this (at most the context)


def static_len(total_len: int, n_positions: int) -> int:
    """The slots of a StaticKVCache for a generation of `total_len` tokens: rounded up to STATIC_LEN_MULTIPLE (and
    at most the context), so prompts of nearby lengths share one captured step and its cache instead of recording
    one each. The extra slots are masked: the step attends to the same keys."""
    m = STATIC_LEN_MULTIPLE
    return max(total_len, min(-(-total_len // m) * m, n_positions))


class KVCache:
    """Preallocated keys and values and a fill length: for each layer one `[2, B, nh, max_len, hs]` tensor
    (`layers[i]`), its keys `k[i]` and values `v[i]` (`[B, nh, max_len, hs]` each, contiguous) views of it, so that a
    decode step stores a token's key and value with one write (model/decode.py). Each layer's is a tensor of its own,
    not a view of one cache-wide tensor: torch.compile's inductor then writes a token's key and value into it in
    place, where into a view of a larger input it copies the whole layer's keys and values out and back a step (read
    in its code on the CPU: 2 x 2 x B x nh x max_len x hs values a layer, a token)."""

    def __init__(
        self, cfg: GPT2Config, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (2, batch, cfg.n_head, max_len, cfg.head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layer)]
        self.k = [kv[0] for kv in self.layers]  # n_layer x (B, nh, max_len, hs)
        self.v = [kv[1] for kv in self.layers]
        self.length = 0  # tokens already stored
        self.max_len = max_len

    def zero_(self) -> None:
        """Every key and value 0."""
        for kv in self.layers:
            kv.zero_()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nh, T, hs) after the current length; return all keys/values (B, nh, S, hs)."""
        start, end = self.length, self.length + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class StaticKVCache(KVCache):
    """A KVCache (the prompt fills it through the forward) plus the inputs of a fixed-shape decode step, as device
    tensors that keep their shapes: the token of each row (B, 1), its position (B, 1), the slot it is written to
    (1,), and which slots each row attends to (B, max_len), kept as the additive mask SDPA takes (`bias`: 0 where a
    row attends, -inf elsewhere, in the cache's dtype), so that a step reads it as it is instead of making it from a
    boolean (three kernels a token in a captured step). Attending over all max_len slots with that mask keeps every
    shape the same for the whole generation: one attention plan, and a step a CUDA graph can replay.

    A row's position is its slot less the row's left padding (`origin`, (B, 1): position minus slot, 0 or less), so
    feeding a slot sets every input of the step from the slot alone: feeding it twice gives the same inputs (the
    token-taking kernel feeds the next step and its first result is checked by torch's ops feeding it again), and
    nothing needs moving on after a step. `fed`: the slot last fed since `start` (on the host), or None."""

    def __init__(
        self, cfg: GPT2Config, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__(cfg, batch, max_len, dtype, device)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.origin = torch.zeros(batch, 1, dtype=torch.long, device=device)  # (B, 1) position - slot
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.bias = torch.full((batch, max_len), -math.inf, dtype=dtype, device=device)  # (B, max_len)
        self.fed: int | None = None

    def start(self, attention_mask: torch.Tensor | None, prompt_len: int) -> None:
        """After the prompt filled slots [0, T): each row attends to its real prompt tokens, and the first new token
        sits at position (the row's last position + 1). `length` is left at T for the forward's bookkeeping."""
        T = prompt_len
        self.bias.fill_(-math.inf)
        if attention_mask is None:
            self.bias[:, :T] = 0.0
            self.origin.zero_()
        else:
            self.bias[:, :T].masked_fill_(attention_mask.bool(), 0.0)
            # left padding: the real tokens counted, less T
            torch.sub(attention_mask.long().sum(1, keepdim=True), T, out=self.origin)
        torch.add(self.origin, T, out=self.pos)
        self.slot.fill_(T)
        self.fed = None

    def feed(self, tok: torch.Tensor, slot: int) -> None:
        """The next step's inputs: `tok` (B,) on the device goes into `slot`, at each row's position for it; no wait
        for the device."""
        self.tok.copy_(tok.view(-1, 1))
        self.slot.fill_(slot)
        self.bias[:, slot] = 0.0
        torch.add(self.origin, slot, out=self.pos)
        self.fed = slot

    @property
    def keys(self) -> torch.Tensor:
        """(B, max_len) bool: the slots each row attends to."""
        return self.bias == 0
