"""The three ways a decode step runs, each with `prefill(ids, mask)` and `next(tok, slot)` -> (B, 1, C) ln_f output:

- `ForwardSteps`: `model.forward` every step (train mode, recorded activations, the manual attention, or no cache);
- `PlanSteps`: model/decode.py's DecodePlan over a cache that grows by one slot a step (the CPU's default: the
  forward's ops without module dispatch, bit-identical to the forward);
  on CUDA both attend with SDPA's cuDNN kernel excluded: their keys grow by one a step, and cuDNN builds an execution
  plan for every new key length (bf16 on an H100 ran 10x slower than float32 with it: 4.9 ms of host time a call);
  so does every prefill (each prompt length is a new shape);
- `StaticSteps`: DecodePlan.static_step over a StaticKVCache, every shape fixed for the whole generation, captured
  as a CUDA graph on CUDA (the GPU's default; `cuda_graph=False`: the same step run eagerly). It too attends with
  cuDNN's kernel excluded on CUDA (`STATIC_BACKENDS`): the masked SDPA then runs the memory-efficient kernel (or the
  math one); whether cuDNN's, which transformers' compiled static step ran in its CUDA graph at half that kernel's
  time, pays in ours is still to measure. The captured graph and the eager fallback run the same kernel either way.
  The fused step on CUDA (below) attends through model/decode_attention.py's one kernel instead (`ATTENTION_KERNEL`),
  the cache write included.
  A captured step is kept on the model for the next call with the same batch, length bucket (cache.static_len),
  dtype and attention kernels; it holds the model only weakly, so `del model` frees the model, its kept caches and
  their graphs without waiting for the garbage collector.
  With `compile_step` (`generate --compile`) the static step goes through torch.compile first (`CompiledStep`: one
  graph, static shapes, traced once per kept step; inductor fuses each block's layer norms, GELU and residual adds:
  about 10 kernels a block in its code read on the CPU), then is captured as above. On CUDA the static step runs
  fewer kernels than the forward's ops (`fused_kernels`, DecodePlan.static_step: torch's one tanh-GELU kernel for
  the eight ops of gelu_new, in bf16/fp16 in c_fc's matmul, and each residual add with the layer norm after it as
  one Triton kernel, model/add_norm.py, and the cache write with the attention as another): 11 kernels a block
  fewer in bf16, 10 in float32, in a step whose time on a GPU is mostly its launches; and for up to 4 rows each
  matmul as one kernel with the add and norm before it (model/norm_linear.py, `LINEAR_KERNEL`): five a block.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from ..devices import (
    VARYING_SHAPE_BACKENDS,
    attention_backends,
    autocast_dtype,
    error_chain,
    out_of_memory,
    without_cudnn_attention,
)
from .cache import KVCache, StaticKVCache, static_len
from .cuda_graph import CapturedStep
from .protocol import CausalLM

log = logging.getLogger(__name__)

_KEPT_LOCK = threading.Lock()  # the kept steps of every model: looked up and taken by one thread at a time
KEEP_CAPTURED = 4  # captured steps kept per model (each holds its cache: 2 x n_layer x B x L x C values)
# The SDPA kernels the static step may run on CUDA: cuDNN's excluded, as for the steps whose shapes vary. Its shapes
# are fixed, so cuDNN would plan once there; whether its kernel pays in the captured step is what the GPU benchmark's
# rows `ours, cuDNN attention` and `ours, math attention` measure, each setting this for its call (transformers'
# compiled static step ran cuDNN's at 4.9 us a layer on an H100 where ours ran the memory-efficient one at 9.7).
STATIC_BACKENDS = VARYING_SHAPE_BACKENDS
# The fused static step's attention (generate's on CUDA) as model/decode_attention.py's one kernel: the token's key and
# value stored and attended over the cache in one launch a block. False: the cache write and SDPA with STATIC_BACKENDS
# (what the GPU benchmark's SDPA rows set for their call, beside the default).
ATTENTION_KERNEL = True
# The fused static step's matmuls as model/norm_linear.py's kernels (on CUDA, batches of up to 4 rows), each with the
# residual add and the layer norm before it: five kernels a block. False: add_norm.py's kernel and torch's matmuls
# (what the GPU benchmark's row `ours, cuBLAS matmuls` sets for its call, beside the default).
LINEAR_KERNEL = True
# The attention kernel may split a long cache over several programs a head, with a kernel that combines them
# (model/decode_attention_triton.py: caches of 512 slots or more with few rows and heads). False: one program a head
# (what the GPU benchmark's row `ours, attention unsplit` sets for its call).
SPLIT_ATTENTION = True


class ForwardSteps:
    name = "forward"
    capture_s = 0.0  # time spent recording a CUDA graph (StaticSteps), so far
    fused_kernels = False  # fewer kernels than the forward's ops (StaticSteps on CUDA: DecodePlan.static_step)
    inputs = None  # a StaticKVCache whose step inputs the tokens may be fed into as they are taken (StaticSteps)

    def held(self) -> contextlib.AbstractContextManager:
        """A context for the generation that runs these steps: a StaticSteps' is its own until it ends; these are
        made for one generation anyway."""
        return contextlib.nullcontext(self)

    def __init__(self, model: CausalLM, seq: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None) -> None:
        self.model, self.seq, self.mask, self.cache = model, seq, mask, cache
        self.device = model.device

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        with without_cudnn_attention(self.device):
            return self.model(ids, attention_mask=mask, cache=self.cache, last_only=True, hidden_only=True)

    def next(self, tok: torch.Tensor, slot: int) -> torch.Tensor:
        S = slot + 1
        mask = self.mask[:, :S] if self.mask is not None else None
        with without_cudnn_attention(self.device):
            if self.cache is None:  # the whole sequence again
                return self.model(self.seq[:, :S], attention_mask=mask, last_only=True, hidden_only=True)
            seq = self.seq[:, slot:S]
            return self.model(seq, attention_mask=mask, cache=self.cache, last_only=True, hidden_only=True)


class PlanSteps(ForwardSteps):
    name = "plan"

    def __init__(self, model: CausalLM, plan, seq: torch.Tensor, mask: torch.Tensor | None, cache: KVCache) -> None:  # noqa: ANN001
        super().__init__(model, seq, mask, cache)
        self.plan = plan

    def next(self, tok: torch.Tensor, slot: int) -> torch.Tensor:
        S = slot + 1
        mask = self.mask[:, :S] if self.mask is not None else None
        with without_cudnn_attention(self.device):
            return self.plan.step(self.seq[:, slot:S], self.cache, mask)


class CompiledStep:
    """`fn` through torch.compile (`backend`, one whole graph, static shapes: the static step's every shape is the
    generation's), compiled on the first call. A first call that fails (no C compiler, no triton, a backend error;
    out of memory aside, which the eager step would meet too) is logged once and `fn` runs eagerly from then on: the
    same step uncompiled. Errors of later calls are the step's own and raised as they are (one met while a CUDA graph
    records it is the capture's: CapturedStep's to handle).

    `fn` gets a code object of its own: dynamo keeps its compiled entries per code object, and counts them against
    its recompile limit (8), which steps made from one function (every StaticSteps' `step`: other batch sizes, lengths,
    dtypes) would share and, past the limit, fail to compile."""

    def __init__(self, fn: Callable[[], torch.Tensor], backend: str | Callable) -> None:
        self.fn = fn
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        self.compiled = torch.compile(own, fullgraph=True, dynamic=False, backend=backend)
        self.failed = False
        self.compile_s = 0.0  # the first call's time: the compile (waited for where it runs eagerly)

    def __call__(self) -> torch.Tensor:
        if self.failed:
            return self.fn()
        if self.compile_s > 0.0:
            return self.compiled()
        t0 = time.perf_counter()
        try:
            out = self.compiled()
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager step, which is the same
            if out_of_memory(e):
                raise
            *_, root = error_chain(e)  # a backend's own error, which dynamo wraps (BackendCompilerFailed)
            why = (str(root).strip().splitlines() or [""])[0]  # dynamo's messages run on for lines of hints
            name = type(root).__name__
            log.warning("the decode step could not be compiled (%s: %s); it runs uncompiled", name, why)
            self.failed = True
            return self.fn()
        self.compile_s = time.perf_counter() - t0
        return out


class StaticSteps:
    def __init__(  # noqa: ANN001
        self,
        model: CausalLM,
        plan,
        cache: StaticKVCache,
        cuda_graph: bool,
        compile_step: str | Callable | None = None,
        fused_kernels: bool = False,
    ) -> None:
        self._model = weakref.ref(model)  # kept on the model: a strong reference would be a cycle
        self.plan, self.cache, self.fused_kernels = plan, cache, fused_kernels
        device = model.device  # type: ignore[attr-defined]
        views = plan.cache_views(cache)
        self.backends = backends = list(STATIC_BACKENDS)
        self.attention_kernel = kernel = ATTENTION_KERNEL
        self.linear_kernel = linear = LINEAR_KERNEL
        self.split_attention = split = SPLIT_ATTENTION

        def step() -> torch.Tensor:
            with attention_backends(device, backends):  # the kernel the graph records, and the same when run eagerly
                return plan.static_step(
                    cache, views, fused_kernels, kernel, linear_kernel=linear, split_attention=split
                )

        self.compiled = CompiledStep(step, compile_step) if compile_step else None
        body = self.compiled or step
        self.run = CapturedStep(body, cache.bias.device) if cuda_graph else body
        self.busy = False  # a generation runs it (static_steps gives it to no other until `held` ends)

    @contextlib.contextmanager
    def held(self) -> Iterator[StaticSteps]:
        """The generation that static_steps gave this step to runs inside: the step (its cache, its graph) is free
        for another generation when it ends, however it ends."""
        try:
            yield self
        finally:
            self.busy = False

    @property
    def name(self) -> str:
        """The step as generate reports it: "cuda graph", "static", or "static (capture failed)"; with
        " (compiled)" or " (compile failed)" after it where compiling was asked for."""
        if not isinstance(self.run, CapturedStep):
            name = "static"
        else:
            name = "static (capture failed)" if self.run.eager else "cuda graph"
        if self.compiled is not None:
            name += " (compile failed)" if self.compiled.failed else " (compiled)"
        return name

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """(B, T) prompt -> (B, 1, C): the forward fills the cache, then the step's inputs are set for the first new
        token."""
        cache = self.cache
        cache.length = 0
        # a reused cache: an earlier generation's keys and values must not reach the masked slots (a NaN there would
        # pass through the attention's additive mask)
        cache.zero_()
        model = self._model()
        with without_cudnn_attention(model.device):  # type: ignore[union-attr]  # each prompt length a new shape
            h = model(ids, attention_mask=mask, cache=cache, last_only=True, hidden_only=True)  # type: ignore[misc]
        cache.start(mask, ids.shape[1])
        return h

    @property
    def capture_s(self) -> float:
        """The time spent making the step, not decoding: the CUDA graph's warm-up (which compiles, where asked) and
        capture, or the uncaptured compiled step's first call."""
        if isinstance(self.run, CapturedStep):
            return self.run.capture_s
        return self.compiled.compile_s if self.compiled is not None else 0.0

    @property
    def inputs(self) -> StaticKVCache:
        """The cache whose step inputs the token-taking kernel may set (generate/accept.py), where `next` would."""
        return self.cache

    def next(self, tok: torch.Tensor, slot: int) -> torch.Tensor:
        """(B,) tokens -> (B, 1, C); the step's inputs set here unless this slot was fed already (by the kernel
        that took the tokens into the sequence)."""
        if self.cache.fed != slot:
            self.cache.feed(tok, slot)
        return self.run()


