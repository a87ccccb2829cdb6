"""The one builder of attention masks and of position ids for padded batches."""

from __future__ import annotations

import math

import torch

from ..errors import UsageError


def causal(T: int, S: int, device: torch.device | str) -> torch.Tensor:
    """(T, S) bool: query t (the last T of S positions) sees keys 0 .. S - T + t."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) 0/1 mask, left-padded -> (B, S) position ids: 0 at each row's first real token, pads at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_mask(attention_mask: torch.Tensor | None, T: int, S: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (B|1, 1, T, S) mask: causal, and keys that are padding hidden. None when plain causal suffices."""
    if attention_mask is None:
        if T == S or T == 1:  # plain causal, or one query that sees every key (a decode step)
            return None
        return causal(T, S, device)[None, None]
    if attention_mask.shape[-1] != S:
        raise UsageError(f"attention_mask has {attention_mask.shape[-1]} columns, expected {S} (past + new tokens)")
    mask = causal(T, S, device)[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    # A padding query would see no key at all; let every query see itself so softmax stays finite.
    # (T, S): query t's own key is key S - T + t; made by a comparison on the device (putting True through an index
    # would copy it from the host and wait)
    diag = torch.arange(S, device=device)[None, :] == torch.arange(S - T, S, device=device)[:, None]
    return mask | diag[None, None]


def additive_mask(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one SDPA makes of it: 0 where True, -inf where False, in `dtype` (the query's).
    Built once, it spares SDPA that conversion at every call it is passed to."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, -math.inf)
