"""One side's loss and gradients on the parity prompts: transformers' (hooks on its modules) and the scratch model's
(its taps), each parameter named and laid out as transformers holds it, each activation point's gradient flattened.

Both sides run every prompt as its own batch of one with labels = the prompt's ids (transformers' shift inside); each
prompt's summed NLL is divided by n_prompts x its targets, so the prompts' losses add up to the mean of their means
and each backward starts from a gradient of exactly 1, as a training step's does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from gpt2_port.config import GPT2Config
from gpt2_port.io import adapter
from gpt2_port.io.load import listed

from .points import check_recorded
from .storage import LazyTensors

log = logging.getLogger(__name__)

PREFIX = "transformer."


def act_points(n_layer: int, logits: bool = True) -> list[str]:
    """The activation gradients compared. Without logits when the scratch model's fast kernels fuse the head with
    the loss (asking for the logits would turn the fusion off, and it is the fused path that is measured)."""
    return ["embed", *(f"block.{i}" for i in range(n_layer)), "ln_f", *(["logits"] if logits else [])]


def layer_of(point: str) -> str:
    """grad.transformer.h.3.mlp.c_fc.weight -> h.3; act_grad.block.3 (or act.block.3) -> h.3; wte/wpe/embed -> embed;
    the head."""
    kind, _, name = point.partition(".")
    if kind in ("act_grad", "act"):
        if name.startswith("block."):
            return "h." + name.split(".")[1]
        return {"embed": "embed", "ln_f": "ln_f", "logits": "head"}[name]
    name = name.removeprefix(PREFIX)
    if name.startswith("h."):
        return ".".join(name.split(".")[:2])
    if name.startswith(("wte.", "wpe.")):
        return "embed"
    return "ln_f" if name.startswith("ln_f.") else "head"


def layer_order(n_layer: int) -> list[str]:
    return ["embed", *(f"h.{i}" for i in range(n_layer)), "ln_f", "head"]


def hf_name_of_scratch(cfg: GPT2Config) -> dict[str, str]:
    """Scratch parameter name -> the transformers parameter it is (part of), from the adapter's one table."""
    out = {}
    for hk, _op, sks in adapter.key_table(cfg):
        hf = hk if hk == "lm_head.weight" else PREFIX + hk
        out.update({s: hf for s in sks})
    return out


def decays(hf_name: str, cfg: GPT2Config) -> bool:
    """Weight decay on 2+-dim weights only (matmul weights and embeddings; no biases, no LayerNorm): decided on
    transformers' names and shapes, so both sides' optimizer groups hold the same elements."""
    shapes = adapter.hf_shapes(cfg)
    return len(shapes[hf_name.removeprefix(PREFIX)]) >= 2


@dataclass
class Grads:
    loss: float  # the prompts' losses summed (the mean of their means: prompt_shares)
    params: Mapping[str, torch.Tensor]  # transformers' names, transformers' layout
    acts: dict[str, torch.Tensor]  # point -> activation gradients of every prompt, flattened and concatenated
    prompt_losses: tuple[float, ...]  # each prompt's share of `loss`
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # point -> the forward's activations, as `acts`


def read_losses(per_prompt: torch.Tensor, total: torch.Tensor) -> tuple[float, tuple[float, ...]]:
    """The total (the float32 sum's own value) and each prompt's share, as Python floats, in one read from the
    device."""
    *shares, t = torch.cat([per_prompt.detach(), total.detach()[None]]).tolist()
    return t, tuple(shares)


