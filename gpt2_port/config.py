"""GPT-2 hyper-parameters: a frozen dataclass, presets by exact name, and readers for config.json / tensor shapes."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    n_positions: int = 1024
    vocab_size: int = 50257
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True
    n_inner: int | None = None  # MLP width; None means 4 * n_embd
    # Training-only settings, read from and written to config.json as transformers names them. Dropout is active in
    # train mode only (eval() output never depends on them); the official files say 0.1.
    embd_pdrop: float = 0.1  # after wte + wpe
    attn_pdrop: float = 0.1  # on the attention probabilities
    resid_pdrop: float = 0.1  # on the attention output and the MLP output, before each residual add
    initializer_range: float = 0.02  # std of the normal init of Linear and Embedding weights

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"config: {name} must be a positive integer, got {v!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        eps = self.layer_norm_epsilon
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (0 < eps < 1) or math.isnan(eps):
            raise ConfigError(f"config: layer_norm_epsilon must be a number in (0, 1), got {eps!r}")
        if self.n_inner is not None and (
            not isinstance(self.n_inner, int) or isinstance(self.n_inner, bool) or self.n_inner <= 0
        ):
            raise ConfigError(f"config: n_inner must be a positive integer or null, got {self.n_inner!r}")
        for name in ("embd_pdrop", "attn_pdrop", "resid_pdrop"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 <= v < 1):
                raise ConfigError(f"config: {name} must be a number in [0, 1), got {v!r}")
        r = self.initializer_range
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not (0 < r < 1) or math.isnan(r):
            raise ConfigError(f"config: initializer_range must be a number in (0, 1), got {r!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def d_mlp(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    def with_dropout(self, p: float) -> GPT2Config:
        """The same config with every dropout rate set to p (fine-tunes often use 0.0)."""
        return dataclasses.replace(self, embd_pdrop=p, attn_pdrop=p, resid_pdrop=p)

    def init_std(self, name: str) -> float:
        """The std of the normal init of matrix or embedding `name` (a scratch or checkpoint name): GPT-2's rule,
        initializer_range, with the residual projections `c_proj.weight` scaled by 1/sqrt(2 * n_layer) (the paper:
        "we scale the weights of residual layers at initialization by a factor of 1/sqrt(N) where N is the number
        of residual layers", two per block). Used by model/init.py and by io/demo.py's random checkpoints."""
        if name.endswith("c_proj.weight"):
            return self.initializer_range / math.sqrt(2 * self.n_layer)
        return self.initializer_range

    def num_params(self) -> int:
        """Parameter count with the head tied to wte (counted once)."""
        e, L, m = self.n_embd, self.n_layer, self.d_mlp
        per_block = 2 * 2 * e + (3 * e * e + 3 * e) + (e * e + e) + (e * m + m) + (m * e + e)
        n = self.vocab_size * e + self.n_positions * e + L * per_block + 2 * e
        if not self.tie_word_embeddings:
            n += self.vocab_size * e
        return n

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that the official checkpoints carry (transformers reads it as a GPT2Config)."""
        d: dict[str, Any] = {
            "activation_function": "gelu_new",
            "architectures": ["GPT2LMHeadModel"],
            "attn_pdrop": self.attn_pdrop,
            "bos_token_id": 50256,
            "embd_pdrop": self.embd_pdrop,
            "eos_token_id": 50256,
            "initializer_range": self.initializer_range,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "model_type": "gpt2",
            "n_ctx": self.n_positions,
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_layer": self.n_layer,
            "n_positions": self.n_positions,
            "resid_pdrop": self.resid_pdrop,
            "summary_activation": None,
            "summary_first_dropout": 0.1,
            "summary_proj_to_labels": True,
            "summary_type": "cls_index",
            "summary_use_proj": True,
            "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
            "vocab_size": self.vocab_size,
        }
        if self.n_inner is not None:
            d["n_inner"] = self.n_inner
        if not self.tie_word_embeddings:
            d["tie_word_embeddings"] = False
        return d


PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": GPT2Config(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": GPT2Config(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": GPT2Config(n_layer=48, n_embd=1600, n_head=25),
}


def preset(name: str) -> GPT2Config:
    """A preset by exact name: gpt2, gpt2-medium, gpt2-large, gpt2-xl."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}: expected one of {', '.join(PRESETS)}") from None


