"""The reference: transformers' GPT2LMHeadModel loaded by transformers itself (never through our adapter), and
forward hooks that capture its activations by module path.

transformers is imported only inside `load_reference`, so importing this module costs nothing without it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import platform
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from gpt2_port.config import GPT2Config
from gpt2_port.io.checkpoint import Checkpoint


def reference_dir(ckpt: Checkpoint, cfg: GPT2Config, tmp: Path) -> Path:
    """A directory transformers' from_pretrained reads: the checkpoint's own when it is standard, else links to it."""
    std = {"model.safetensors", "pytorch_model.bin"}
    if ckpt.config_file is not None and (
        (len(ckpt.weight_files) == 1 and ckpt.weight_files[0].name in std and ckpt.weight_files[0].parent == ckpt.root)
        or (ckpt.root / "model.safetensors.index.json").is_file()
        or (ckpt.root / "pytorch_model.bin.index.json").is_file()
    ):
        return ckpt.root
    (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    if len(ckpt.weight_files) == 1:
        name = "model.safetensors" if ckpt.fmt == "safetensors" else "pytorch_model.bin"
        (tmp / name).symlink_to(ckpt.weight_files[0])
    else:
        for f in ckpt.weight_files:
            (tmp / f.name).symlink_to(f)
        for idx in ckpt.root.glob("*.index.json"):
            (tmp / idx.name).symlink_to(idx)
    return tmp


def load_reference(
    ckpt: Checkpoint, cfg: GPT2Config, dtype: torch.dtype, device: torch.device, attn: str
) -> torch.nn.Module:
    """transformers' GPT2LMHeadModel on the same files, in eval mode (dropout off), with `attn` attention."""
    import transformers
    from transformers import GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="gpt2port-ref-") as tmp:
        d = reference_dir(ckpt, cfg, Path(tmp))
        ref = GPT2LMHeadModel.from_pretrained(d, dtype=dtype, attn_implementation=attn)
    return ref.to(device).eval()


def reference_hooks(n_layer: int) -> dict[str, tuple[str, str]]:
    """Block-level points: point name -> (module path in GPT2LMHeadModel, "input" or "output" of that module).

    Block outputs come from hooks because transformers' `hidden_states[-1]` is taken after ln_f.
    """
    d = {"embed": ("transformer.drop", "output")}
    d.update({f"block.{i}": (f"transformer.h.{i}", "output") for i in range(n_layer)})
    d["ln_f"] = ("transformer.ln_f", "output")
    return d


def capture_reference(
    ref: torch.nn.Module,
    ids: torch.Tensor,
    hooks: dict[str, tuple[str, str]],
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One forward of the reference on `ids`; every hooked activation by point name, plus "logits". With an
    `attention_mask`, transformers is given the positions that mask implies (`positions_from_mask`), as its
    `generate` gives them: its forward alone would number padding as positions."""
    acts: dict[str, torch.Tensor] = {}
    handles = []

    def make(name: str, what: str) -> Callable:
        def hook(_m: torch.nn.Module, inp: tuple, out: object) -> None:
            t = inp[0] if what == "input" else out
            if isinstance(t, tuple):  # transformers 4.x blocks return tuples
                t = t[0]
            acts[name] = t.detach()

        return hook

    for name, (path, what) in hooks.items():
        handles.append(ref.get_submodule(path).register_forward_hook(make(name, what)))
    try:
        with torch.inference_mode():
            if attention_mask is None:
                out = ref(input_ids=ids, use_cache=False)
            else:
                pos = positions_from_mask(attention_mask)
                out = ref(input_ids=ids, attention_mask=attention_mask, position_ids=pos, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    acts["logits"] = out.logits.detach()
    return acts


@torch.inference_mode()
def reference_forced_logits(
    ref: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int
) -> torch.Tensor:
    """transformers' cached decoding of `ids` (B, T): the prompt's prefill, then one token per forward with
    `past_key_values`, the mask so far and the positions it implies, as its `generate` feeds them. -> (B, N, V), the
    last position's logits of each forward (N = T - prompt_len + 1)."""
    # the cache's argument and output field: `cache` from transformers 5.24 (past_key_values before, deprecated after)
    name = "cache" if "cache" in inspect.signature(ref.forward).parameters else "past_key_values"
    pos = positions_from_mask(mask)
    out = ref(
        input_ids=ids[:, :prompt_len],
        attention_mask=mask[:, :prompt_len],
        position_ids=pos[:, :prompt_len],
        use_cache=True,
    )
    logits = [out.logits[:, -1:]]
    for t in range(prompt_len, ids.shape[1]):
        out = ref(
            input_ids=ids[:, t : t + 1],
            attention_mask=mask[:, : t + 1],
            position_ids=pos[:, t : t + 1],
            use_cache=True,
            **{name: getattr(out, name)},
        )
        logits.append(out.logits[:, -1:])
    return torch.cat(logits, 1)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B, T) positions: each row's real tokens numbered from 0, padding given 0 (as
    transformers' generate numbers a left-padded batch). Written here rather than taken from gpt2_port.model.masks:
    what transformers is given must not come from the code under test."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


