"""The one builder of attention masks and of position ids for padded batches."""

from __future__ import annotations

import torch

from ..devices import value_range
from ..errors import UsageError


def causal(T: int, S: int, device: torch.device | str) -> torch.Tensor:
    """(T, S) bool: query t (the last T of S positions) sees keys 0 .. S - T + t."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) 0/1 mask, left-padded -> (B, S) position ids: 0 at each row's first real token, pads at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def check_positions(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    shape: tuple[int, int, int],
    n_positions: int,
    values: bool,
) -> None:
    """UsageError unless the mask is (B, S) of 0s and 1s and the positions (B|1, T) or (T,) integers in
    0..n_positions-1, for input_ids (B, T) after `S - T` cached tokens (shape: B, T, S). values: also read the
    values (a host sync when they are on an accelerator)."""
    if attention_mask is None and position_ids is None:
        return  # first: under torch.compile, a size formatted into a message would be specialised
    B, T, S = shape

    def given() -> str:
        return f"does not fit input_ids ({B}, {T})" + (f" after {S - T} cached tokens" if S > T else "")

    if attention_mask is not None:
        m = attention_mask
        if tuple(m.shape) != (B, S):
            raise UsageError(
                f"attention_mask of shape {tuple(m.shape)} {given()}: expected ({B}, {S}), 1 for a token, 0 for padding"
            )
        odd = ((m != 0) & (m != 1)) if values else None
        if odd is not None and bool(odd.any()):
            raise UsageError(f"attention_mask holds {m[odd][0].item():g}: expected 1 for a token and 0 for padding")
    if position_ids is not None:
        p = position_ids
        if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
            raise UsageError(f"position_ids must hold integer positions, got {p.dtype}")
        if not (p.dim() == 1 and p.shape[0] == T or p.dim() == 2 and p.shape[1] == T and p.shape[0] in (1, B)):
            raise UsageError(
                f"position_ids of shape {tuple(p.shape)} {given()}: expected ({B}, {T}), (1, {T}) or ({T},)"
            )
        lo, hi = value_range(p) if values and p.numel() else (0, 0)
        if lo < 0 or hi >= n_positions:
            raise UsageError(
                f"position_ids: {lo if lo < 0 else hi} is out of range (expected 0 <= position < {n_positions})"
            )


def build_mask(attention_mask: torch.Tensor | None, T: int, S: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (B|1, 1, T, S) mask: causal, and keys that are padding hidden. None when plain causal suffices."""
    if attention_mask is None:
        if T == S or T == 1:  # plain causal, or one query that sees every key (a decode step)
            return None
        return causal(T, S, device)[None, None]
    mask = causal(T, S, device)[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    # A padding query would see no key at all; let every query see itself so softmax stays finite.
    # (T, S): query t's own key is key S - T + t; made by a comparison on the device (putting True through an index
    # would copy it from the host and wait)
    diag = torch.arange(S, device=device)[None, :] == torch.arange(S - T, S, device=device)[:, None]
    return mask | diag[None, None]
