"""The fast training kernels: less memory and time than the reference arithmetic, and close to it.

- `gelu_tanh`: GPT-2's tanh GELU as torch's one kernel (`F.gelu(approximate="tanh")`) instead of the eight
  elementwise ops OpenAI and transformers write; autograd keeps one tensor for backward instead of five. Rounded
  differently from the op-for-op GELU.
- `linear_cross_entropy`: the head and the cross-entropy together, in chunks of rows, without ever holding the
  (N, V) logits: each chunk's logits give its loss and, at once, its share of the gradients of the hidden states and
  of the head's weight; backward hands them over (Liger-Kernel's fused linear cross-entropy, on CPU or GPU; under
  autocast its matmuls run in autocast's dtype (on a CPU whose bf16/fp16 GEMM is slow, as float32 products of the
  cast operands rounded once: lowp.autocast_upcast) and its log-softmax in float32, as the reference head and loss run
  there; under fp16 the two gradient products run in float32, as the gradient is made before a GradScaler's scale
  could keep it inside fp16's range). The reference keeps the logits, their log-softmax and their gradient:
  3 x N x V x 4 bytes (620 MB at 4 x 256 tokens of GPT-2's vocabulary); this keeps one chunk's (`chunk_rows`). Each
  chunk runs torch's own log-softmax forward and backward kernels, in place in one reused buffer, fed the incoming
  gradient nll_loss's backward would make: when the loss's own incoming gradient is 1 (`loss.backward()`; gradient
  accumulation through `num_items_in_batch`), the logits' gradient is the reference's bit for bit, and so are the
  hidden states' (their matmul runs row by row). The head weight's gradient is summed over the chunks, so it is
  rounded differently; another incoming gradient scales the made gradients afterwards (the reference scales before),
  also rounded differently. Under torch.compile the compiler makes its own kernels anyway, so the gradient is
  written from the backward's formula with the incoming gradient's one entry a row (`nll_and_logit_grad`): the
  compiled chunk is then one pass that reads the low-precision logits and writes their gradient, where a dense
  buffer of the incoming gradient would be written and read in full. Its matmuls can run over the head padded with
  zero rows to a multiple of 64 (`pad_multiple`, GPT2.set_head_padding: GPU GEMMs are faster on aligned sizes), the
  pad's logits set to -inf; the weight and its gradient keep their V rows.

Neither is bit-identical to transformers; the parity report (`gpt2-port parity MODEL --backward --kernels fast`)
measures them against transformers and against its own eager-vs-sdpa noise. The model uses them only when asked
(`GPT2.set_kernels("fast")`): the GELU when training, the fused loss in forwards given labels or targets (model.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..devices import autocast_dtype, compiling, host_readable
from ..errors import UsageError
from .loss import IGNORE_INDEX
from .lowp import autocast_upcast, mm_upcast

# Rows of logits made at once on the CPU: 256 x 50257 float32 is 51 MB, large enough that each chunk's two matmuls
# run at the GEMM's full rate and small enough to stay out of the peak.
CHUNK_ROWS = 256
# On a GPU each chunk also reads the head again and adds its share into the float32 head gradient (154 MB at 124M),
# a pass that costs more than the chunk's matmuls when chunks are small (at 16 x 1024 tokens, 256 rows would be 64
# such passes): chunks there take as many rows as fit this many bytes of float32 logits (5120 rows of 50304; twice
# that in the chunk's two buffers). `python -m benchmarks.head_padding --chunk-rows ...` times other choices.
GPU_CHUNK_BYTES = 1 << 30


def chunk_rows(device_type: str, vocab: int) -> int:
    """Rows per chunk of the fused head-and-loss on this device type, for a (padded) vocabulary of `vocab`."""
    if device_type == "cpu":
        return CHUNK_ROWS
    return max(CHUNK_ROWS, GPU_CHUNK_BYTES // (4 * vocab) // CHUNK_ROWS * CHUNK_ROWS)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def minor_version(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as torch's "2.11.0+cu128"."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# The private ops `torch._log_softmax(..., out=)` and `torch._log_softmax_backward_data(..., out=)` are torch's own
# log-softmax kernels, the ones F.cross_entropy runs: calling them gives the reference's logits gradient bit for bit.
# Private means unversioned: they are used on the torch releases CI tests (the minor versions below: pyproject's floor
# and ./dev's pin, tests/test_versions.py) and only when present; elsewhere the public fallback computes the same
# formula with public ops (the gradient then matches the reference to rounding, not bit for bit). tests/test_fused.py
# runs both.
PRIVATE_OPS_TESTED = {(2, 11), (2, 13)}


def private_ops_usable() -> bool:
    return (
        minor_version(torch.__version__) in PRIVATE_OPS_TESTED
        and hasattr(torch, "_log_softmax")
        and hasattr(torch, "_log_softmax_backward_data")
    )


USE_PRIVATE_OPS = private_ops_usable()


def nll_and_logit_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    keep: torch.Tensor,
    step: torch.Tensor,
    grad_dtype: torch.dtype | None,
    nll_grad: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of the mean cross-entropy, in place: (n, V) float32 logits -> the kept targets' summed NLL, and the
    logits' gradient in `grad_dtype` (None: the loss only), written over them where it is float32.

    targets: (n,) in range (anything where not kept); keep: (n,) bool; step: () -1/divisor, the gradient nll_loss's
    backward gives each kept target for an incoming gradient of 1.
    nll_grad: an (n, V) float32 buffer of zeros, left zeroed, where torch's own log-softmax backward kernel runs (the
    private ops, USE_PRIVATE_OPS, outside torch.compile): each row equals the reference's (F.cross_entropy) bit for bit
    however the rows are chunked. None: the gradient is made from the kernel's formula, g - exp(lp) * sum(g), with the
    incoming g nonzero at the targets only: -exp(lp) * g_t everywhere in one pass, the targets' entries then computed
    alone (the public ops, and under torch.compile, whose compiler fuses that pass into the log-softmax's instead of
    writing and reading a dense buffer of g).
    """
    if USE_PRIVATE_OPS and not compiling():  # in place, torch's own kernel (the loss alone too: no (n, V) temporary)
        lp = torch._log_softmax(logits, 1, False, out=logits)  # (n, V) log-probabilities
    else:
        lp = logits.copy_(torch.log_softmax(logits, dim=1))
    at = (torch.arange(len(targets), device=logits.device), targets)
    lp_t = lp[at]  # (n,) the targets' log-probabilities
    nll = -(lp_t * keep).sum()
    if grad_dtype is None:
        return nll, None
    g_t = torch.where(keep, step, 0.0)  # (n,) nll_loss's incoming gradient at each row's target, its row's only one
    if nll_grad is not None:
        nll_grad[at] = g_t  # (n, V)
        grad = torch._log_softmax_backward_data(nll_grad, lp, 1, torch.float32, out=lp).to(grad_dtype)
        nll_grad[at] = nll_grad.new_zeros(())  # a zero on the device: a Python number would be copied from the host
        return nll, grad
    grad = lp.exp_().mul_(-g_t[:, None]).to(grad_dtype)  # (n, V): 0 - exp(lp) * g_t off the targets
    grad[at] = lp_t.exp().mul_(-g_t).add_(g_t).to(grad_dtype)  # g_t - exp(lp_t) * g_t, rounded once as the rest is
    return nll, grad


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,  # noqa: ANN001
        h: torch.Tensor,  # (N, C) final hidden states, float32
        w: torch.Tensor,  # (V, C) the head's weight
        b: torch.Tensor | None,  # (V,) its bias (an untied head may have one)
        targets: torch.Tensor,  # (N,) int64, IGNORE_INDEX where nothing is predicted
        divisor: torch.Tensor,  # () float32: the number of kept targets (or the caller's num_items)
        grads: bool,  # autograd is recording: make the gradients (else the loss only, as for a validation loss)
        compute: torch.dtype | None,  # autocast's dtype for the two matmuls (None: the inputs' own)
        upcast: bool,  # those matmuls as float32 products of the cast operands, rounded once (lowp.autocast_upcast)
        padded: int,  # the vocabulary the matmuls run over, >= V (padded_vocab)
        chunk: int | None,  # rows per chunk (None: chunk_rows for the device)
    ) -> torch.Tensor:
        N, V = h.shape[0], w.shape[0]
        Vp = max(V, padded)
        keep = targets != IGNORE_INDEX  # (N,)
        safe = torch.where(keep, targets, 0)
        need = [grads and n for n in ctx.needs_input_grad[:3]]
        grad_h = torch.empty_like(h) if need[0] else None
        grad_w = w.new_zeros((Vp, w.shape[1])) if need[1] else None  # (Vp, C); its first V rows are returned
        grad_b = b.new_zeros(Vp) if b is not None and need[2] else None
        # Under autocast the matmuls run as autocast runs the head (inputs cast, products in that dtype) and the
        # logits are upcast to float32 before the log-softmax, as transformers' loss upcasts them.
        hm = h if compute is None else h.to(compute)
        wm, bm = _padded(w, Vp, compute), None if b is None else _padded(b, Vp, compute)
        # The gradient products run in `gcompute`. Under fp16 that is float32: this loss makes its gradients in forward,
        # before backward brings a GradScaler's scale (2**16 and up), and the logits' gradient, about 1/(N x V) per
        # entry, would mostly fall below fp16's smallest subnormal (6e-8) if cast unscaled, as the reference casts
        # it only after the scale multiplied it. bf16 has float32's range.
        gcompute = None if compute is torch.float16 else compute
        keep_dtype = gcompute is compute or not any(need)
        hg, wg = (hm, wm) if keep_dtype else (h.float(), _padded(w, Vp, torch.float32))
        if upcast:  # float32 copies of the cast operands, made once; the low-precision ones are not kept
            hm, wm, bm = hm.float(), wm.float(), None if bm is None else bm.float()
            hg, wg = (hm, wm) if keep_dtype else (hg, wg)
        R = chunk or chunk_rows(h.device.type, Vp)
        rows = min(N, R)
        buf = torch.empty((rows, Vp), dtype=torch.float32, device=h.device)  # logits -> log-probs -> gradient
        # torch's log-softmax kernels read float32 logits here: their half-to-float form, which would read autocast's
        # low-precision logits itself, takes fp16 alone on CUDA ("conversion is supported for Half type only", torch
        # 2.11's libtorch_cuda) and nothing on the CPU
        private = USE_PRIVATE_OPS and not compiling()
        nll_grad = torch.zeros_like(buf) if any(need) and private else None
        grad_dtype = (gcompute or torch.float32) if any(need) else None
        step = -(1.0 / divisor)  # () float32, rounded as nll_loss's backward rounds it
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        mm = torch.mm if gcompute is None or not upcast else (lambda a, b: mm_upcast(a, b, gcompute))
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, N, R):
                hc = hm[s : s + R]
                logits = buf[: hc.shape[0]]
                if compute is not None and not upcast:
                    logits.copy_(F.linear(hc, wm, bm))  # (n, C) @ (C, Vp) in `compute`, upcast
                elif bm is None:
                    torch.mm(hc, wm.t(), out=logits)  # (n, C) @ (C, Vp), as F.linear runs it
                else:
                    torch.addmm(bm, hc, wm.t(), out=logits)
                if upcast:  # the float32 product rounded once to `compute`, as its GEMM rounds it
                    logits.copy_(logits.to(compute))
                if Vp > V:
                    logits[:, V:] = -math.inf  # the pad takes no probability and gets no gradient
                go = None if nll_grad is None else nll_grad[: hc.shape[0]]
                # the logits' gradient in `gcompute` where there is one: cast back, as the upcast's backward casts it
                nll, g = nll_and_logit_grad(logits, safe[s : s + R], keep[s : s + R], step, grad_dtype, go)
                total += nll
                if g is None:
                    continue
                if grad_h is not None:
                    if compute is None:
                        torch.mm(g, wg, out=grad_h[s : s + R])  # (n, Vp) @ (Vp, C)
                    else:
                        grad_h[s : s + R] = mm(g, wg)
                if grad_w is not None:
                    if compute is None:
                        grad_w.addmm_(g.t(), hg[s : s + R])  # (Vp, n) @ (n, C)
                    else:  # each chunk's product in `gcompute`, summed in float32
                        grad_w += mm(g.t(), hg[s : s + R])
                if grad_b is not None:
                    grad_b.add_(g.sum(0))
        # Intermediates (not inputs or outputs), so kept on ctx and handed over in backward: with the usual incoming
        # gradient of 1 the tensors themselves become the gradients (no copy of the (V, C) head gradient).
        ctx.made = [grad_h, None if grad_w is None else grad_w[:V], None if grad_b is None else grad_b[:V]]
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # noqa: ANN001, ANN205
        if ctx.made is None:
            raise RuntimeError(
                "linear_cross_entropy: a second backward through the same loss (its gradients were handed over)"
            )
        made, ctx.made = ctx.made, None
        # the usual incoming gradient of 1, known without a device sync (on the CPU, outside torch.compile): the made
        # tensors are the gradients; otherwise they are scaled in place (they are this loss's own; by 1.0 the values
        # stay the same)
        if not (host_readable(grad_out) and float(grad_out) == 1.0):
            for t in made:
                if t is not None:
                    t.mul_(grad_out.to(t.dtype))
        return made[0], made[1], made[2], None, None, None, None, None, None, None


