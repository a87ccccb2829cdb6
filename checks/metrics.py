"""How far the scratch model is from the reference: per-point error figures and next-token agreement.

Every figure is computed in float64 on the CPU. A non-finite value on either side never passes: the point figures
become NaN (which no tolerance admits), a position whose logits are not all finite counts as a disagreement, and the
log-prob difference becomes NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def relative(x: float, to: float) -> float:
    """|x| / |to| for scalars: 0 where x is 0, inf where only `to` is (as norm_rel in `metrics`)."""
    if x == 0:
        return 0.0
    return abs(x) / abs(to) if to else math.inf


def rel(a: float, b: float) -> float:
    """|a - b| / |b| for two scalars: a loss, a total NLL, a perplexity."""
    return relative(a - b, b)


def metrics(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float, float]:
    """(max_abs, norm_rel, cosine, elementwise_rel) of scratch x against reference y, in float64.

    elementwise_rel = max |x-y| / (|x|+|y|) is reported but never gates alone: it explodes on near-zero elements.
    """
    x = x.detach().to("cpu", torch.float64).flatten()
    y = y.detach().to("cpu", torch.float64).flatten()
    d = (x - y).abs()
    max_abs = float(d.max()) if d.numel() else 0.0
    ny = float(y.norm())
    norm_rel = float((x - y).norm()) / ny if ny > 0 else (0.0 if max_abs == 0 else math.inf)
    nx = float(x.norm())
    cosine = float(x @ y) / (nx * ny) if nx > 0 and ny > 0 else (1.0 if nx == ny else 0.0)
    den = x.abs() + y.abs()
    elem = float(torch.where(den > 0, d / den, torch.zeros_like(d)).max()) if d.numel() else 0.0
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
        max_abs = norm_rel = elem = math.nan
        cosine = math.nan
    return max_abs, norm_rel, cosine, elem


@dataclass(frozen=True)
class NextToken:
    """Next-token agreement of two sets of logits over the same positions."""

    top1_agreement: float  # fraction of positions whose argmax agrees; a non-finite row never agrees
    logprob_max_abs: float  # max |log_softmax(x) - log_softmax(y)|; NaN when any logit is non-finite
    n_positions: int
    n_nonfinite: int  # positions where either side has a NaN or an infinity


def next_token(x: torch.Tensor, y: torch.Tensor, vocab_size: int) -> NextToken:
    """Scratch logits x against reference logits y, both (..., V), compared position by position."""
    x = x.detach().to("cpu", torch.float64).reshape(-1, vocab_size)  # (N positions, V)
    y = y.detach().to("cpu", torch.float64).reshape(-1, vocab_size)
    finite = torch.isfinite(x).all(-1) & torch.isfinite(y).all(-1)  # (N,)
    agree = (x.argmax(-1) == y.argmax(-1)) & finite
    n = int(finite.numel())
    top1 = float(agree.double().mean()) if n else 0.0
    if bool(finite.all()) and n:
        lp = float((torch.log_softmax(x, -1) - torch.log_softmax(y, -1)).abs().max())
    else:
        lp = math.nan
    return NextToken(top1, lp, n, n - int(finite.sum()))
