"""The Conv1D-layout adapter: Hugging Face GPT-2 state dicts <-> the scratch model's state dict, driven by one table.

Hugging Face GPT-2 uses `Conv1D` modules whose weights are stored `[in, out]`; `c_attn` holds Q|K|V side by side
(`[n_embd, 3*n_embd]`). The scratch model uses `[out, in]` weights (as `nn.Linear`) and separate q/k/v projections.
Both layouts found in the wild are accepted: the official files (no prefix, a causal-mask buffer `h.{i}.attn.bias`
per layer, older `.bin` files also `h.{i}.attn.masked_bias`) and what `save_pretrained` writes (`transformer.` prefix,
no buffers, `lm_head.weight` only when untied). Transposes and splits are views: no weight is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..config import GPT2Config
from ..errors import CheckpointError, ConfigError

# (HF key suffix, operation, scratch key suffixes). "{i}" is the layer index. The one place the layouts are related.
LAYER_TABLE: list[tuple[str, str, tuple[str, ...]]] = [
    ("ln_1.weight", "copy", ("ln_1.weight",)),
    ("ln_1.bias", "copy", ("ln_1.bias",)),
    ("attn.c_attn.weight", "split_qkv_weight", ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight")),
    ("attn.c_attn.bias", "split_qkv_bias", ("attn.q_proj.bias", "attn.k_proj.bias", "attn.v_proj.bias")),
    ("attn.c_proj.weight", "transpose", ("attn.c_proj.weight",)),
    ("attn.c_proj.bias", "copy", ("attn.c_proj.bias",)),
    ("ln_2.weight", "copy", ("ln_2.weight",)),
    ("ln_2.bias", "copy", ("ln_2.bias",)),
    ("mlp.c_fc.weight", "transpose", ("mlp.c_fc.weight",)),
    ("mlp.c_fc.bias", "copy", ("mlp.c_fc.bias",)),
    ("mlp.c_proj.weight", "transpose", ("mlp.c_proj.weight",)),
    ("mlp.c_proj.bias", "copy", ("mlp.c_proj.bias",)),
]
TOP_TABLE: list[tuple[str, str, tuple[str, ...]]] = [
    ("wte.weight", "copy", ("wte.weight",)),
    ("wpe.weight", "copy", ("wpe.weight",)),
    ("ln_f.weight", "copy", ("ln_f.weight",)),
    ("ln_f.bias", "copy", ("ln_f.bias",)),
]
BUFFER_SUFFIXES = ("attn.bias", "attn.masked_bias")


def hf_shapes(cfg: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Expected HF-layout shapes (no prefix), without buffers; lm_head only when untied."""
    e, m, v, p = cfg.n_embd, cfg.d_mlp, cfg.vocab_size, cfg.n_positions
    per_layer = {
        "ln_1.weight": (e,),
        "ln_1.bias": (e,),
        "attn.c_attn.weight": (e, 3 * e),
        "attn.c_attn.bias": (3 * e,),
        "attn.c_proj.weight": (e, e),
        "attn.c_proj.bias": (e,),
        "ln_2.weight": (e,),
        "ln_2.bias": (e,),
        "mlp.c_fc.weight": (e, m),
        "mlp.c_fc.bias": (m,),
        "mlp.c_proj.weight": (m, e),
        "mlp.c_proj.bias": (e,),
    }
    out = {"wte.weight": (v, e), "wpe.weight": (p, e), "ln_f.weight": (e,), "ln_f.bias": (e,)}
    for i in range(cfg.n_layer):
        out.update({f"h.{i}.{k}": s for k, s in per_layer.items()})
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, e)
    return out


def key_table(cfg: GPT2Config, with_head: bool = True) -> list[tuple[str, str, tuple[str, ...]]]:
    """The full table for a config: (HF key without prefix, operation, scratch keys), layer by layer."""
    rows = list(TOP_TABLE)
    for i in range(cfg.n_layer):
        rows += [(f"h.{i}.{hk}", op, tuple(f"h.{i}.{s}" for s in sk)) for hk, op, sk in LAYER_TABLE]
    if with_head and not cfg.tie_word_embeddings:
        rows.append(("lm_head.weight", "copy", ("lm_head.weight",)))
    return rows


