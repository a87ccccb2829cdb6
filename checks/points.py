"""The comparison points, and capturing them from both models.

Scratch side: the model's named taps (`model.record`). Reference side: forward hooks on transformers' modules
(checks/reference.py):

    embed                   transformer.drop output
    block.{i}.ln_1          h.{i}.ln_1 output
    block.{i}.attn.q/k/v    h.{i}.attn.c_attn output, split in three and viewed as heads (B, nh, T, hs)
    block.{i}.attn.merged   h.{i}.attn.c_proj input (the attention output before c_proj, heads side by side)
    block.{i}.attn.c_proj   h.{i}.attn.c_proj output
    block.{i}.resid_attn    h.{i}.ln_2 input (the residual stream after attention)
    block.{i}.ln_2          h.{i}.ln_2 output
    block.{i}.mlp.pre       h.{i}.mlp.c_fc output (the MLP hidden before GELU)
    block.{i}.mlp.act       h.{i}.mlp.act output (the MLP hidden after GELU)
    block.{i}.mlp.c_proj    h.{i}.mlp.c_proj output
    block.{i}               h.{i} output
    ln_f                    transformer.ln_f output
    logits                  the model's output

Per-head points (`block.{i}.attn.q.h{j}`) are slices of the q/k/v points. The logit lens is the top-1 token of
ln_f(block output) @ wte.T at every position, computed by each model with its own ln_f and head.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from gpt2_port.errors import GPT2PortError, UsageError
from gpt2_port.model import GPT2
from gpt2_port.model.taps import BLOCK_POINTS, MANUAL_ATTENTION_POINTS

from .reference import capture_reference, reference_hooks

# In the order the block computes them; the block output `block.{i}` comes last.
# Not the scores and probs, which the sdpa path never forms (the attention command compares probs)
SUBLAYER_KINDS = [p for p in BLOCK_POINTS if p not in MANUAL_ATTENTION_POINTS]
QKV = ("attn.q", "attn.k", "attn.v")

# Reference module (under transformer.h.{i}) and what to take, for every sub-layer kind but q/k/v.
_REF_SUBLAYER = {
    "ln_1": ("ln_1", "output"),
    "attn.merged": ("attn.c_proj", "input"),
    "attn.c_proj": ("attn.c_proj", "output"),
    "resid_attn": ("ln_2", "input"),
    "ln_2": ("ln_2", "output"),
    "mlp.pre": ("mlp.c_fc", "output"),
    "mlp.act": ("mlp.act", "output"),
    "mlp.c_proj": ("mlp.c_proj", "output"),
}


def block_points(n_layer: int) -> list[str]:
    return ["embed", *(f"block.{i}" for i in range(n_layer)), "ln_f", "logits"]


def point_names(n_layer: int, detail: str = "block", per_head: bool = False, n_head: int = 0) -> list[str]:
    """Report points in forward order: embed, [sub-layer points and] block.{i} per layer, ln_f, logits."""
    if detail == "block":
        return block_points(n_layer)
    names = ["embed"]
    for i in range(n_layer):
        for kind in SUBLAYER_KINDS:
            names.append(f"block.{i}.{kind}")
            if per_head and kind in QKV:
                names += [f"block.{i}.{kind}.h{j}" for j in range(n_head)]
        names.append(f"block.{i}")
    return names + ["ln_f", "logits"]


BATCH = "batch."  # the prefix of the padded batch's points: batch.embed, batch.block.0, ...
DECODE = "decode.logits"  # the logits of generate's cached path, prefill and each decode step
DECODE_FORWARD = "decode.forward_steps.logits"  # the same through generate's other cached path, the forward's


def real_positions(acts: Mapping[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The padded batch's activations at its real tokens only, each point renamed `batch.NAME`: (B, T, ...) ->
    (N real, ...); q/k/v and their heads (B, nh, T, hs) -> (N real, nh, hs)."""
    keep = mask.bool()
    out = {}
    for n, t in acts.items():
        t = t.transpose(1, 2) if t.dim() == 4 else t  # (B, nh, T, hs) -> (B, T, nh, hs)
        out[BATCH + n] = t[keep.to(t.device)]
    return out


