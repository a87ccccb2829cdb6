"""N AdamW steps on the parity prompts, taken by either side with the same optimizer (llm.c's check), and the clip
norm summed over transformers' tensors on both sides."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from gpt2_port.config import GPT2Config

from .grads import decays, prompt_shares, read_losses
from .storage import moments_on_disk

# Both sides step with torch's single-tensor AdamW, whatever the device: on CUDA torch would pick its multi-tensor
# (foreach) kernels by default, which take a per-tensor fallback for our q/k/v views (strided, not dense) and the
# fused path for transformers' contiguous weights; the single-tensor loop does the same arithmetic per element
# whatever the layout, and is what the CPU tests compare bit for bit.
ADAMW_IMPL = {"foreach": False, "fused": False}
ADAMW_NAME = "torch.optim.AdamW, single-tensor (foreach=False, fused=False)"


class StepLoss(NamedTuple):
    """One step's loss before its update: each prompt's share (prompt_shares) and their float32 sum."""

    total: float
    prompts: tuple[float, ...]


@dataclass(frozen=True)
class TrainConfig:
    """torch.optim.AdamW on both sides; weight decay only on 2+-dim weights (nanoGPT's and HF Trainer's groups)."""

    steps: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip: float = 1.0


def train_steps(
    model: torch.nn.Module,
    hf_names: dict[str, str],
    cfg: GPT2Config,
    forward: Callable,
    ids_list: Sequence[torch.Tensor],
    tc: TrainConfig,
    moments_dir: Path | None = None,
    clip_layout: Callable[[], Iterator[torch.Tensor]] | None = None,
) -> list[StepLoss]:
    """N AdamW steps on the same batch (llm.c's check); each step's loss before its update, and its prompts'.

    hf_names: the model's parameter name -> transformers' name; the decay groups are decided on the latter.
    moments_dir: keep AdamW's moments on disk there (moments_on_disk), for models whose training state does not fit.
    clip_layout: the gradients as transformers holds them (one at a time, in its parameter order), for the clip norm;
    None: the model's own gradients are transformers' (the reference itself). See clip_grad_norm.
    """
    named = list(model.named_parameters())
    decay = [p for n, p in named if decays(hf_names[n], cfg)]
    no_decay = [p for n, p in named if not decays(hf_names[n], cfg)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=tc.betas,
        eps=tc.eps,
        **ADAMW_IMPL,
    )
    if moments_dir is not None:
        moments_on_disk(opt, moments_dir)
    params = [p for _, p in named]
    losses = []
    for _ in range(tc.steps):
        opt.zero_grad(set_to_none=True)
        per_prompt = torch.stack([forward(model, ids, share) for ids, share in prompt_shares(ids_list)])
        loss = per_prompt.sum()
        loss.backward()
        layout = clip_layout() if clip_layout is not None else (p.grad for p in params if p.grad is not None)
        clip_grad_norm(params, layout, tc.clip)
        opt.step()
        losses.append(StepLoss(*read_losses(per_prompt, loss)))
    del opt
    if moments_dir is not None:  # this run's moments are done with: the next run's need the disk
        shutil.rmtree(moments_dir, ignore_errors=True)
    model.zero_grad(set_to_none=True)
    return losses


def clip_grad_norm(params: Sequence[torch.Tensor], layout: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s arithmetic (each gradient's 2-norm, the norm of those norms, the gradients
    scaled by min(1, max_norm / (total + 1e-6))), with the total norm taken over `layout`: the same gradients in
    transformers' tensors and order. The global norm is the same number either way, but its rounding depends on how
    the elements are grouped and summed; summed over our separate q/k/v it differs from transformers' one c_attn in
    the last bit, and ten AdamW steps of a large model amplify that (1.5B: 2e-4 on the loss by step 10). Summed
    the same way, the clip factor is the same float, so the steps compare the models and not the bookkeeping."""
    norms = [torch.linalg.vector_norm(g.contiguous(), 2.0) for g in layout]  # one tensor made at a time
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device))
    return total


def _ref_loss(ref: torch.nn.Module, ids: torch.Tensor, num_items: int) -> torch.Tensor:
    return ref(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=num_items).loss


def _scratch_loss(model: torch.nn.Module, ids: torch.Tensor, num_items: int) -> torch.Tensor:
    return model(ids, labels=ids, num_items_in_batch=num_items).loss