def prompt_shares(ids_list: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Each (1, T) prompt with its num_items_in_batch: its summed NLL is divided by n_prompts x its T - 1 targets.
    The prompts' losses then add up to the mean of their means, and each one's backward starts from a gradient of
    exactly 1, as a training step's does (the fast kernels' fused loss makes its gradients in forward, bit for bit
    the reference's for that incoming gradient; a mean over the prompts would hand it 1/n_prompts)."""
    return [(ids, len(ids_list) * (ids.numel() - ids.shape[0])) for ids in ids_list]


def _reference_forward(
    ref: torch.nn.Module, ids: torch.Tensor, n_layer: int, num_items: int
) -> tuple[torch.Tensor, dict]:
    """Loss of one prompt on transformers, with every act point kept in the graph and its gradient retained."""
    acts: dict[str, torch.Tensor] = {}
    paths = {"embed": "transformer.drop", "ln_f": "transformer.ln_f"}
    paths.update({f"block.{i}": f"transformer.h.{i}" for i in range(n_layer)})

    def make(name: str) -> Callable:
        def hook(_m: torch.nn.Module, _inp: tuple, out: object) -> None:
            t = out[0] if isinstance(out, tuple) else out
            t.retain_grad()
            acts[name] = t

        return hook

    handles = [ref.get_submodule(p).register_forward_hook(make(n)) for n, p in paths.items()]
    try:
        out = ref(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=num_items)
    finally:
        for h in handles:
            h.remove()
    out.logits.retain_grad()
    acts["logits"] = out.logits
    return out.loss, acts


def _scratch_forward(
    model: torch.nn.Module, ids: torch.Tensor, n_layer: int, num_items: int
) -> tuple[torch.Tensor, dict]:
    names = act_points(n_layer, model.kernels == "reference")
    with model.record(names, keep_graph=True) as acts:
        loss = model(ids, labels=ids, num_items_in_batch=num_items).loss
    check_recorded(acts, names, hint="")
    return loss, dict(acts)


def _batch_loss(forward: Callable, model: torch.nn.Module, ids_list: Sequence[torch.Tensor], n_layer: int):
    """The prompts' losses (each prompt a batch of one; see prompt_shares), (n_prompts,), and the act points of each."""
    losses, acts = [], []
    for ids, share in prompt_shares(ids_list):
        loss, a = forward(model, ids, n_layer, share)
        losses.append(loss)
        acts.append(a)
    return torch.stack(losses), acts


def reference_grads(ref: torch.nn.Module, ids_list: Sequence[torch.Tensor], n_layer: int) -> Grads:
    ref.zero_grad(set_to_none=True)
    losses, acts = _batch_loss(_reference_forward, ref, ids_list, n_layer)
    loss = losses.sum()
    loss.backward()
    params = {}
    for n, p in ref.named_parameters():
        params[n] = p.grad
        p.grad = None  # the dict keeps the only reference: no copy
    total, shares = read_losses(losses, loss)
    return Grads(total, params, _flat(acts, grad=True), shares, _flat(acts, grad=False))


def scratch_grads(model: torch.nn.Module, ids_list: Sequence[torch.Tensor], n_layer: int) -> Grads:
    model.zero_grad(set_to_none=True)
    losses, acts = _batch_loss(_scratch_forward, model, ids_list, n_layer)
    loss = losses.sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    missing = [n for n, g in grads.items() if g is None]
    if missing:  # a branch cut from the graph (a detach, a no_grad): zero gradients, which the report then fails
        log.warning("no gradient reached %s (cut from the graph): compared as zeros", listed(missing))
        grads.update({n: torch.zeros_like(p) for n, p in model.named_parameters() if n in missing})
    # transformers' layout (q/k/v fused, Conv1D transposed), one tensor at a time when read: no second full copy
    mapped = LazyTensors(adapter.hf_tensors(grads, model.config, prefix=PREFIX))
    total, shares = read_losses(losses, loss)
    return Grads(total, mapped, _flat(acts, grad=True), shares, _flat(acts, grad=False))


def _flat(acts: list[dict[str, torch.Tensor]], grad: bool) -> dict[str, torch.Tensor]:
    """Point -> every prompt's activation gradients (`grad`) or activations, flattened on the CPU and concatenated."""
    out = {}
    for name in acts[0]:
        out[name] = torch.cat([(a[name].grad if grad else a[name]).detach().to("cpu").flatten() for a in acts])
    return out
