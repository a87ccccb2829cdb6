"""How the next token is chosen from the logits: the sampling options, defined once, and transformers' logits
processors (repetition penalty, temperature, top-k, top-p) written as transformers writes them, so that greedy and
seeded runs can be compared token for token.

Next-token logits are taken in float32; the repetition penalty applies first (also when greedy), then, when sampling,
temperature, top-k and top-p; a token is drawn from the softmax as `torch.multinomial` draws one (from a
`torch.Generator` seeded with `seed`, so a seed repeats its output; `draw`). Everything runs on the model's device.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import torch

from ..errors import UsageError


def number(name: str, value: object, kind: type[int] | type[float]) -> int | float:
    """`value` as a Python int or float (numpy's and 0-d tensors' numbers too); UsageError naming `name` for anything
    else, a bool included."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_complex:
        value = value.item()
    want = numbers.Integral if kind is int else numbers.Real
    if isinstance(value, bool) or not isinstance(value, want):
        what = "an integer" if kind is int else "a number"
        raise UsageError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    return kind(value)


@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen: the sampling options, defined here once. `generate_full`, `generate` and
    `GPT2.generate` take them as keyword arguments of these names, with transformers' defaults (top_k 50 when
    sampling, as its GenerationConfig has it). Values that disable a step: temperature 1.0, top_k None/0, top_p
    None/1.0, repetition_penalty 1.0."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float | None = None
    repetition_penalty: float = 1.0

    @classmethod
    def from_options(cls, options: dict) -> SamplingSettings:
        """The settings named by keyword arguments, validated; UsageError for a name that is no option."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise UsageError(
                f"generate: unknown argument(s) {', '.join(map(repr, unknown))}: the sampling options are "
                f"{', '.join(names)}; see gpt2_port.generate.generate_full for the others"
            )
        kinds = {"temperature": float, "top_p": float, "repetition_penalty": float, "top_k": int}
        options = {k: number(k, v, kinds[k]) if k in kinds and v is not None else v for k, v in options.items()}
        settings = cls(**options)
        settings.validate()
        return settings

    def validate(self) -> None:
        """UsageError naming the argument and what was expected, for values that make no distribution."""
        if self.do_sample and not self.temperature > 0:
            raise UsageError(
                f"temperature must be > 0 when sampling, got {self.temperature} (greedy decoding, --greedy or "
                "do_sample=False, gives the most likely token)"
            )
        if self.top_k is not None and self.top_k < 0:
            raise UsageError(f"top_k must be a non-negative integer (0: no top-k), got {self.top_k}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise UsageError(f"top_p must be in (0, 1] (1: no top-p), got {self.top_p}")
        if not (self.repetition_penalty > 0):
            raise UsageError(f"repetition_penalty must be > 0 (1.0: no penalty), got {self.repetition_penalty}")


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """(B, V) scores, (B, V) bool seen tokens: divide positive scores by `penalty`, multiply negative ones."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def apply_top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` highest scores (and any tied with the k-th), -inf elsewhere."""
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1, None]  # (B, 1)
    return scores.masked_fill(scores < kth, -float("inf"))


def apply_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (always at least one)."""
    sorted_scores, sorted_idx = torch.sort(scores, descending=False)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # ascending: the tail to drop comes first
    drop_sorted = cum <= (1 - top_p)
    drop_sorted[..., -1:] = False
    drop = drop_sorted.scatter(1, sorted_idx, drop_sorted)
    return scores.masked_fill(drop, -float("inf"))


def process_logits(scores: torch.Tensor, seen: torch.Tensor | None, s: SamplingSettings) -> torch.Tensor:
    """(B, V) float32 next-token logits -> the processed scores a token is drawn from.

    Their softmax is the distribution the token is drawn from."""
    if s.repetition_penalty != 1.0 and seen is not None:
        scores = apply_repetition_penalty(scores, seen, s.repetition_penalty)
    if s.do_sample:
        if s.temperature != 1.0:
            scores = scores / s.temperature
        if s.top_k:
            scores = apply_top_k(scores, s.top_k)
        if s.top_p is not None and s.top_p < 1.0:
            scores = apply_top_p(scores, s.top_p)
    return scores


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(B, V) probabilities -> (B,) one token per row: the draw `torch.multinomial(probs, 1, generator=generator)`
    makes (for one sample torch divides the probabilities by Exp(1) noise from the generator and takes the argmax), so
    the same tokens and the same generator state after, without multinomial's two checks of the probabilities, each
    a wait for the device (an `.item()`). The caller's check that the probabilities are finite stands in for them
    (choose.py: a softmax that is finite is never negative or all zero)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)  # (B, V) Exp(1) noise
    return torch.argmax(probs / q, dim=-1)


def seen_tokens(input_ids: torch.Tensor, vocab_size: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) ids -> (B, V) bool: which tokens each row holds (its padding excluded)."""
    seen = torch.zeros(input_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=input_ids.device)
    ids = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, vocab_size)
    seen.scatter_(1, ids, True)
    return seen[:, :vocab_size]
