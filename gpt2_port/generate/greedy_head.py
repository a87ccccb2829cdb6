"""Greedy next tokens on the CPU from a transposed copy of the head weight, used only when provably the exact argmax."""

from __future__ import annotations

import torch

from .protocol import CausalLM


class FastGreedyHead:
    """Greedy next tokens from a transposed copy of the head weight, used only when provably the exact argmax.

    On CPU a matrix-vector product runs ~30% faster with the weight laid out (C, V) than (V, C), and the head is the
    largest single read of a decode step. The two layouts sum in different orders, so their logits differ in the last
    bits. Each is within gamma_n * sum_i |h_i w_ji| <= gamma_n * |h| * |w_j| of the true dot product (Higham, any
    summation order; gamma_n = n u / (1 - n u), u = 2^-24, n = C), so when the fast top-1 leads the fast top-2 by more
    than twice that bound (times 2 for safety), the exact logits have the same unique argmax. Otherwise the exact
    logits are computed as usual. Costs one (C, V) copy of the head weight, kept on the model after the first greedy
    call (154 MB for GPT-2 124M; `fast_head=False` avoids it).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        V, C = weight.shape
        u = 2.0**-24
        gamma = C * u / (1 - C * u)
        self.wt = weight.detach().t().contiguous()  # (C, V)
        self.scale = 2 * 2 * gamma * float(weight.detach().norm(dim=1).max())

    @staticmethod
    def for_model(model: CausalLM) -> FastGreedyHead:
        """The model's cached instance, rebuilt when the head weight changes (another tensor, or written in place).

        Kept on the model between calls, so only the first greedy call pays the copy (0.1 s for 124M).
        """
        w = model.head_weight
        key = (w.data_ptr(), w._version, tuple(w.shape), w.dtype)
        cached = model.__dict__.get("_fast_greedy_head")
        if cached is None or cached[0] != key:
            cached = (key, FastGreedyHead(w))
            model.__dict__["_fast_greedy_head"] = cached
        return cached[1]

    @staticmethod
    def usable(model: CausalLM) -> bool:
        """float32 on CPU (no reduced-precision matmul), a plain head, no recording of the logits, and inference
        (not in train mode, no gradient wanted: the copy is detached)."""
        plain = model.lm_head is None or type(model.lm_head) is torch.nn.Linear
        cpu32 = model.device.type == "cpu" and model.dtype == torch.float32
        return plain and cpu32 and model.taps.rec is None and not model.wants_grad()

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """(B, C) float32 final hidden states -> (B,) the exact argmax, or None when the margin is too thin.

        Non-finite logits always get None, so that the exact ones are computed (and generate checks them): NaN fails
        the margin test, and an Inf in h or the weight makes the bound Inf. A logit that overflows from finite
        inputs would pass the margin test with an infinite lead; with torch's unscaled norms their bound overflows
        first, but the explicit test does not rely on how a norm is computed (~20 us on a (1, 50257) row).
        """
        fast = h @ self.wt  # (B, V)
        if not bool(torch.isfinite(fast).all()):
            return None
        best = fast.argmax(dim=-1, keepdim=True)  # (B, 1)
        top1 = fast.gather(1, best)[:, 0]
        top2 = fast.scatter(1, best, -float("inf")).amax(dim=-1)  # (topk is several times slower on CPU)
        bound = self.scale * h.norm(dim=-1)  # (B,)
        if bool(((top1 - top2) > bound).all()):
            return best[:, 0]
        return None