def static_steps(  # noqa: ANN001
    model: CausalLM,
    plan,
    batch: int,
    max_len: int,
    cuda_graph: bool,
    compile_step: str | Callable | None = None,
    fused_kernels: bool = False,
) -> StaticSteps:
    """The model's static step for this batch, length and dtype: made (and captured) on first use, then reused. Its
    cache has `static_len(max_len)` slots, so nearby lengths share it. A captured graph reads the weights where they
    were: a model whose parameters were replaced or moved (`.to(...)`) gets a new one, and the steps kept for its old
    weights are dropped then (they would hold the old weights' memory, their caches and graphs, and never run again).

    A step is one generation's until that generation ends (`StaticSteps.held`): another that asks meanwhile (one a
    callback of the first starts, or another thread's) gets a step of its own, kept beside it, where sharing its cache
    would mix the two generations' keys and values. The returned step is held: run it inside its `held()`."""
    kept: OrderedDict = model.__dict__.setdefault("_static_steps", OrderedDict())
    weights = tuple(p.data_ptr() for p in model.parameters())
    length = static_len(max_len, model.config.n_positions)
    # inference mode makes inference tensors, which a later call outside it may not write: kept apart; a graph
    # records the arithmetic of the autocast it was captured under, so autocast's state is part of the key too
    amp = autocast_dtype(model.device.type)
    key = (batch, length, model.dtype, str(model.device), cuda_graph, compile_step, fused_kernels)
    key += (tuple(STATIC_BACKENDS), ATTENTION_KERNEL, LINEAR_KERNEL, SPLIT_ATTENTION)  # the kernels a step records
    key += (torch.is_inference_mode_enabled(),)
    key += (amp,)
    with _KEPT_LOCK:  # taken and marked held at once: two threads never get one step
        for old in [k for k in kept if k[-1] != weights]:
            del kept[old]
        copy = 0  # the first of this key's steps that no generation holds, else a new one
        while (key, copy, weights) in kept and kept[key, copy, weights].busy:
            copy += 1
        if copy:
            log.info(
                "a generation with the same shapes is running (a callback's or another thread's): this one "
                "makes a static step of its own"
            )
        at = (key, copy, weights)
        if at in kept:
            kept.move_to_end(at)
            steps = kept[at]
        else:
            cache = StaticKVCache(model.config, batch, length, model.dtype, model.device)
            kept[at] = steps = StaticSteps(model, plan, cache, cuda_graph, compile_step, fused_kernels)
            while len(kept) > KEEP_CAPTURED:  # the least recently used (a held one only leaves the dict)
                kept.popitem(last=False)
        steps.busy = True
    return steps