# Settings in a transformers GPT2Config that change the computation, and the only value this port implements.
_REQUIRED_VALUES: dict[str, Any] = {
    "activation_function": "gelu_new",
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


def from_hf_dict(d: Mapping[str, Any], source: str = "config.json") -> GPT2Config:
    """Read a transformers-style GPT-2 config dict. Unsupported settings raise ConfigError, never pass silently."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
    mt = d.get("model_type", "gpt2")
    if mt != "gpt2":
        raise ConfigError(f"{source}: model_type is {mt!r}, expected 'gpt2' (this tool only runs GPT-2)")
    for key, want in _REQUIRED_VALUES.items():
        if key in d and d[key] != want:
            raise ConfigError(f"{source}: {key}={d[key]!r} is not supported (gpt2_port implements {key}={want!r} only)")

    def get(key: str, *aliases: str, default: Any = None) -> Any:
        for k in (key, *aliases):
            if k in d:
                return d[k]
        if default is None:  # the handler below puts `source` in front, as for every "config: " message
            raise ConfigError(f"config: missing required key {key!r}")
        return default

    n_ctx = d.get("n_ctx")
    n_pos = get("n_positions", "max_position_embeddings", default=1024)
    if n_ctx is not None and n_ctx != n_pos:
        raise ConfigError(f"{source}: n_ctx={n_ctx!r} contradicts n_positions={n_pos!r}")
    tie = d.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise ConfigError(f"{source}: tie_word_embeddings must be true or false, got {tie!r}")
    try:
        return GPT2Config(
            n_layer=get("n_layer", "num_hidden_layers"),
            n_embd=get("n_embd", "hidden_size"),
            n_head=get("n_head", "num_attention_heads"),
            n_positions=n_pos,
            vocab_size=get("vocab_size", default=50257),
            layer_norm_epsilon=get("layer_norm_epsilon", default=1e-5),
            tie_word_embeddings=tie,
            n_inner=d.get("n_inner"),
            embd_pdrop=get("embd_pdrop", default=0.1),
            attn_pdrop=get("attn_pdrop", default=0.1),
            resid_pdrop=get("resid_pdrop", default=0.1),
            initializer_range=get("initializer_range", default=0.02),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {str(e).removeprefix('config: ')}") from None


def read_config_json(path: str | Path) -> GPT2Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config ({e.__class__.__name__}: {e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    return from_hf_dict(d, source=str(path))


def infer_from_shapes(shapes: Mapping[str, tuple[int, ...]]) -> GPT2Config:
    """Infer the config from HF-layout tensor shapes (keys with or without the 'transformer.' prefix)."""
    s = {k.removeprefix("transformer."): v for k, v in shapes.items()}
    if "wte.weight" not in s or "wpe.weight" not in s:
        raise ConfigError(
            "no config.json and no 'wte.weight'/'wpe.weight' tensors to infer one from: not a GPT-2 checkpoint"
        )
    for k in ("wte.weight", "wpe.weight"):
        if len(s[k]) != 2:
            raise ConfigError(
                f"no config.json, and tensor {k!r} has shape {tuple(s[k])}, expected 2 dimensions: "
                "not a GPT-2 checkpoint"
            )
    vocab, e = s["wte.weight"][0], s["wte.weight"][1]
    n_pos = s["wpe.weight"][0]
    layers = layer_indices(s)
    n_layer = max(layers) + 1 if layers else 0
    if n_layer == 0:
        raise ConfigError("no config.json and no 'h.{i}.*' tensors to count layers from")
    if len(layers) != n_layer:
        gap = next(i for i in range(n_layer) if i not in layers)  # lazily: n_layer may be absurd
        raise ConfigError(f"no config.json, and the layers are not numbered 0..{n_layer - 1}: no tensor 'h.{gap}.*'")
    # The head count is not in the shapes; the official sizes give it by width (head_dim 64).
    by_width = {c.n_embd: c.n_head for c in PRESETS.values()}
    n_head = by_width.get(e, e // 64 if e % 64 == 0 else 0)
    if n_head <= 0:
        raise ConfigError(f"no config.json, and n_head cannot be inferred for n_embd={e}: add a config.json")
    fc = s.get("h.0.mlp.c_fc.weight")
    n_inner = fc[1] if fc is not None and len(fc) == 2 and fc[1] != 4 * e else None
    tie = "lm_head.weight" not in shapes
    return GPT2Config(
        n_layer=n_layer,
        n_embd=e,
        n_head=n_head,
        n_positions=n_pos,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        n_inner=n_inner,
    )


def layer_indices(shapes: Mapping[str, object]) -> set[int]:
    """The block indices i named by 'h.{i}.*' keys (ASCII digits only; 'transformer.' prefix stripped)."""
    out = set()
    for k in shapes:
        parts = k.removeprefix("transformer.").split(".")
        if len(parts) > 2 and parts[0] == "h" and parts[1].isascii() and parts[1].isdigit():
            out.add(int(parts[1]))
    return out


def check_against_shapes(cfg: GPT2Config, shapes: Mapping[str, tuple[int, ...]], source: str = "config.json") -> None:
    """ConfigError naming the config key that the tensors contradict, checked before any per-tensor work.

    Only the whole-model facts are checked here (the layer count, and the widths that every tensor shares when the
    embedding, position and final-norm tensors agree with each other); a single odd tensor is left to the adapter,
    which names that tensor and the shape it expected.
    """
    s = {k.removeprefix("transformer."): tuple(v) for k, v in shapes.items()}
    layers = layer_indices(s)
    if layers and len(layers) == max(layers) + 1 and len(layers) != cfg.n_layer:
        raise ConfigError(
            f"{source}: n_layer={cfg.n_layer} contradicts the weights, which hold {len(layers)} layers "
            f"(h.0 to h.{len(layers) - 1})"
        )
    wte, wpe, lnf = s.get("wte.weight"), s.get("wpe.weight"), s.get("ln_f.weight")
    if wte and wpe and lnf and len(wte) == 2 and len(wpe) == 2 and len(lnf) == 1 and wte[1] == wpe[1] == lnf[0]:
        if wte[1] != cfg.n_embd:
            raise ConfigError(
                f"{source}: n_embd={cfg.n_embd} contradicts the weights, which are {wte[1]} wide "
                f"('wte.weight' {wte}, 'wpe.weight' {wpe}, 'ln_f.weight' {lnf})"
            )
        if wte[0] != cfg.vocab_size:
            raise ConfigError(f"{source}: vocab_size={cfg.vocab_size} contradicts 'wte.weight' {wte} ({wte[0]} tokens)")
        if wpe[0] != cfg.n_positions:
            raise ConfigError(
                f"{source}: n_positions={cfg.n_positions} contradicts 'wpe.weight' {wpe} ({wpe[0]} positions)"
            )