def _positive_int(value: object, what: str, meaning: str) -> int:
    """`value` when it is a positive integer; else UsageError naming `what` (the flag or argument it came from)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{what} must be a positive integer ({meaning}), got {value!r}")
    return value


def check_pad_multiple(multiple: object, what: str) -> int:
    """`multiple` when it is a valid padding multiple (a positive integer, 1: no padding); else UsageError naming
    `what`."""
    return _positive_int(multiple, what, "1: no padding")


def padded_vocab(V: int, multiple: int) -> int:
    """V rounded up to a multiple of `multiple` (50257 -> 50304 for 64, 50304 for 128 too; 1: V itself)."""
    return -(-V // multiple) * multiple


def _padded(t: torch.Tensor, rows: int, dtype: torch.dtype | None) -> torch.Tensor:
    """t in `dtype` (None: its own) with zero rows appended up to `rows`; t itself (or its cast) when it has them."""
    dtype = dtype or t.dtype
    if t.shape[0] == rows:
        return t if t.dtype == dtype else t.to(dtype)
    out = t.new_zeros((rows, *t.shape[1:]), dtype=dtype)  # (Vp, C) or (Vp,)
    out[: t.shape[0]] = t  # cast while copied: one pass, as the cast alone would be
    return out


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    num_items: int | torch.Tensor | None = None,
    pad_multiple: int = 1,
    chunk: int | None = None,
) -> torch.Tensor:
    """Mean float32 cross-entropy of `F.linear(h, weight, bias)` against `targets` already aligned (loss.cross_entropy's
    rule: IGNORE_INDEX skipped, the mean over kept targets or the sum / num_items), without the logits.

    h: (..., C); targets: (...). Called once per forward: its backward hands out gradients made in its forward.
    pad_multiple: the matmuls run over the head padded with zero rows to a multiple of this (GPU GEMMs run their
    fast kernels on aligned sizes: nanoGPT's 50304); the pad's logits are -inf, so the loss and the gradients are
    those of the V real rows (rounded as the longer rows round), and the weight keeps its V rows.
    chunk: rows of logits made at once (None: `chunk_rows` for the device; the benchmark times others).
    """
    C = h.shape[-1]
    flat_t = targets.reshape(-1).long()  # (N,)
    if num_items is None:
        divisor = (flat_t != IGNORE_INDEX).sum().to(torch.float32)
    elif isinstance(num_items, torch.Tensor):
        divisor = num_items.to(device=h.device, dtype=torch.float32)
    else:  # a fill on the device: a tensor made from a Python number would be copied there, and the host would wait
        divisor = torch.full((), float(num_items), dtype=torch.float32, device=h.device)
    grads = torch.is_grad_enabled()
    compute = autocast_dtype(h.device.type)
    upcast = compute is not None and autocast_upcast(h) == compute
    padded = padded_vocab(weight.shape[0], check_pad_multiple(pad_multiple, "pad_multiple"))
    if chunk is not None:
        _positive_int(chunk, "chunk", "rows of logits at once")
    flat_h = h.reshape(-1, C)  # (N, C)
    return _LinearCrossEntropy.apply(flat_h, weight, bias, flat_t, divisor, grads, compute, upcast, padded, chunk)