def decode_steps(model: CausalLM, B: int, L: int, seq: torch.Tensor, mask: torch.Tensor | None, how: dict):  # noqa: ANN201
    """The step kind a generation of B rows and L tokens (prompt and new) runs: static on CUDA (captured unless
    how["cuda_graph"] is False), the plan elsewhere, the forward where no shortcut may run. `seq`: (B, L) ids the
    forward and plan steps read their token from; `mask`: (B, L) or None; `how`: use_cache, fast_step, static_cache
    (None: on CUDA or when compiling), cuda_graph, compile_step (a torch.compile backend for the static step, or
    None), fused_kernels (the static step in fewer kernels than the forward's ops, DecodePlan.static_step; None: on
    CUDA)."""
    plan = model.decode_plan() if how["use_cache"] and how["fast_step"] else None
    if plan is None and how["fast_step"] and model.intercepted():
        log.info("a record, an edit or a module's forward hook is active: every decode step runs the forward")
    static = how["static_cache"]
    if static is None:
        static = model.device.type == "cuda" or bool(how["compile_step"])
    options = (("compile_step", "compiles the static step"), ("fused_kernels", "fuses the static step's kernels"))
    for option, what in options:
        if how[option] and (plan is None or not static):
            log.info(
                "%s %s: this generation's step (%s) runs without it",
                option,
                what,
                "the forward" if plan is None else "the plan over a growing cache",
            )
    if plan is not None and static:
        cuda_graph = how["cuda_graph"] and model.device.type == "cuda"
        fused_kernels = how["fused_kernels"]
        if fused_kernels is None:
            fused_kernels = model.device.type == "cuda"
        return static_steps(model, plan, B, L, cuda_graph, how["compile_step"] or None, bool(fused_kernels))
    cache = KVCache(model.config, B, L, model.dtype, model.device) if how["use_cache"] else None
    if plan is not None and cache is not None:
        return PlanSteps(model, plan, seq, mask, cache)
    return ForwardSteps(model, seq, mask, cache)