# torch's per-backend float32 precision settings (torch >= 2.9), parents before children: restored in this order, each
# child gets its own saved value back after its parent's assignment has reset it
PRECISION_SETTINGS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv")
PRECISION_SETTINGS += ("mkldnn.rnn",)
ONEDNN_SETTINGS = tuple(p for p in PRECISION_SETTINGS if p.startswith("mkldnn"))


def precision_settings(paths: tuple[str, ...] = PRECISION_SETTINGS) -> list[object]:
    """The torch.backends objects at `paths` that carry an `fp32_precision` on this torch (none before 2.9)."""
    out = []
    for path in paths:
        o: object = torch.backends
        for part in filter(None, path.split(".")):
            o = getattr(o, part, None)
        if o is not None and isinstance(getattr(o, "fp32_precision", None), str):
            out.append(o)
    return out


def versions(devices: Iterator[torch.device] | list[torch.device]) -> dict[str, str]:
    """What the figures were measured with: torch, transformers and python, and for a CUDA run the GPU, CUDA and
    cuDNN (a float32 forward is bit-exact on one GPU and cuBLAS release; the report says which)."""
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    for dev in devices:
        if dev.type == "cuda":
            out["gpu"] = torch.cuda.get_device_name(dev)
            out["cuda"] = str(torch.version.cuda)
            out["cudnn"] = str(torch.backends.cudnn.version())
            break
    return out


@contextlib.contextmanager
def exact_matmuls() -> Iterator[None]:
    """float32 matmuls in float32 (no TF32 tensor cores) while a parity check runs, whatever the process set before
    (gpt2-port train turns TF32 on for speed; a comparison of float32 arithmetic must not inherit it). Afterwards every
    setting is as it was. Set and put back through the legacy flags, the API `set_tf32` uses: on torch >= 2.9 a mix of
    the legacy and the per-backend `fp32_precision` API leaves the legacy flags unreadable (torch raises on
    `allow_tf32` and on get_float32_matmul_precision, which inductor reads). The legacy set_float32_matmul_precision
    also sets oneDNN's CPU matmuls, so their own `fp32_precision` values are put back last. A process that had mixed
    the APIs before (its legacy flags unreadable) gets every backend's `fp32_precision` back instead."""
    fine = [(o, o.fp32_precision) for o in precision_settings()]
    try:
        legacy = (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.get_float32_matmul_precision(),
        )
    except RuntimeError:  # the process already mixed the two APIs: every backend's own setting is put back instead
        legacy = None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy[2])
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy[0], legacy[1]
        onednn = [(o, v) for o, v in fine if o in precision_settings(ONEDNN_SETTINGS)]
        for o, value in fine if legacy is None else onednn:
            o.fp32_precision = value  # type: ignore[attr-defined]


def amp(dtype: torch.dtype, device: torch.device) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype` on `device` (mixed precision as trainers run it), or nothing for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
