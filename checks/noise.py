"""The noise floor: how far transformers is from itself, so that a parity figure can be read.

A figure like "norm_rel 5e-7 at block 7" only means something next to the reference's own spread at that point:
transformers' eager attention against its sdpa attention on the same tokens (and, in a dtype sweep, transformers
itself run in that dtype/device against the float32 reference). A figure is "within the reference's own noise"
when it is no more than NOISE_MARGIN times the floor; otherwise it is "above it by xN".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .metrics import relative

# The floor is one sample of the reference's own spread, not a bound, so a figure up to twice it still counts as
# the reference's noise; more than that is the port's. (Measured on the 124M random checkpoint, CPU: scratch sdpa
# vs eager / transformers sdpa vs eager = 1.0 at every point, and scratch bfloat16/float16 vs the float32 reference
# / transformers itself in that dtype = 1.0: the same kernels give the same bits.)
NOISE_MARGIN = 2.0


@dataclass(frozen=True)
class Verdict:
    within: bool
    ratio: float | None  # error / floor; None when the floor is exactly 0 and the error is not

    @property
    def text(self) -> str:
        if self.ratio is None:
            return "above (reference exact here)"
        if self.within:
            return "within noise"
        return f"above x{self.ratio:.3g}"


def verdict(norm_rel: float, floor_norm_rel: float) -> Verdict:
    """Mark a scratch figure against the reference's own noise at the same point."""
    if math.isnan(norm_rel) or math.isnan(floor_norm_rel):
        return Verdict(False, math.nan)
    if floor_norm_rel == 0.0:
        return Verdict(True, 0.0) if norm_rel == 0.0 else Verdict(False, None)
    ratio = norm_rel / floor_norm_rel
    return Verdict(ratio <= NOISE_MARGIN, ratio)


def spread(floor: Sequence[float], reference: Sequence[float]) -> float:
    """A total's noise: the reference's own distance at each of the items the total sums, summed. The signed
    difference of two totals cancels by chance, so as a floor it would be a coin toss (one sample, sometimes near 0);
    the sum of the distances is how far the reference's noise can move the total."""
    return sum(abs(f - r) for f, r in zip(floor, reference, strict=True))


def total_floor(floor: Sequence[float], reference: Sequence[float], total: float) -> float:
    """`spread` over |total| (the reference's total): a total's floor beside its relative difference."""
    return relative(spread(floor, reference), total)


def closeness(head: str, judged: Sequence[tuple[str, float, Verdict]], noun: str) -> str:
    """'{head}: YES (why)' or '{head}: NO (...)': whether every figure, (name, error, its verdict), is within the
    reference's own noise; the worst ratio when it is, the first figure above when it is not."""
    if all(v.within for _, _, v in judged):
        if all(e == 0 for _, e, _ in judged):
            return f"{head}: YES (bit-exact at every {noun})"
        name, _, worst = max(judged, key=lambda j: -1.0 if j[2].ratio is None else j[2].ratio)
        return f"{head}: YES (every {noun} within {NOISE_MARGIN:g}x the floor; worst x{worst.ratio:.2g} at {name})"
    above = [(name, v) for name, _, v in judged if not v.within]
    return (
        f"{head}: NO ({len(above)} of {len(judged)} {noun}s above the floor; first at {above[0][0]}, "
        f"{above[0][1].text})"
    )
