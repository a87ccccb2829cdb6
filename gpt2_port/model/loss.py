"""The language-model loss: one function for training, evaluation and both parity checkers.

transformers' causal-LM rule (`loss_utils.ForCausalLMLoss`): logits upcast to float32, labels shifted inside (by
padding them with the ignore index on the right, so the last position predicts nothing), positions whose target is
-100 ignored, and the mean taken over the kept targets. Written as transformers writes it, so float32 losses are
bit-identical to `GPT2LMHeadModel(..., labels=...).loss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UsageError

IGNORE_INDEX = -100


def _check(logits: torch.Tensor, targets: torch.Tensor, what: str) -> None:
    if targets.shape != logits.shape[:-1]:
        raise UsageError(
            f"{what} of shape {tuple(targets.shape)} does not match the logits' {tuple(logits.shape[:-1])} "
            f"(expected one target per position: (B, T))"
        )
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise UsageError(f"{what} must hold integer token ids, got dtype {targets.dtype}")


def token_nll(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(..., V) logits and (...) targets already aligned -> (...) float32 negative log-likelihoods (0 where ignored)."""
    _check(logits, targets, "targets")
    V = logits.shape[-1]
    nll = F.cross_entropy(
        logits.float().reshape(-1, V), targets.reshape(-1).long(), ignore_index=ignore_index, reduction="none"
    )  # (N,)
    return nll.view(targets.shape)


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    num_items: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean float32 cross-entropy of (..., V) logits against (...) targets already aligned (nanoGPT's x/y windows).

    `num_items`: divide the sum by this count instead of taking the mean (transformers' `num_items_in_batch`, for
    gradient accumulation over micro-batches with different numbers of kept targets).
    """
    _check(logits, targets, "targets")
    V = logits.shape[-1]
    flat_logits, flat_targets = logits.float().reshape(-1, V), targets.reshape(-1).long()  # (N, V), (N,)
    if num_items is None:
        return F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="mean")
    return F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum") / num_items


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(B, T) labels -> (B, T) targets: position t predicts labels[t + 1]; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    num_items: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' `GPT2LMHeadModel(input_ids, labels=labels).loss`: labels are the inputs, shifted here."""
    _check(logits, labels, "labels")
    return cross_entropy(logits, shift_labels(labels, ignore_index), ignore_index, num_items)


def check_labels(
    labels: torch.Tensor, input_ids: torch.Tensor, vocab_size: int, partial: bool = False, values: bool = True
) -> None:
    """UsageError unless `labels` fit `input_ids` as transformers takes them: the same (B, T), integer token ids in
    range or IGNORE_INDEX. partial: the forward keeps only some positions' logits (labels need all of them).
    values: also check the range of the values (a host sync when the labels are on an accelerator)."""
    if partial:
        raise UsageError("labels need the logits of every position: not with last_only or hidden_only")
    if tuple(labels.shape) != tuple(input_ids.shape):
        raise UsageError(
            f"labels of shape {tuple(labels.shape)} do not match input_ids {tuple(input_ids.shape)} "
            "(expected the same (B, T): transformers shifts them inside)"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise UsageError(f"labels must hold integer token ids, got dtype {labels.dtype}")
    if not values:
        return
    kept = labels[labels != IGNORE_INDEX]
    if kept.numel() and not (0 <= int(kept.min()) and int(kept.max()) < vocab_size):
        bad = int(kept.min()) if int(kept.min()) < 0 else int(kept.max())
        raise UsageError(f"labels: token id {bad} is out of range (expected {IGNORE_INDEX} or 0 <= id < {vocab_size})")
