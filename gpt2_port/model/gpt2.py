"""The GPT-2 model: token and position embeddings, the pre-LN blocks (modules.py), the final LayerNorm `ln_f` and a
head tied to `wte`; transformers' causal-LM loss when given labels (or nanoGPT's aligned targets); loading and
saving in the official layout (through io/, which reads and writes state dicts and never imports the model); and
`generate` (generate/'s mixin, written against the model's interface).

Module names follow Hugging Face (`wte`, `wpe`, `drop`, `h.{i}`, `ln_f`). The inference shortcuts (decode.py's
DecodePlan, generate's fast greedy head, the fused c_attn view, int8) ask `wants_grad` first and never run in train
mode or when a gradient is wanted. The forward does no host-device synchronisation: token ids and labels are range-
checked here only when they are on the CPU (where that costs no sync) and not under torch.compile; on an accelerator
they are checked where they enter (generate's inputs, the training data, the evaluation windows, the CLI).
Shapes: B batch, T new tokens, S keys (past + new), C n_embd, V vocab.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import GPT2Config
from ..devices import compiling, host_readable, value_range
from ..errors import UsageError
from ..generate.cache import KVCache
from ..generate.int8 import is_quantized
from ..generate.mixin import GenerationMixin
from ..io.load import Layout, LoadReport, contiguous_layout, read_state
from ..io.save import write_checkpoint
from ..io.tokenizer import find_files
from . import modules
from .c_attn import fused_qkv
from .decode import DecodePlan
from .fused import check_pad_multiple, linear_cross_entropy, padded_vocab
from .init import init_tensor_
from .loss import check_labels, cross_entropy, shift_labels
from .lowp import linear_wb, set_packed
from .masks import build_mask, check_positions, positions_from_mask
from .modules import AttnImpl, Block, Kernels, LayerNorm
from .taps import Editor, Hooks, Recorder, Taps

log = logging.getLogger(__name__)


class CausalLMOutput(NamedTuple):
    loss: torch.Tensor  # scalar, float32: transformers' causal-LM loss
    logits: torch.Tensor | None  # (B, T, V); None when the fast kernels computed the loss without them


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Skip torch's random init while the model is built on meta (every tensor is then replaced by the checkpoint's).

    On meta, nn.Embedding's normal_ goes through torch._refs and imports torch._dynamo: seconds of a cold load.
    """
    names = ("normal_", "uniform_", "kaiming_uniform_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda t, *args, **kwargs: t)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def from_pretrained(
    model: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    revision: str | None = None,
    check_finite: bool = False,
    cls: type[GPT2] | None = None,
    layout: Layout = "auto",
) -> tuple[GPT2, LoadReport]:
    """A checkpoint (directory, .safetensors file or Hub id) as a model in eval mode with gradients off, built on the
    meta device and filled with `load_state_dict(assign=True)` from the tensors io/load.py read (memory-mapped on the
    CPU: a float32 load peaks at about one copy of the weights), and the report of the load. `layout`: the weights
    as views of the checkpoint's tensors (transformers' layout, "checkpoint") or contiguous copies; "auto" copies
    only where the views are slow (bf16/fp16 on the CPU: io/load.py's contiguous_layout), and with the contiguous
    layout the weights are packed for oneDNN where that pays (`GPT2.set_packed_weights`)."""
    t0 = time.perf_counter()
    state, report = read_state(model, dtype, device, revision, check_finite, layout)
    with torch.device("meta"), _no_random_init():
        m = (cls or GPT2)(report.config)
    m.load_state_dict(state, strict=True, assign=True)
    m.eval().requires_grad_(False)
    if contiguous_layout(layout, m.dtype, m.device):
        m.set_packed_weights()
    m.load_report = report
    report.load_s = time.perf_counter() - t0
    log.info(
        "loaded %s (%s layers, %s params) as %s on %s in %.2fs",
        model,
        report.config.n_layer,
        f"{m.num_params():,}",
        m.dtype,
        m.device,
        report.load_s,
    )
    return m, report