def is_head_point(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("h") and name.rsplit(".", 1)[-1][1:].isdigit()


def _reference_hooks(n_layer: int, detail: str) -> dict[str, tuple[str, str]]:
    hooks = reference_hooks(n_layer)
    if detail == "sublayer":
        for i in range(n_layer):
            base = f"transformer.h.{i}"
            hooks[f"block.{i}.attn.c_attn"] = (f"{base}.attn.c_attn", "output")
            for kind, (path, what) in _REF_SUBLAYER.items():
                hooks[f"block.{i}.{kind}"] = (f"{base}.{path}", what)
    return hooks


def _add_heads(acts: dict[str, torch.Tensor], names: Sequence[str]) -> None:
    for n in names:
        if n not in acts and is_head_point(n):
            parent, head = n.rsplit(".", 1)
            acts[n] = acts[parent][:, int(head[1:])]  # (B, nh, T, hs) -> (B, T, hs)


def transformed(model: GPT2, transform: Callable[[GPT2], GPT2 | None] | None) -> GPT2:
    """The scratch side of a comparison: gpt2_port's model as loaded, or what a porter's `transform` makes of it (the
    change to check: a patched module, a subclass, other kernels), given the model right after the load; it returns
    that model (changed in place, or None) or another GPT2 in the same dtype and on the same device, to which the
    checker's settings (attention, kernels, dropout, mode) then apply."""
    if transform is None:
        return model
    want = (model.dtype, model.device)  # before: the transform may change the model it is given in place
    try:
        out = transform(model)
    except GPT2PortError:
        raise
    except Exception as e:  # the porter's code: its error is theirs to read, in one line
        raise UsageError(f"the scratch change (--scratch) raised {e.__class__.__name__}: {e}") from e
    out = model if out is None else out
    if not isinstance(out, GPT2):
        raise UsageError(
            f"the scratch transform returned a {type(out).__name__}: expected a GPT2 (the one it was given, changed, "
            "or a subclass), whose taps the checker records"
        )
    if (out.dtype, out.device) != want:
        raise UsageError(
            f"the scratch transform left a model in {out.dtype} on {out.device}: this configuration runs "
            f"{want[0]} on {want[1]} (the checker loads each configuration's model itself: --dtype, --device)"
        )
    return out


def capture_scratch(
    model: GPT2, ids: torch.Tensor, names: Sequence[str], attention_mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """One forward of the scratch model on `ids`, recording the named taps (each must be recorded: a module that
    replaces one of gpt2_port's passes its tensors through `self.taps.rec` as the one it replaces does)."""
    with torch.inference_mode(), model.record(names) as acts:
        model(ids, attention_mask=attention_mask)
    check_recorded(acts, names)
    return dict(acts)


def check_recorded(
    acts: Mapping[str, torch.Tensor], names: Sequence[str], hint: str = ", or compare at --detail block"
) -> None:
    missing = [n for n in names if n not in acts]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UsageError(
            f"the scratch model recorded no {missing[0]!r}{more}: a module that replaces one of gpt2_port's must "
            "pass its tensors through `self.taps.rec(name, t)` as the one it replaces does (gpt2_port/model/"
            f"modules.py){hint}"
        )


@torch.inference_mode()
def logit_lens_top1(blocks: torch.Tensor, ln_f: torch.nn.Module, head: torch.Tensor) -> torch.Tensor:
    """Top-1 token of ln_f(h) @ head.T for block outputs stacked as (L, N, C) -> (L, N); one pass over the head."""
    L, N, C = blocks.shape
    h = blocks.to(device=head.device, dtype=head.dtype).reshape(L * N, C)
    return torch.matmul(ln_f(h), head.t()).argmax(-1).view(L, N).cpu()  # (L*N, V) -> (L, N)


@torch.inference_mode()
def capture_scratch_points(
    model: GPT2, ids: torch.Tensor, names: Sequence[str], attention_mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Named taps for every point in `names`; q/k/v as (B, nh, T, hs)."""
    taps = [n for n in names if not is_head_point(n)]
    acts = capture_scratch(model, ids, taps, attention_mask)
    _add_heads(acts, names)
    return acts


@torch.inference_mode()
def capture_reference_points(
    ref: torch.nn.Module,
    ids: torch.Tensor,
    names: Sequence[str],
    detail: str,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The same points from transformers' GPT2LMHeadModel through forward hooks (see the module docstring)."""
    cfg = ref.config
    n_layer, n_head = cfg.n_layer, cfg.n_head
    acts = capture_reference(ref, ids, _reference_hooks(n_layer, detail), attention_mask)
    if detail == "sublayer":
        for i in range(n_layer):
            qkv = acts.pop(f"block.{i}.attn.c_attn")  # (B, T, 3C)
            B, T, C3 = qkv.shape
            for kind, t in zip(QKV, qkv.split(C3 // 3, dim=2)):
                acts[f"block.{i}.{kind}"] = t.view(B, T, n_head, -1).transpose(1, 2)  # (B, nh, T, hs)
    _add_heads(acts, names)
    return acts
