"""The fast training kernels: the same functions as the reference arithmetic, rounded differently.

- `gelu_tanh`: GPT-2's tanh GELU as torch's one kernel (`F.gelu(approximate="tanh")`) instead of the eight
  elementwise ops OpenAI and transformers write; autograd keeps one tensor for backward instead of five.
- `linear_cross_entropy`: the head and the mean cross-entropy together, in chunks of rows, without ever holding the
  (N, V) logits: each chunk's logits give its loss and, at once, its share of the gradients of the hidden states
  and of the head's weight; backward only scales them. This is Liger-Kernel's fused linear cross-entropy, on CPU or
  GPU in float32. It saves the logits, their log-softmax and their gradient: 3 x N x V x 4 bytes (620 MB at 4 x 256
  tokens of GPT-2's vocabulary).

Both stay within 1e-5 of the reference arithmetic (the parity report `gpt2-port parity MODEL --backward --kernels
fast` measures them against transformers and its own noise), but they are not bit-identical to transformers, so the
model uses them only when asked (`GPT2.set_kernels("fast")`): the GELU when training, the fused loss in forwards
given labels or targets (model.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .loss import IGNORE_INDEX

# Rows of logits made at once: 256 x 50257 float32 is 51 MB, large enough that each chunk's two matmuls run at the
# GEMM's full rate and small enough to stay out of the peak.
CHUNK_ROWS = 256


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,  # noqa: ANN001
        h: torch.Tensor,  # (N, C) final hidden states
        w: torch.Tensor,  # (V, C) the head's weight
        b: torch.Tensor | None,  # (V,) its bias (an untied head may have one)
        targets: torch.Tensor,  # (N,) int64, IGNORE_INDEX where nothing is predicted
        divisor: torch.Tensor,  # () float32: the number of kept targets (or the caller's num_items)
        grads: bool,  # autograd is recording: make the gradients (else the loss only, as for a validation loss)
    ) -> torch.Tensor:
        keep = targets != IGNORE_INDEX  # (N,)
        safe = torch.where(keep, targets, 0)
        need = [grads and n for n in ctx.needs_input_grad[:3]]
        grad_h = torch.empty_like(h) if need[0] else None
        grad_w = torch.zeros_like(w) if need[1] else None
        grad_b = torch.zeros_like(b) if b is not None and need[2] else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], CHUNK_ROWS):
            hc, tc, kc = h[s : s + CHUNK_ROWS], safe[s : s + CHUNK_ROWS], keep[s : s + CHUNK_ROWS]
            logits = F.linear(hc, w, b).float()  # (n, V)
            picked = logits.gather(1, tc[:, None])[:, 0]  # (n,)
            top = logits.amax(dim=-1)  # (n,)
            e = logits.sub_(top[:, None]).exp_()  # (n, V): exp(logit - max), in the logits' memory, made once
            total_e = e.sum(dim=-1)  # (n,)
            total += ((top + total_e.log() - picked) * kc).sum()  # log-sum-exp minus the target's logit
            if not (need[0] or need[1] or need[2]):
                continue
            # d(mean nll)/d(logits) = (softmax - onehot(target)) / divisor on kept rows, 0 on ignored ones
            scale = (kc / divisor).to(e.dtype)  # (n,)
            g = e.mul_((scale / total_e)[:, None])  # the softmax, scaled, from the same exponentials
            g[torch.arange(len(tc), device=g.device), tc] -= scale
            g = g.to(h.dtype)
            if grad_h is not None:
                torch.mm(g, w, out=grad_h[s : s + CHUNK_ROWS])  # (n, V) @ (V, C)
            if grad_w is not None:
                grad_w.addmm_(g.t(), hc)  # (V, n) @ (n, C)
            if grad_b is not None:
                grad_b.add_(g.sum(0))
        # Intermediates (not inputs or outputs), so kept on ctx and handed over in backward: with the usual incoming
        # gradient of 1 the tensors themselves become the gradients (no copy of the (V, C) head gradient).
        ctx.made = [grad_h, grad_w, grad_b]
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: ANN001, ANN205
        if ctx.made is None:
            raise RuntimeError(
                "linear_cross_entropy: a second backward through the same loss (its gradients were handed over)"
            )
        made, ctx.made = ctx.made, None
        one = grad_out.device.type == "cpu" and float(grad_out) == 1.0
        grads = [t if t is None or one else t * grad_out.to(t.dtype) for t in made]
        return grads[0], grads[1], grads[2], None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    num_items: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean float32 cross-entropy of `F.linear(h, weight, bias)` against `targets` already aligned (loss.cross_entropy's
    rule: IGNORE_INDEX skipped, the mean over kept targets or the sum / num_items), without the logits.

    h: (..., C); targets: (...). Called once per forward: its backward hands out gradients made in its forward.
    """
    C = h.shape[-1]
    flat_t = targets.reshape(-1).long()  # (N,)
    if num_items is None:
        divisor = (flat_t != IGNORE_INDEX).sum().to(torch.float32)
    else:
        divisor = torch.as_tensor(num_items, dtype=torch.float32, device=h.device)
    grads = torch.is_grad_enabled()
    return _LinearCrossEntropy.apply(h.reshape(-1, C), weight, bias, flat_t, divisor, grads)