@dataclass
class Conversion:
    """The result of a conversion: the new state dict, and an account of every input tensor."""

    state: dict[str, torch.Tensor]
    mapping: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)  # (source key, op, target keys)
    dropped: list[str] = field(default_factory=list)  # buffers checked and dropped
    notes: list[str] = field(default_factory=list)


def _apply(op: str, t: torch.Tensor, e: int, contiguous: bool = False) -> list[torch.Tensor]:
    """One table operation on a checkpoint tensor: views of it, or (`contiguous`) [out, in] contiguous tensors, q/k/v
    then row blocks of one contiguous [3e, e] copy (still one c_attn: c_attn.py's "rows" layout)."""
    if op == "copy":
        return [t.contiguous() if contiguous else t]
    if op == "transpose":  # [in, out] -> [out, in], a view
        return [t.t().contiguous() if contiguous else t.t()]
    if op == "split_qkv_weight" and contiguous:  # [e, 3e] -> [3e, e] copy -> 3 x [e_out, e_in], contiguous views
        rows = t.t().contiguous()
        return [rows[j * e : (j + 1) * e] for j in range(3)]
    if op == "split_qkv_weight":  # [e, 3e] -> 3 x [e_out, e_in], views
        return [t[:, j * e : (j + 1) * e].t() for j in range(3)]
    if op == "split_qkv_bias":  # [3e] -> 3 x [e]
        return [t[j * e : (j + 1) * e] for j in range(3)]
    raise AssertionError(op)


def _check_mask(key: str, t: torch.Tensor, cfg: GPT2Config) -> None:
    if key.endswith("masked_bias"):
        if t.numel() != 1:
            raise CheckpointError(f"{key}: expected a scalar masked_bias buffer, found shape {tuple(t.shape)}")
        return
    if t.dim() != 4 or t.shape[:2] != (1, 1) or t.shape[2] != t.shape[3] or t.shape[2] < cfg.n_positions:
        raise CheckpointError(
            f"{key}: expected a causal mask of shape (1, 1, {cfg.n_positions}, {cfg.n_positions}), "
            f"found {tuple(t.shape)}"
        )
    n = t.shape[2]
    want = torch.tril(torch.ones(n, n, dtype=torch.bool))
    if not torch.equal(t[0, 0] != 0, want) or not bool(((t[0, 0] == 0) | (t[0, 0] == 1)).all()):
        raise CheckpointError(f"{key}: mask buffer is not a causal (lower-triangular 0/1) mask")


