"""Greedy decode loops the benchmark times: ours through the product path (`model.generate`: on CUDA the fixed-shape
step replayed as a CUDA graph, `cuda_graph=False` runs it eagerly; on the CPU the DecodePlan over a growing cache),
and transformers' `generate` with its default dynamic cache or its static one (eager, or compiled as generate compiles
it on a GPU).

Every loop returns the generated token ids, so a run can check that both implementations produced the same text.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from gpt2_port.generate import Generation, generate_full, steps
from gpt2_port.model import GPT2

# transformers' generate as greedy_hf and first_difference run it: greedy, exactly max_new_tokens (no EOS stop)
HF_GREEDY = dict(min_new_tokens=None, do_sample=False, num_beams=1, pad_token_id=50256, eos_token_id=None)


@torch.inference_mode()
def greedy_ours(
    model: GPT2,
    ids: torch.Tensor,
    new_tokens: int,
    cuda_graph: bool = True,
    compile_step: str | None = None,
    fused_kernels: bool | None = None,
    attention: list[SDPBackend] | None = None,
    linear_kernel: bool = True,
    split_attention: bool = True,
) -> torch.Tensor:
    """(B, P) prompt -> (B, new_tokens) greedy continuation through `generate` (the product path), no EOS stop. On
    CUDA with `cuda_graph` a step that was not replayed as a CUDA graph (its capture failed: the same step ran
    eagerly) is an error, so the row timed under the graph's name is the graph; with `compile_step` (a torch.compile
    backend: `generate --compile`) so is a step that did not run compiled. `fused_kernels`: generate's (None: its
    default, the fused step on CUDA; False: `generate --op-for-op`). `attention`: the SDPA kernels the static step
    may run for this call, in place of its one-kernel attention (steps.STATIC_BACKENDS and steps.ATTENTION_KERNEL,
    put back after; None: the library's). `linear_kernel=False`: the fused step's matmuls as torch's (cuBLAS's), after
    add_norm.py's kernel, in place of model/norm_linear.py's kernels (steps.LINEAR_KERNEL, put back after).
    `split_attention=False`: the attention kernel one program a head however long the cache (steps.SPLIT_ATTENTION,
    put back after)."""
    opts = dict(do_sample=False, eos_token_id=None, cuda_graph=cuda_graph, compile_step=compile_step or False)
    opts["fused_kernels"] = fused_kernels
    saved = steps.STATIC_BACKENDS, steps.ATTENTION_KERNEL, steps.LINEAR_KERNEL, steps.SPLIT_ATTENTION
    if attention is not None:
        steps.STATIC_BACKENDS, steps.ATTENTION_KERNEL = attention, False
    steps.LINEAR_KERNEL = saved[2] and linear_kernel
    steps.SPLIT_ATTENTION = saved[3] and split_attention
    try:
        g = generate_full(model, ids, new_tokens, **opts)
    finally:
        steps.STATIC_BACKENDS, steps.ATTENTION_KERNEL, steps.LINEAR_KERNEL, steps.SPLIT_ATTENTION = saved
    if compile_step and not g.extra["step"].endswith("(compiled)"):
        raise RuntimeError(f"the decode step ran as {g.extra['step']!r}, not compiled (see the log)")
    return _continuation(model, g, ids, new_tokens, cuda_graph)


@torch.inference_mode()
def sampled_ours(model: GPT2, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, seed: int = 0) -> torch.Tensor:
    """A left-padded (B, P) batch -> (B, new_tokens) sampled rows (top-k 50, seeded) through `generate`, no EOS stop;
    on CUDA a step not replayed as a CUDA graph is an error, as in `greedy_ours`."""
    g = generate_full(
        model, ids, new_tokens, attention_mask=mask, do_sample=True, top_k=50, seed=seed, eos_token_id=None
    )
    return _continuation(model, g, ids, new_tokens, cuda_graph=True)


def _continuation(model: GPT2, g: Generation, ids: torch.Tensor, new_tokens: int, cuda_graph: bool) -> torch.Tensor:
    """The new tokens of `generate_full`'s result `g`, checked: exactly `new_tokens` of them, and on CUDA with
    `cuda_graph` every step replayed as the CUDA graph (a failed capture runs the same step eagerly, and a row timed
    under the graph's name must not time that)."""
    if cuda_graph and model.device.type == "cuda" and not g.extra["step"].startswith("cuda graph"):
        raise RuntimeError(f"the decode step ran as {g.extra['step']!r}, not as a CUDA graph (see the log)")
    out = g.sequences
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate produced {out.shape[1] - ids.shape[1]} tokens, asked for {new_tokens}")
    return out[:, ids.shape[1] :]


@torch.inference_mode()
def greedy_hf(
    ref: torch.nn.Module, ids: torch.Tensor, new_tokens: int, static: bool = False, compiled: bool = False
) -> torch.Tensor:
    """transformers' generate, greedy, exactly new_tokens (no EOS stop); its dynamic cache, or its static cache
    (`cache_implementation="static"`, the fixed-shape cache transformers recommends with torch.compile). With the
    static cache on a GPU, generate compiles the decoding forward by itself (torch.compile, "reduce-overhead": CUDA
    graphs): `compiled` lets it, otherwise `disable_compile` keeps the row eager, as its name says."""
    if compiled and not static:
        raise ValueError("greedy_hf: transformers compiles its decoding forward with the static cache only")
    extra = {"cache_implementation": "static", "disable_compile": not compiled} if static else {}
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, **HF_GREEDY, **extra)
    if compiled and not hasattr(ref, "_compiled_call"):  # generate skips compiling where its criteria fail, silently
        raise RuntimeError("transformers' generate ran its static-cache forward eagerly: nothing was compiled")
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, asked for {new_tokens}")
    return out[:, ids.shape[1] :]


@torch.inference_mode()
def first_difference(ref: torch.nn.Module, ids: torch.Tensor, theirs: list[int], ours: list[int]) -> dict:
    """Where our greedy continuation of the (1, P) prompt `ids` leaves transformers' (`theirs`, from `greedy_hf` on
    `ref`), and how far apart the two tokens were in transformers' own scores at that step: the scores `generate`
    chose from (its greedy run again, to that step, with output_scores), its token's minus ours. 0 is a tie in
    transformers' own arithmetic, which its argmax broke by the lower id: a token either side of a tie is as right as
    the other, and the texts part there. `reference_top2_gap`: its best score minus its second best."""
    k = same_prefix(ours, theirs)
    if k == min(len(ours), len(theirs)):
        raise ValueError("first_difference: the two continuations do not differ")
    opts = dict(output_scores=True, return_dict_in_generate=True)
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k + 1, **HF_GREEDY, **opts)
    if out.sequences[0, ids.shape[1] :].tolist() != theirs[: k + 1]:
        raise RuntimeError("transformers' greedy run did not repeat its own tokens: its kernels are not deterministic")
    scores = out.scores[k][0].float()  # (V,)
    top2 = scores.topk(2).values
    return {
        "step": k,
        "reference_margin": float(scores[theirs[k]] - scores[ours[k]]),
        "reference_top2_gap": float(top2[0] - top2[1]),
    }


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two greedy continuations share before their first difference (after it, positions compare
    continuations of different texts: counting matches there would mean nothing)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
