"""int8 decode on CPU: every Linear of the blocks, and the (tied) head, as int8 weights with per-output-channel scales.

Weights are quantized once, symmetrically per output row (scale = max|w_row| / 127, zero point 0), and packed for
fbgemm (torch's x86 quantized backend). At run time `torch.ops.quantized.linear_dynamic` quantizes each input tensor
to 7-bit unsigned integers on the fly (one scale and zero point per call), multiplies in int8 with int32
accumulation, and rescales to float32. So this is dynamic W8A8, made as accurate as weight-only int8 by a second
pass over the activations' quantization residual (see Int8Linear). On a 2-core AVX2 CPU it was the only int8 kernel
faster than float32: torch's weight-only `_weight_int8pack_mm` and `torch._int_mm` were 10-50x slower there (see
BENCHMARKS.md). LayerNorm, attention, the KV cache and the embedding lookups stay float32.

    model = GPT2.from_pretrained("gpt2")          # float32, CPU
    model = quantize_int8(model)                  # in place; returns the same model

Inference only: an int8 layer has no float weight to update and no backward, so it raises UsageError when run in
train mode or with a gradient wanted; `check_trainable(model)` is the check training code makes before it starts.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from ..errors import UsageError
from ..io.load import listed, nonfinite_tensors

log = logging.getLogger(__name__)


def _engine() -> str:
    engines = torch.backends.quantized.supported_engines
    for e in ("x86", "fbgemm"):
        if e in engines:
            return e
    raise UsageError(
        f"int8 needs torch's x86/fbgemm quantized backend, which this torch build lacks "
        f"(supported: {', '.join(engines) or 'none'}); use --dtype float32 or bfloat16"
    )


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (int8 (N, K), float32 scale (N,)): symmetric per output row, w ~= q * scale[:, None]."""
    w = w.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scale


class Int8Linear(nn.Module):
    """y = x @ W^T + b with W held as packed int8 (per-row scales); float32 in, float32 out, CPU only.

    exact_activations (default): a second int8 pass over the activations' quantization residual
    (y = W q(x) + W q(x - q(x))): the error becomes that of weight-only int8 (the residual's own rounding is ~1/128 of
    the first), for one more kernel call whose weights are then in cache. False: one pass, faster, with ~2% error per
    layer from the 7-bit activations.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, exact_activations: bool = True, name: str = "int8 layer"
    ) -> None:
        super().__init__()
        self.name = name  # the replaced Linear's name in the model, for errors
        self.training = False  # inference only: created in eval mode (model.train() makes the forward refuse)
        self.exact = exact_activations
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_rows(weight)
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # torch flags its quantized tensor types as deprecated; the ops still ship
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
            torch.quantize_per_tensor_dynamic(torch.zeros(1), torch.quint8, True)  # its once-only warning, silenced
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32).clone(), requires_grad=False)
        self.register_buffer("scale", scale, persistent=False)
        self.nbytes = q.numel() + scale.numel() * 4 + (0 if bias is None else bias.numel() * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        if self.training or (x.requires_grad and torch.is_grad_enabled()):
            raise UsageError(
                f"{self.name} is int8: int8 layers run inference only (this call is in train mode or wants a "
                "gradient); call model.eval() under torch.no_grad(), or load the float32 checkpoint to train"
            )
        if x.device.type != "cpu":  # the packed weight is a CPU object that .to() does not move
            raise UsageError(f"{self.name} is int8 and runs on the CPU only; got its input on {x.device}")
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if not bool(torch.isfinite(x2).all()):  # the dynamic quantizer has no scale for them (torch raises inside)
            raise UsageError(
                f"{self.name} is int8 and its input holds NaN or Inf: an activation overflowed before it (int8 "
                "quantizes finite activations only; the float32 model says where)"
            )
        # reduce_range: 7-bit activations, as fbgemm needs (its u8 x s8 pair sums saturate int16 with 8 bits)
        y = torch.ops.quantized.linear_dynamic(x2, self._packed, True)  # (M, N)
        if self.exact:  # the same quantization fbgemm applied (same qparams), so r is exactly what it dropped
            r = x2 - torch.quantize_per_tensor_dynamic(x2, torch.quint8, True).dequantize()
            y += torch.ops.quantized.linear_dynamic(r, self._packed, True)
        if self.bias is not None:
            y += self.bias
        return y.view(*shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (N, K), float32 (computed on each access: for inspection, not for the forward)."""
        w, _ = torch.ops.quantized.linear_unpack(self._packed)
        return w.dequantize()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


LINEARS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def quantize_int8(model: nn.Module, head: bool = True, exact_activations: bool = True) -> nn.Module:
    """Replace every block Linear (q, k, v, attn c_proj, c_fc, mlp c_proj), and the head if `head`, by Int8Linear.

    In place, and returns the model. The model must be float32 on CPU. The tied head keeps `wte` for the embedding
    lookup (one row per token) and gets its own int8 copy for the logits. Irreversible: reload to get float32 back.
    """
    if model.device.type != "cpu":
        raise UsageError(f"int8 runs on CPU only (the model is on {model.device}); use --device cpu")
    if model.dtype != torch.float32:
        raise UsageError(f"int8 quantizes a float32 model (this one is {model.dtype}); load it with dtype float32")
    bad = nonfinite_tensors(dict(model.named_parameters()))
    if bad:
        raise UsageError(
            f"int8: non-finite weights: {listed(bad)} (expected finite values to quantize; check the checkpoint)"
        )
    torch.backends.quantized.engine = _engine()
    n = 0
    for i, block in enumerate(model.h):
        for path in LINEARS:
            parent_name, name = path.split(".")
            parent = getattr(block, parent_name)
            lin = getattr(parent, name)
            if isinstance(lin, Int8Linear):
                continue
            setattr(parent, name, Int8Linear(lin.weight, lin.bias, exact_activations, f"h.{i}.{path}"))
            n += 1
    if head and not isinstance(model.lm_head, Int8Linear):
        model.lm_head = Int8Linear(model.head_weight, None, exact_activations, "lm_head")
        n += 1
    model.eval().requires_grad_(False)
    log.info(
        "quantized %d linear layers to int8 (per-row weights, dynamic uint8 activations, %s)",
        n,
        torch.backends.quantized.engine,
    )
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in model.modules())


def check_trainable(model: nn.Module) -> None:
    """UsageError when the model holds int8 layers (they have no float weights to update and no backward): training
    code calls this before its first step, so the error names the cause rather than a later step's symptom."""
    int8 = [name for name, m in model.named_modules() if isinstance(m, Int8Linear)]
    if int8:
        raise UsageError(
            f"the model is quantized to int8 ({len(int8)} layers, e.g. {int8[0]}) and cannot be trained: int8 "
            "layers have no float weights and no backward; load the float32 checkpoint to train"
        )
