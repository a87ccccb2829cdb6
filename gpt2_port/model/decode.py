"""One-token decode steps without module dispatch: the forward pass's own ops, gathered once per `generate` call.

A decode step of GPT-2 124M on a 2-core CPU spends ~20 ms reading weights and, through `GPT2.forward`, another ~2 ms
in Python: module calls, the recorder checks, the q/k/v fusion test, cache indexing, mask and position building,
about 25 module and 40 op dispatches per block. Here all of that is looked up once (the weights as tensors, the fused
c_attn view, per-layer cache views) and the same aten ops run on the same tensors in the same order:

    ln_1 -> one c_attn matmul, split -> attend (cache write, SDPA) -> c_proj -> residual add
    -> ln_2 -> c_fc -> gelu_new (op for op) -> mlp c_proj -> residual add;  ln_f at the end

(each residual add, the norm after it, the next block's ln_1 or ln_f, and the matmul after that, one `norm_linear`
call: torch's add, layer norm and matmul, the forward's ops, or on CUDA with `fused_kernels` one kernel for the add
and norm, add_norm.py, or for all three, norm_linear.py; a block hands the next the residual stream with its last
projection not yet added: a `Stream`).

`LayerStep` is that block step, written once. How a step attends is passed in: `DecodePlan.step` writes the
`KVCache` at its fill length and attends over the filled keys, so its hidden state is bit-identical to
`model(tok, cache=..., hidden_only=True)` (tests/test_decode.py checks it bitwise, per block against `Block.forward` and
for whole steps against the forward, with and without padding); `DecodePlan.static_step` attends over all slots of a
StaticKVCache with a mask, every shape fixed, so that generate/ can capture it once as a CUDA graph and replay it (its
tokens equal the dynamic step's; its sums run over the masked slots too, so its bits may differ; on CUDA generate runs
it with fewer kernels, `fused_kernels`: torch's one-kernel GELU, in c_fc's matmul on CUDA in bf16/fp16, and each
residual add with the layer norm after it as one kernel, add_norm.py). Both store a
token's key and value with one write a layer (KVCache.layers): with c_attn's one matmul they are one view of its output;
separate projections are stacked first. Neither carries logic of its own: no dropout, no taps, no module hooks.

Inference only: `for_model` gives no plan (and `step` refuses) in train mode or when a parameter needs a gradient, and
none while activations are recorded, edited or hooked, or the attention is the manual one; those go through
`GPT2.forward`. Linears that are not plain `nn.Linear` (e.g. int8) are called as modules.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import autocast_dtype
from ..errors import UsageError
from ..generate.cache import KVCache, StaticKVCache
from . import decode_attention
from .add_norm import Norm
from .c_attn import fused_qkv
from .fused import gelu_tanh
from .lowp import linear_wb
from .masks import build_mask, positions_from_mask
from .modules import Block, gelu_new, wants_grad
from .norm_linear import Lookup, Stream, Weights, add_norm_of, norm_linear, project

Linear = Callable[[torch.Tensor], torch.Tensor]  # (..., in) -> (..., out)
# attend(layer, q, kv): q (B, nh, 1, hs) and kv (2, B, nh, 1, hs), this token's key and value -> (B, nh, 1, hs); stores
# the key and value wherever it keeps them
Attend = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# each layer's keys and values, (B, nh, max_len, hs) each, and both as one (2, B, nh, max_len, hs) view
CacheViews = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def _linear(m: nn.Module) -> Linear:
    """A plain Linear as lowp.linear_wb over its own weight and bias (the forward's call, less the module call)."""
    if type(m) is nn.Linear:
        w, b = m.weight, m.bias
        return lambda x: linear_wb(x, w, b)
    return m


def _weights(m: nn.Module) -> Weights | None:
    return (m.weight, m.bias) if type(m) is nn.Linear else None


def gelu_in_epilogue(h: torch.Tensor, wb: Weights | None) -> bool:
    """Whether `gelu_projected` runs c_fc and its GELU as one `torch._addmm_activation` for the (B, 1, C) input h: on
    CUDA, with c_fc's weight and bias (a plain Linear), h and the weight in one 16-bit dtype, autocast off (it would
    cast them, which the forward's call does instead). There the op is the tanh GELU, in cuBLASLt's GELU-and-bias
    epilogue (one kernel at batch 1 too: `nvjet_..._gelubias` in an H100's profile, torch 2.11); on the CPU it is the
    erf GELU, another function, so never there. Float32 keeps the matmul and torch's GELU kernel apart: the
    epilogue's tanh is not established to round as torch's does."""
    if wb is None or wb[1] is None or h.dtype != wb[0].dtype or autocast_dtype(h.device.type) is not None:
        return False
    return h.device.type == "cuda" and h.dtype in (torch.bfloat16, torch.float16)


def gelu_projected(h: torch.Tensor, c_fc: Linear, wb: Weights | None) -> torch.Tensor:
    """(B, 1, C) -> (B, 1, 4C): the tanh GELU of c_fc(h). Where `gelu_in_epilogue` holds, one
    `torch._addmm_activation`: one cuBLASLt kernel computes the products, adds the bias and applies the GELU to the
    float32 sums before rounding once, where c_fc then torch's GELU kernel take two and round twice;
    else c_fc, then torch's one tanh-GELU kernel (fused.gelu_tanh)."""
    if not gelu_in_epilogue(h, wb):
        return gelu_tanh(c_fc(h))
    w, b = wb  # type: ignore[misc]
    out = torch._addmm_activation(b, h.reshape(-1, h.shape[-1]), w.t(), use_gelu=True)  # (B, 4C): W is (out, in)
    return out.view(*h.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class LayerStep:
    """One block's tensors and callables, looked up once; calling it runs `Block.forward` on one token per row."""

    layer: int
    ln_1: Norm
    qkv: Linear | None  # one (B, 1, C) -> (B, 1, 3C) matmul over the checkpoint's c_attn, when q/k/v are views of it
    qkv_wb: Weights | None  # that matmul's (3C, C) weight and bias
    q: Linear
    k: Linear
    v: Linear
    c_proj: Linear
    c_proj_wb: Weights | None
    ln_2: Norm
    c_fc: Linear
    c_fc_wb: Weights | None
    mlp_proj: Linear
    mlp_proj_wb: Weights | None
    eps: float
    n_head: int

    @staticmethod
    def of(block: Block) -> LayerStep:
        a = block.attn
        qkv = fused_qkv(a.q_proj, a.k_proj, a.v_proj)
        return LayerStep(
            layer=a.layer,
            ln_1=(block.ln_1.weight, block.ln_1.bias),
            qkv=None if qkv is None else (lambda x, w=qkv[0], b=qkv[1]: linear_wb(x, w, b)),
            qkv_wb=qkv,
            q=_linear(a.q_proj),
            k=_linear(a.k_proj),
            v=_linear(a.v_proj),
            c_proj=_linear(a.c_proj),
            c_proj_wb=_weights(a.c_proj),
            ln_2=(block.ln_2.weight, block.ln_2.bias),
            c_fc=_linear(block.mlp.c_fc),
            c_fc_wb=_weights(block.mlp.c_fc),
            mlp_proj=_linear(block.mlp.c_proj),
            mlp_proj_wb=_weights(block.mlp.c_proj),
            eps=block.ln_1.eps,
            n_head=a.n_head,
        )

    def __call__(self, stream: Stream, attend: Attend, fused: bool = False, linear: bool = False) -> Stream:
        """The residual stream with the projection before this block not yet added (x and d, or the embeddings'
        lookup) -> the same after this block: `Block.forward` in eval mode, written so that each residual add, the
        norm after it and the matmul after that are one `norm_linear` (and the block's last projection is added by
        the next block's, or by ln_f's `add_norm_of`). `fused`: with fewer kernels, the same function rounded
        otherwise: the GELU as torch's one tanh-GELU kernel (fused.gelu_tanh, not gelu_new's eight ops), in c_fc's
        matmul where it can be (`gelu_projected`), and each add with its norm as one kernel where one can run them
        (add_norm.in_kernel: CUDA). `linear` (with `fused`): each matmul as one kernel with the add and norm before it
        where norm_linear.py's can run them (CUDA, a few rows): five kernels a block."""
        eps, kernel = self.eps, fused and linear
        if self.qkv is not None:
            x, qkv = norm_linear(stream, self.ln_1, eps, self.qkv_wb, self.qkv, False, fused, kernel)  # (B, 1, 3C)
            B, _, C = x.shape
            nh, hs = self.n_head, C // self.n_head
            q = qkv[..., :C]
            kv = qkv[..., C:].view(B, 1, 2, nh, hs).permute(2, 0, 3, 1, 4)  # (2, B, nh, 1, hs): k and v, one view
        else:
            x, h = add_norm_of(stream, self.ln_1, eps, fused)
            B, _, C = x.shape
            nh, hs = self.n_head, C // self.n_head
            q = self.q(h)
            kv = torch.stack([self.k(h), self.v(h)]).view(2, B, 1, nh, hs).transpose(2, 3)  # (2, B, nh, 1, hs)
        q = q.view(B, 1, nh, hs).transpose(1, 2)  # (B, nh, 1, hs)
        y = attend(self.layer, q, kv).transpose(1, 2).reshape(B, 1, C)  # (B, 1, C): heads side by side
        d = project(y, self.c_proj, self.c_proj_wb, kernel)

        def mlp_in(h: torch.Tensor) -> torch.Tensor:  # (B, 1, C) -> (B, 1, 4C)
            return gelu_projected(h, self.c_fc, self.c_fc_wb) if fused else gelu_new(self.c_fc(h))

        x, act = norm_linear((x, d), self.ln_2, eps, self.c_fc_wb, mlp_in, True, fused, kernel)
        return x, project(act, self.mlp_proj, self.mlp_proj_wb, kernel)


class DecodePlan:
    """Every layer's `LayerStep`, the embeddings and ln_f, looked up once; `step` runs one token per row."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self._model = weakref.ref(model)  # a plan may be kept on its model (generate/steps.py): no cycle
        self.n_positions = cfg.n_positions
        self.eps, self.scale = cfg.layer_norm_epsilon, cfg.head_dim**-0.5
        self.layers = [LayerStep.of(block) for block in model.h]
        self.wte, self.wpe = model.wte.weight, model.wpe.weight
        self.ln_f = (model.ln_f.weight, model.ln_f.bias)

    @staticmethod
    def for_model(model: nn.Module) -> DecodePlan | None:
        """A plan, or None when the forward pass must run instead: train mode or gradients wanted, the manual
        attention, or activations recorded, edited or hooked (`GPT2.intercepted`)."""
        if wants_grad(model) or model.intercepted() or any(b.attn.impl != "sdpa" for b in model.h):
            return None
        return DecodePlan(model)

    def run(
        self, input_ids: torch.Tensor, pos: torch.Tensor, attend: Attend, fused: bool = False, linear: bool = False
    ) -> torch.Tensor:
        """(B, 1) ids and their positions ((B|1, 1) or (1,)) -> (B, 1, C) ln_f output, every block attending through
        `attend`. The token and position embeddings are looked up, added and normed by ln_1 in one `embed_norm` (or,
        with `linear`, in c_attn's kernel), each block's residual adds with the norm after them in one `add_norm` or
        the matmul after that (`fused`, `linear`: LayerStep's), and the last with ln_f."""
        stream: Stream = Lookup(input_ids, pos, self.wte, self.wpe)
        for layer in self.layers:
            stream = layer(stream, attend, fused, linear)
        return add_norm_of(stream, self.ln_f, self.eps, fused)[1]

    def attention(self, cache: KVCache, mask: torch.Tensor | None) -> Attend:
        """Attend as `GPT2.forward` does with `cache`: store k, v at the fill length, SDPA over the filled keys.

        mask: (B, 1, 1, S) from `build_mask` (left padding), or None (every key visible). Does not advance the cache.
        """
        ks, vs, kvs = self.cache_views(cache)
        past, S, scale = cache.length, cache.length + 1, self.scale

        def attend(i: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            kvs[i].narrow(3, past, 1).copy_(kv)  # the key and the value in one write
            keys, values = ks[i].narrow(2, 0, S), vs[i].narrow(2, 0, S)  # (B, nh, S, hs)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)

        return attend

    def static_attention(
        self, cache: StaticKVCache, views: CacheViews | None = None, kernel: bool = False, split: bool = True
    ) -> Attend:
        """Attend over all `max_len` slots of a StaticKVCache: store k, v at its slot tensor (index_copy_), SDPA with
        the (B, 1, 1, max_len) mask of the slots each row sees. Every shape is the generation's: capturable. `kernel`:
        both in one kernel where decode_attention.py's can run (CUDA), the same function rounded otherwise; `split`:
        that kernel may split a long cache over several programs a head (False: one a head).

        The mask is the cache's own additive one (`bias`: the values SDPA would make of the boolean, 0 where seen and
        -inf elsewhere, so the same arithmetic), read as it is where it is in q's dtype (SDPA takes an additive mask
        in q's dtype only; under autocast it is converted once a step, at the first layer): no kernel of the step
        makes it, where SDPA would convert a boolean in every layer."""
        kvs = (views or self.cache_views(cache))[2]
        mask, slot, scale = cache.bias, cache.slot, self.scale
        bias: list[torch.Tensor] = []  # this step's additive mask in q's dtype, (B, 1, 1, max_len)

        def attend(i: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            if kernel and decode_attention.in_kernel(q, kv, kvs[i], mask):
                return decode_attention.attend(q, kv, kvs[i], mask, slot, scale, lambda: sdpa(i, q, kv), split)
            return sdpa(i, q, kv)

        def sdpa(i: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            # the key and the value in one write, in the cache's dtype, as the dynamic step's copy_ stores them (under
            # autocast they come out of the matmul in bf16/fp16; index_copy_ does not cast)
            kvs[i].index_copy_(3, slot, kv.to(kvs[i].dtype))
            if not bias or bias[0].dtype != q.dtype:
                bias[:] = [mask.to(q.dtype)[:, None, None, :]]  # the cache's own tensor where the dtypes agree
            # the keys and values as views made here of the layer's tensor just written: views made before the step
            # and passed in would be inputs aliasing it, and torch.compile would copy the layer's whole cache out and
            # back around the write (inductor's code, read on the CPU); so made, it writes the one slot in place
            keys, values = kvs[i].unbind(0)  # (B, nh, max_len, hs) each
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias[0], scale=scale)

        return attend

    def static_step(
        self,
        cache: StaticKVCache,
        views: CacheViews | None = None,
        fused_kernels: bool = False,
        attention_kernel: bool = True,
        linear_kernel: bool = True,
        split_attention: bool = True,
    ) -> torch.Tensor:
        """One token per row from the cache's device inputs (tok, pos, slot, bias) -> (B, 1, C) ln_f output. No host
        value is read, so a CUDA graph can record it once and replay it for every token. `views`: the cache's
        `cache_views`, passed by a caller that looked them up once (StaticSteps).

        `fused_kernels`: the same function in fewer kernels, rounded otherwise (LayerStep's `fused`). The MLP's GELU as
        torch's one tanh-GELU kernel (fused.gelu_tanh) instead of the forward's eight ops (gelu_new): float32 1 ulp
        apart on about 1% of inputs; bf16/fp16 op for op rounds each of the eight results to its dtype, the kernel
        computes in float32 and rounds once; on CUDA in bf16/fp16 done with c_fc's matmul (`gelu_projected`: the
        epilogue of cuBLASLt's kernel). On a GPU, where a batch-1 decode step's time is its kernels' count more than
        their work, a block then launches 8 kernels fewer in bf16/fp16 (c_fc and its GELU in one) and 7 in float32
        (c_fc, then the GELU's one kernel) than op for op: in a profile of 124M on an H100 (torch 2.11, batch 1), 12.6
        kernels a block against 20.4 in bf16, 12.5 against 19.4 in float32. On CUDA each residual add and the layer norm
        after it are one Triton kernel too (add_norm.py: the sum torch's bit for bit, the norm within an ulp): 2 kernels
        a block and three a token fewer (the embeddings' lookups in the first); and with `attention_kernel` each block's
        cache write and attention one more (decode_attention.py): 1 a block fewer again. Adding a projection into the
        residual in its matmul instead saved no kernel there (torch's addmm of a bias took cuBLASLt's bias epilogue at
        batch 1 too) and rounded otherwise. With `linear_kernel` (and up to 4 rows) each matmul is one kernel with the
        add and norm before it (norm_linear.py: the residual sums torch's bit for bit, the projections' outputs as
        partial sums the next kernel adds): five kernels a block. `split_attention`: the attention kernel may split a
        long cache over several programs a head (decode_attention.py)."""
        attend = self.static_attention(cache, views, fused_kernels and attention_kernel, split_attention)
        return self.run(cache.tok, cache.pos, attend, fused_kernels, fused_kernels and linear_kernel)

    @staticmethod
    def cache_views(cache: KVCache) -> CacheViews:
        """Per-layer (B, nh, max_len, hs) keys and values of the cache, and (2, B, nh, max_len, hs) both: the lists
        the cache keeps."""
        return cache.k, cache.v, cache.layers

    def step(self, input_ids: torch.Tensor, cache: KVCache, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, 1) ids at position cache.length -> (B, 1, C) ln_f output, as `model(..., hidden_only=True)` gives.

        attention_mask: (B, S) over past + this token (left padding), or None when no row is padded.
        """
        model = self._model()
        if model is None or wants_grad(model):
            raise UsageError(
                "DecodePlan runs inference only: the model is in train mode or a parameter needs a gradient "
                "(call model.eval() and run under torch.no_grad(), or use model(...))"
            )
        past = cache.length
        S = past + 1
        if S > self.n_positions:
            raise UsageError(f"sequence of {S} tokens exceeds the context of {self.n_positions}")
        if attention_mask is not None:
            pos = positions_from_mask(attention_mask)[:, past:]  # (B, 1)
            mask = build_mask(attention_mask, 1, S, input_ids.device)  # (B, 1, 1, S)
        else:
            pos = torch.arange(past, S, device=input_ids.device)[None]  # (1, 1)
            mask = None
        h = self.run(input_ids, pos, self.attention(cache, mask))
        cache.length = S
        return h  # (B, 1, C)
