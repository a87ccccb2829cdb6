"""Teacher-forced decoding: the logits a generation computes at each step when the tokens it feeds are given rather
than chosen. It runs the steps `generate` runs (steps.py `decode_steps`: the decode plan over a growing cache on the
CPU, the static cache, captured as a CUDA graph, on CUDA), so a checker can hold the cached path itself against a
reference's cached decoding, step by step.
"""

from __future__ import annotations

import torch

from .protocol import CausalLM
from .steps import decode_steps


@torch.inference_mode()
def forced_logits(
    model: CausalLM,
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    prompt_len: int,
    static_cache: bool | None = None,
    cuda_graph: bool = True,
    fast_step: bool = True,
) -> tuple[torch.Tensor, str]:
    """ids: (B, T) a (left-padded) prompt of `prompt_len` tokens, then the tokens to feed; attention_mask: (B, T), 1
    over the fed tokens, or None. -> (B, T - prompt_len + 1, V): the logits after the prompt (its prefill), then after
    each fed token (one decode step each), as generate computes them before choosing; and the step kind that ran
    (plan, static, cuda graph, forward). `fast_step=False`: the forward with the cache every step, the path generate
    takes with the manual attention or while anything records, edits or hooks the model."""
    B, T = ids.shape
    how = {"use_cache": True, "fast_step": fast_step, "static_cache": static_cache, "cuda_graph": cuda_graph}
    how["compile_step"], how["fused_kernels"] = None, None  # generate's own choices
    seq = ids.clone()  # the forward and plan steps read each token from it
    steps = decode_steps(model, B, T, seq, attention_mask, how)
    prompt_mask = None if attention_mask is None else attention_mask[:, :prompt_len]
    # each step's head on its own (B, 1, C) as soon as the step returns it, as generate runs it: a replayed CUDA
    # graph returns its one output buffer, which the next replay overwrites (and one matmul over all N would round
    # otherwise)
    with steps.held():
        logits = [model.head(steps.prefill(seq[:, :prompt_len], prompt_mask))]  # (B, 1, V) each
        for slot in range(prompt_len, T):
            logits.append(model.head(steps.next(seq[:, slot], slot)))
    return torch.cat(logits, 1), steps.name  # (B, N, V)