def hf_to_scratch(sd: Mapping[str, torch.Tensor], cfg: GPT2Config) -> Conversion:
    """HF GPT-2 state dict (either layout) -> scratch state dict. Every key is accounted for, or CheckpointError."""
    keys = list(sd.keys())
    prefixed = [k for k in keys if k.startswith("transformer.")]
    prefix = "transformer." if prefixed else ""
    if prefixed and len(prefixed) != len([k for k in keys if k != "lm_head.weight"]):
        odd = next(k for k in keys if not k.startswith("transformer.") and k != "lm_head.weight")
        raise CheckpointError(f"unexpected key {odd!r}: the other keys carry the 'transformer.' prefix")
    expected = hf_shapes(cfg)
    seen: set[str] = set()
    conv = Conversion(state={})
    e = cfg.n_embd

    # Unexpected keys first: they say most about a wrong file (a Llama checkpoint, a different model).
    for k in keys:
        bare = k.removeprefix(prefix) if k != "lm_head.weight" else k
        if bare in expected:
            continue
        parts = bare.split(".")
        if (
            len(parts) >= 3
            and parts[0] == "h"
            and parts[1].isdigit()
            and ".".join(parts[2:]) in BUFFER_SUFFIXES
            and int(parts[1]) < cfg.n_layer
        ):
            continue
        if k == "lm_head.weight":
            continue
        raise CheckpointError(f"unexpected key {k!r}: not part of a GPT-2 checkpoint with {cfg.n_layer} layers")

    def fetch(bare: str) -> torch.Tensor:
        k = bare if bare == "lm_head.weight" else prefix + bare
        if k not in sd:
            raise CheckpointError(f"missing key {k!r} (expected shape {expected[bare]})")
        t = sd[k]
        if tuple(t.shape) != expected[bare]:
            raise CheckpointError(f"key {k!r}: expected shape {expected[bare]}, found {tuple(t.shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"key {k!r}: expected a floating-point tensor, found {t.dtype}")
        seen.add(k)
        return t

    for hk, op, sks in key_table(cfg):
        t = fetch(hk)
        for sk, v in zip(sks, _apply(op, t, e)):
            conv.state[sk] = v
        conv.mapping.append((hk if hk == "lm_head.weight" else prefix + hk, op, sks))

    for k in keys:
        if k in seen:
            continue
        if k == "lm_head.weight":  # tied in the config, yet stored: accept only an exact copy of wte
            lm = sd[k]
            if tuple(lm.shape) != expected["wte.weight"] or not torch.equal(lm, conv.state["wte.weight"]):
                raise ConfigError(
                    "lm_head.weight differs from wte.weight, but the config says the head is tied "
                    "(set tie_word_embeddings: false in config.json)"
                )
            conv.dropped.append(k)
            conv.notes.append("lm_head.weight is a copy of wte.weight: dropped, the head is tied")
            continue
        _check_mask(k, sd[k], cfg)
        conv.dropped.append(k)
    return conv


def convert_sources(
    conv: Conversion,
    sd: Mapping[str, torch.Tensor],
    cfg: GPT2Config,
    fn: Callable[[torch.Tensor], torch.Tensor],
    contiguous: bool = False,
) -> dict[str, torch.Tensor]:
    """The scratch state dict again, with `fn` (a dtype or device move) applied to each checkpoint tensor once,
    before the table's views are taken: q, k and v split from one c_attn stay views of one tensor. `contiguous`:
    every tensor [out, in] and contiguous instead (one checkpoint tensor's copies made at a time; q, k and v the row
    blocks of one contiguous [3C, C] copy of c_attn, so that inference still runs c_attn's one matmul)."""
    state: dict[str, torch.Tensor] = {}
    for src, op, targets in conv.mapping:
        for key, view in zip(targets, _apply(op, fn(sd[src]), cfg.n_embd, contiguous)):
            state[key] = view
    return state


def hf_tensors(
    state: Mapping[str, torch.Tensor], cfg: GPT2Config, prefix: str = "transformer."
) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """Scratch state dict -> HF keys with a function making each tensor (one at a time: a writer streams them).

    Keys as `save_pretrained` writes them with `prefix`; no mask buffers; lm_head only if untied (never prefixed).
    """

    def make(op: str, ts: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
        def tensor() -> torch.Tensor:
            if op == "copy":
                t = ts[0]
            elif op == "transpose":
                t = ts[0].t()
            elif op == "split_qkv_weight":
                t = torch.cat([x.t() for x in ts], dim=1)  # 3 x (C, C) [out, in] -> (C, 3C) [in, out]
            else:
                t = torch.cat(ts, dim=0)
            return t.detach().contiguous()

        return tensor

    out = [(prefix + hk, make(op, [state[s] for s in sks])) for hk, op, sks in key_table(cfg, with_head=False)]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", make("copy", [state["lm_head.weight"]])))
    return out


def scratch_to_hf(
    state: Mapping[str, torch.Tensor], cfg: GPT2Config, prefix: str = "transformer."
) -> dict[str, torch.Tensor]:
    """Scratch state dict -> HF layout as `save_pretrained` writes it (prefix, no buffers, lm_head only if untied)."""
    return {k: make() for k, make in hf_tensors(state, cfg, prefix)}