class GPT2(GenerationMixin, nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.config = cfg
        self.taps = Taps()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)
        self.h = nn.ModuleList(Block(cfg, i, self.taps) for i in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        # Tied: no lm_head module at all, the head *is* wte.weight (one tensor). Untied: its own Linear.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False  # recompute each block in backward (train mode only)
        self.kernels: Kernels = "reference"  # "fast": gpt2_port.fused's kernels when training
        self.head_pad_multiple = 1  # the fused head-and-loss's vocabulary padded to a multiple of this (1: none)

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str],
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        revision: str | None = None,
        layout: Layout = "auto",
    ) -> GPT2:
        """Load a checkpoint (local directory, .safetensors file, or Hub id); `model.load_report` tells how it went.
        `layout`: "checkpoint" keeps q/k/v as views of c_attn; "auto" copies them apart for bf16/fp16 on the CPU."""
        return from_pretrained(model, dtype=dtype, device=device, revision=revision, cls=cls, layout=layout)[0]

    def save_pretrained(
        self, directory: str | os.PathLike[str], tokenizer_dir: str | os.PathLike[str] | None = None
    ) -> Path:
        """Write the official layout (io/save.py): config.json, model.safetensors, and the tokenizer files from
        `tokenizer_dir`, else from the checkpoint the model was loaded from, when either has them."""
        if is_quantized(self):
            raise UsageError(f"save_pretrained {directory}: the model is int8-quantized; save the float32 model")
        files = None
        if tokenizer_dir is not None:
            files = find_files(tokenizer_dir)
            if files is None:
                raise UsageError(
                    f"tokenizer directory {tokenizer_dir}: no vocab.json + merges.txt (or encoder.json + vocab.bpe)"
                )
        elif getattr(self, "load_report", None) is not None:
            files = self.load_report.checkpoint.tokenizer_files()
        return write_checkpoint(self.state_dict(), self.config, directory, files)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    def wants_grad(self) -> bool:
        """True in train mode, or when autograd records and a parameter needs a gradient: no inference shortcuts."""
        return modules.wants_grad(self)

    def intercepted(self) -> bool:
        """Whether something may read or change an activation in a forward: a `record` or `edit`, or a forward hook
        (or pre-hook) on any of the modules or on every module. The decode shortcuts, which call no module and
        pass no tap, stand aside then."""
        if self.taps.rec is not None:
            return True
        every = nn.modules.module
        if every._global_forward_hooks or every._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules())

    def decode_plan(self) -> DecodePlan | None:
        """The one-token decode step without module dispatch (decode.py), or None where the forward must run."""
        return DecodePlan.for_model(self)

    def set_attn_impl(self, impl: AttnImpl) -> None:
        """'sdpa' (default, torch's fused kernels) or 'manual' (the reference's eager arithmetic, hand-written)."""
        if impl not in ("sdpa", "manual"):
            raise UsageError(f"attention implementation must be 'sdpa' or 'manual', got {impl!r}")
        for b in self.h:
            b.attn.impl = impl

    def set_kernels(self, kernels: Kernels) -> GPT2:
        """'reference' (default: transformers' arithmetic op for op, bit-identical gradients) or 'fast'
        (gpt2_port.fused): the one-kernel tanh GELU when training, and the head fused with the loss in any forward
        given labels or targets (no logits are made; the output's logits are None). A forward that returns logits
        without training is the reference arithmetic, bit for bit."""
        if kernels not in ("reference", "fast"):
            raise UsageError(f"kernels must be 'reference' or 'fast', got {kernels!r}")
        self.kernels = kernels
        for b in self.h:
            b.mlp.kernels = kernels
        return self

    def set_head_padding(self, multiple: int) -> GPT2:
        """The fast kernels' fused head-and-loss runs its matmuls over the head padded with zero rows to a multiple
        of `multiple` (64: GPT-2's 50257 -> 50304, nanoGPT's; 1: none). The pad's logits are -inf: the loss and the
        gradients are those of the real rows, rounded as the longer rows round. The weights, the saved files and
        every forward that returns logits keep the vocabulary's own rows."""
        self.head_pad_multiple = check_pad_multiple(multiple, "head padding")
        return self

    def set_packed_weights(self, enabled: bool = True) -> GPT2:
        """Keep oneDNN-packed copies of the blocks' Linear weights and the head for bf16/fp16 inference on the CPU
        (lowp.py: one more copy of each packed weight, made on first use; where it pays on this CPU: bf16 decodes
        1.3x faster with AMX). A load in the contiguous layout turns it on. Training and other devices are untouched."""
        for block in self.h:
            a = block.attn
            fused = fused_qkv(a.q_proj, a.k_proj, a.v_proj)  # c_attn's one (3C, C) matmul, where q/k/v are views of it
            if fused is not None:
                set_packed(fused[0], enabled)
            for m in (a.q_proj, a.k_proj, a.v_proj):  # their own matmuls run only where they are not one c_attn
                if type(m) is nn.Linear:
                    set_packed(m.weight, enabled and fused is None)
            for m in (a.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                if type(m) is nn.Linear:
                    set_packed(m.weight, enabled)
        if self.lm_head is None or type(self.lm_head) is nn.Linear:
            set_packed(self.head_weight, enabled)
        return self

    def set_dropout(self, p: float) -> GPT2:
        """Set every dropout rate (embeddings, attention probabilities, residual branches) to p; config follows."""
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0 <= p < 1):
            raise UsageError(f"dropout must be a number in [0, 1), got {p!r}")
        self.config = self.config.with_dropout(float(p))
        for m in self.modules():
            if isinstance(m, nn.Dropout):
                m.p = float(p)
        return self

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> GPT2:
        """Initialise every parameter for training from scratch (init.py: transformers' and nanoGPT's rule)."""
        g = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        for name, p in self.named_parameters():
            init_tensor_(name, p, self.config, g)
        return self

    @contextlib.contextmanager
    def record(
        self, names: Iterable[str] | Callable[[str], bool] | None = None, keep_graph: bool = False
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Capture named activations during forward passes inside the block (each forward replaces the last one's):

        `embed`, `block.{i}.ln_1`, `block.{i}.attn.{q,k,v}` (B, nh, T, hs), `block.{i}.attn.scores` (B, nh, T, S:
        scaled and masked, masked keys at the dtype's lowest value), `block.{i}.attn.probs` (B, nh, T, S),
        `block.{i}.attn.merged` (B, T, C: the heads side by side, before c_proj), `block.{i}.attn.c_proj`,
        `block.{i}.resid_attn`, `block.{i}.ln_2`, `block.{i}.mlp.pre` (c_fc's output), `block.{i}.mlp.act`,
        `block.{i}.mlp.c_proj`, `block.{i}` (the block's output), `ln_f`, `logits`; `taps.tap_names` lists them.
        `names`: exact names, prefixes ending in '.' ('block.3.'), a predicate, or None (all). Asking for scores or
        probs runs that layer's attention the manual way (transformers' eager arithmetic, whose outputs differ from
        sdpa's in the last bits); no other tap changes a bit. Unknown names raise UsageError listing the valid ones.
        `keep_graph=True` keeps the tensors in the autograd graph with their gradients retained (read
        `acts[name].grad` after backward; on a model whose parameters need no gradient the graph starts at the
        embeddings). No block is recomputed (gradient checkpointing) while anything records or edits. Records nest,
        and see what edits made.
        """
        rec = Recorder(names, self.config.n_layer, keep_graph)
        with self._hooked(rec):
            yield rec.acts

    @contextlib.contextmanager
    def edit(self, edits: Mapping[str, Callable[[torch.Tensor], torch.Tensor | None]]) -> Iterator[None]:
        """Replace named activations (the names `record` takes, exactly) in forward passes inside the block: each
        function gets the tensor and returns its replacement (its dtype and device, its shape or one that broadcasts
        to it) or None (it changed the tensor in place: under no_grad only). Activation patching, ablation,
        steering: `with model.edit({"block.3": lambda t: clean})`. Edits nest (the outer one first) and the decode
        steps of `generate` run the forward while one is active."""
        with self._hooked(Editor(edits, self.config.n_layer)):
            yield

    @contextlib.contextmanager
    def _hooked(self, hook: Recorder | Editor) -> Iterator[None]:
        self.taps.rec = (self.taps.rec or Hooks()).adding(hook)
        try:
            yield
        finally:  # this hook only: contexts may end in another order than they began (an ExitStack, a generator)
            self.taps.rec = self.taps.rec.removing(hook) if self.taps.rec is not None else None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        hidden_only: bool = False,
        labels: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor | CausalLMOutput:
        """(B, T) token ids -> (B, T, V) logits ((B, 1, V) with last_only; ln_f's (B, T|1, C) with hidden_only).

        attention_mask: (B, S) 1 for real tokens, 0 for (left) padding, S = cached + new tokens.
        position_ids: (B, T); derived from attention_mask when it is given, else counted from the cache length.
        labels: (B, T) as transformers takes them (shifted inside, -100 ignored): returns CausalLMOutput(loss, logits).
        targets: (B, T) already aligned with the positions (nanoGPT's y windows, -100 ignored): the same output.
        num_items_in_batch: with labels or targets, the loss is their summed NLL divided by this count instead of
            their mean (transformers' kwarg: one divisor over the micro-batches of a gradient-accumulation step).
        """
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        S = past + T
        V = self.config.vocab_size
        if S > self.config.n_positions:
            raise UsageError(f"sequence of {S} tokens exceeds the context of {self.config.n_positions}")
        if input_ids.device != self.wte.weight.device:  # devices compared, no values read: no sync
            raise UsageError(
                f"input_ids are on {input_ids.device}, the model on {self.wte.weight.device}: pass "
                "input_ids.to(model.device) (and the same for attention_mask, labels and targets)"
            )
        if input_ids.numel() and host_readable(input_ids):
            lo, hi = value_range(input_ids)
            if lo < 0 or hi >= V:
                raise UsageError(f"input_ids: token id {lo if lo < 0 else hi} is out of range (expected 0 <= id < {V})")
        if labels is not None and targets is not None:
            raise UsageError("pass labels (shifted inside) or targets (already aligned), not both")
        if num_items_in_batch is not None:
            if labels is None and targets is None:
                raise UsageError("num_items_in_batch divides a loss: pass labels or targets with it")
            n = num_items_in_batch
            on_host = not torch.is_tensor(n) or n.device.type == "cpu"  # checked without a device sync
            if on_host and not float(n) > 0:
                raise UsageError(f"num_items_in_batch must be a positive count of targets, got {float(n):g}")
        for t in (labels, targets):
            if t is not None:
                check_labels(t, input_ids, V, partial=last_only or hidden_only, values=host_readable(t))
        check_positions(
            attention_mask,
            position_ids,
            (B, T, S),
            self.config.n_positions,
            values=all(host_readable(t) for t in (attention_mask, position_ids) if t is not None),
        )
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, past:]
            else:
                position_ids = torch.arange(past, S, device=input_ids.device)[None]
        x = self.drop(self._embed_tokens(input_ids) + self.wpe(position_ids))  # (B, T, C)
        if self.taps.rec is not None:
            if self.taps.rec.keep_graph and torch.is_grad_enabled() and not x.requires_grad:
                x.requires_grad_()  # parameters that need no gradient: activation gradients start from here
            x = self.taps.rec("embed", x)
        mask = build_mask(attention_mask, T, S, input_ids.device)
        # not while anything records or edits: a recomputation during backward would fire the taps again, replacing
        # recorded tensors (whose .grad the caller reads) with new ones that never get a gradient, calling each edit
        # twice, or, after the `with` has ended, not at all (and silently other gradients)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled() and self.taps.rec is None
        for block in self.h:
            x = checkpoint(block, x, mask, cache, use_reentrant=False) if recompute else block(x, mask, cache)
        if cache is not None:
            cache.length = S
        x = self.ln_f(x)
        if self.taps.rec is not None:
            x = self.taps.rec("ln_f", x)
        if last_only:
            x = x[:, -1:]
        if hidden_only:
            return x
        if labels is not None:
            targets = shift_labels(labels)
        if targets is not None and self._fused_loss():
            bias = None if self.lm_head is None else self.lm_head.bias
            loss = linear_cross_entropy(x, self.head_weight, bias, targets, num_items_in_batch, self.head_pad_multiple)
            return CausalLMOutput(loss, None)
        logits = self.head(x)  # (B, T, V)
        if targets is not None:
            return CausalLMOutput(cross_entropy(logits, targets, num_items=num_items_in_batch), logits)
        return logits

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """wte rows. Fast kernels, training, tied head, eager, on the CPU: the rows' gradient goes to wte as a sparse
        (B*T rows) tensor added into the head's dense one, instead of a dense (V, C) gradient made, filled and summed
        (a sparse gradient does not compile; under torch.compile the compiler fuses the dense one instead). Not on a
        GPU: there the sparse add is an index_add with atomics (repeated ids summed in a different order each run),
        and the dense embedding backward is deterministic."""
        fast = self.kernels == "fast" and self.lm_head is None and self.wants_grad() and self.wte.weight.requires_grad
        if fast and input_ids.device.type == "cpu" and not compiling():
            return F.embedding(input_ids, self.wte.weight, sparse=True)
        return self.wte(input_ids)

    def _fused_loss(self) -> bool:
        """The head fused with the loss: fast kernels, float32 weights (under autocast or not), nobody asking for
        the logits (a forward given labels or targets; with gradients or without, as a validation loss is)."""
        return (
            self.kernels == "fast"
            and self.dtype == torch.float32
            and (self.lm_head is None or type(self.lm_head) is nn.Linear)
            and not self.taps.wants("logits")
        )

    @property
    def loss_vocab(self) -> int:
        """The rows the head computes over in a forward given labels or targets: padded where it is fused with the
        loss (set_head_padding), the vocabulary's own elsewhere."""
        V = self.config.vocab_size
        return padded_vocab(V, self.head_pad_multiple) if self._fused_loss() else V

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(..., C) final hidden states -> (..., V) logits, through the `logits` tap. A replaced head (e.g. quantize's
        int8 head) is a module.

        One 2-D matmul over the rows, as transformers' head runs: x[:, -1:] is not contiguous, and a 3-D F.linear
        on it with a weight that needs no grad goes through bmm instead (measured: not bit-identical for B > 1,
        and 1.8x slower at 8 x 768 x 50257).
        """
        if self.lm_head is not None and type(self.lm_head) is not nn.Linear:
            logits = self.lm_head(x)
        else:
            w = self.head_weight
            b = None if self.lm_head is None else self.lm_head.bias
            logits = linear_wb(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])  # (N, C) -> (..., V)
        if self.taps.rec is not None:  # the `logits` tap: wherever the head runs (a forward, a decode step, eval)
            logits = self.taps.rec("logits", logits)
        return logits

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied head is one parameter, counted once
