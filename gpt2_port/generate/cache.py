"""A static key/value cache for incremental decoding."""

from __future__ import annotations

import torch

from ..config import GPT2Config


class KVCache:
    """Preallocated `[n_layer, B, nh, max_len, hs]` key and value tensors and a fill length."""

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
