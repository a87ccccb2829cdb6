"""Find, read and load a GPT-2 checkpoint: local directory, single file, or Hub id (through the shared HF cache).

The model is built on the meta device and filled with `load_state_dict(assign=True)` from memory-mapped tensors,
so a float32 load peaks at about one copy of the weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import adapter
from .config import GPT2Config, check_against_shapes, infer_from_shapes, read_config_json
from .errors import CheckpointError, ConfigError, HubError, UsageError
from .model import GPT2
from .safetensors_io import SafetensorsFile, write_safetensors
from .util import atomic_write_bytes, atomic_write_text

log = logging.getLogger(__name__)

HUB_ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
# Only what the port needs; the gpt2 repos also hold TF, Flax, ONNX, rust and tflite weights (several GB).
HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
]
HUB_PATTERNS_BIN = ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin"]

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in (torch.float32, torch.float16, torch.bfloat16):
            raise UsageError(f"dtype {name} is not supported: expected float32, float16 or bfloat16")
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}: expected float32, float16 or bfloat16") from None


def parse_device(name: str | torch.device) -> torch.device:
    """cpu, cuda, cuda:N, mps or auto -> a torch.device that exists here, or UsageError."""
    s = str(name).lower()
    if s == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(s)
    except (RuntimeError, ValueError):
        raise UsageError(f"unknown device {name!r}: expected cpu, cuda, cuda:N, mps or auto") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {name!r} asked for, but CUDA is not available on this machine (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return dev
    if dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
            raise UsageError(f"device {name!r} asked for, but MPS is not available on this machine (use --device cpu)")
        return dev
    raise UsageError(f"unknown device {name!r}: expected cpu, cuda, cuda:N, mps or auto")


@dataclass
class Checkpoint:
    """A located checkpoint: where it lives, its weight files, and its config.json (if any)."""

    source: str  # what the user named
    root: Path  # directory holding config/tokenizer files (for a single file: its directory)
    weight_files: list[Path]
    config_file: Path | None
    fmt: str  # "safetensors" or "bin"
    _handles: list[SafetensorsFile] = field(default_factory=list, repr=False)

    def tokenizer_files(self) -> tuple[Path, Path] | None:
        v, m = self.root / "vocab.json", self.root / "merges.txt"
        return (v, m) if v.is_file() and m.is_file() else None


def _looks_like_hub_id(s: str) -> bool:
    if s in HUB_ALIASES:
        return True
    parts = s.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not s.startswith((".", "/", "~"))
        and not s.endswith((".safetensors", ".bin"))
    )


def _weights_in_dir(d: Path) -> tuple[list[Path], str]:
    for index_name, fmt in (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "bin")):
        idx = d / index_name
        if idx.is_file():
            return _read_index(idx), fmt
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"], "safetensors"
    if (d / "pytorch_model.bin").is_file():
        return [d / "pytorch_model.bin"], "bin"
    found = sorted(p.name for p in d.iterdir())[:8] if d.is_dir() else []
    raise CheckpointError(
        f"{d}: no weights found (expected model.safetensors, a model.safetensors.index.json with its "
        f"shards, or pytorch_model.bin); directory holds: {', '.join(found) or 'nothing'}"
    )


def _read_index(idx: Path) -> list[Path]:
    try:
        data = json.loads(idx.read_text(encoding="utf-8"))
        wm = data["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{idx}: not a valid shard index ({e.__class__.__name__}: {e})") from None
    files = []
    for name in dict.fromkeys(wm.values()):
        p = idx.parent / name
        if Path(name).name != name:
            raise CheckpointError(f"{idx}: shard name {name!r} must be a plain file name in the same directory")
        if not p.is_file():
            raise CheckpointError(f"{idx}: names shard {name!r}, which is missing from {idx.parent}")
        files.append(p)
    return files


def locate(model: str | os.PathLike[str], revision: str | None = None) -> Checkpoint:
    """Resolve MODEL (directory, .safetensors/.bin file, or Hub id) to local files, downloading if needed."""
    s = os.fspath(model)
    p = Path(s).expanduser()
    try:
        exists = p.exists()
        p_resolved = p.resolve(strict=exists)
    except RuntimeError:  # symlink loop (py3.11 raises RuntimeError from resolve(strict=True))
        raise CheckpointError(f"{s}: symlink loop") from None
    except OSError as e:
        if e.errno == 40:  # ELOOP
            raise CheckpointError(f"{s}: symlink loop") from None
        raise CheckpointError(f"{s}: cannot access ({e.strerror or e})") from None
    if exists:
        if revision is not None:
            raise UsageError(f"--revision {revision!r} applies to Hub ids only; {s} is a local path")
        if p.is_dir():
            files, fmt = _weights_in_dir(p_resolved)
            cfg = p_resolved / "config.json"
            return Checkpoint(s, p_resolved, files, cfg if cfg.is_file() else None, fmt)
        if p.suffix == ".safetensors":
            cfg = p_resolved.parent / "config.json"
            return Checkpoint(s, p_resolved.parent, [p_resolved], cfg if cfg.is_file() else None, "safetensors")
        if p.suffix in (".bin", ".pt", ".pth"):
            cfg = p_resolved.parent / "config.json"
            return Checkpoint(s, p_resolved.parent, [p_resolved], cfg if cfg.is_file() else None, "bin")
        if p.name.endswith(".index.json"):
            fmt = "bin" if "pytorch_model" in p.name else "safetensors"
            cfg = p_resolved.parent / "config.json"
            return Checkpoint(s, p_resolved.parent, _read_index(p_resolved), cfg if cfg.is_file() else None, fmt)
        raise CheckpointError(f"{s}: not a checkpoint (expected a directory, a .safetensors file or a .bin file)")
    if p.is_symlink():
        raise CheckpointError(f"{s}: broken symlink (points to {os.readlink(p)!r}, which does not exist)")
    if _looks_like_hub_id(s):
        return _from_hub(s, revision)
    raise CheckpointError(
        f"{s}: no such file or directory, and not a Hub model id (like gpt2 or openai-community/gpt2)"
    )


def _from_hub(model_id: str, revision: str | None) -> Checkpoint:
    import huggingface_hub as hf
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import errors as hf_errors

    repo = HUB_ALIASES.get(model_id, model_id)
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    where = f"{repo}" + (f"@{revision}" if revision else "")

    def fetch(patterns: list[str]) -> Path:
        return Path(hf.snapshot_download(repo, revision=revision, allow_patterns=patterns))

    try:
        log.info("resolving %s through the Hugging Face cache (%s)", where, hf_constants.HF_HUB_CACHE)
        root = fetch(HUB_PATTERNS)
        try:
            files, fmt = _weights_in_dir(root)
        except CheckpointError:
            root = fetch(HUB_PATTERNS + HUB_PATTERNS_BIN)  # a fine-tune that only ships pytorch_model.bin
            files, fmt = _weights_in_dir(root)
    except hf_errors.RepositoryNotFoundError:
        raise HubError(
            f"{model_id}: no such model on the Hugging Face Hub (or it is private/gated: run `hf auth login`)"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise HubError(f"{model_id}: revision {revision!r} not found on the Hub") from None
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled) as e:
        if offline:
            raise HubError(
                f"{where}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set: run once with "
                f"network access (unset HF_HUB_OFFLINE) to download it, or pass a local directory"
            ) from None
        raise HubError(
            f"{where}: cannot reach the Hugging Face Hub and it is not cached locally ({_first_line(e)}): "
            f"connect to the network once, or pass a local checkpoint directory"
        ) from None
    except hf_errors.HfHubHTTPError as e:
        raise HubError(f"{where}: download failed ({_first_line(e)})") from None
    except (OSError, ValueError) as e:
        raise HubError(f"{where}: download failed ({e.__class__.__name__}: {_first_line(e)})") from None
    cfg = root / "config.json"
    return Checkpoint(model_id, root, files, cfg if cfg.is_file() else None, fmt)


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else e.__class__.__name__


class LazyStateDict(Mapping[str, torch.Tensor]):
    """All tensors of a checkpoint (one file or shards) as a read-only mapping of memory-mapped tensors."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self._where: dict[str, tuple[int, str]] = {}
        self._sources: list[SafetensorsFile | dict[str, torch.Tensor]] = []
        for i, f in enumerate(ckpt.weight_files):
            src: SafetensorsFile | dict[str, torch.Tensor]
            src = SafetensorsFile(f) if ckpt.fmt == "safetensors" else _load_bin(f)
            self._sources.append(src)
            for k in src.keys():
                if k in self._where:
                    raise CheckpointError(f"{f}: tensor {k!r} also appears in {ckpt.weight_files[self._where[k][0]]}")
                self._where[k] = (i, k)
        self.files = ckpt.weight_files

    def __getitem__(self, key: str) -> torch.Tensor:
        i, k = self._where[key]
        src = self._sources[i]
        return src.get(k) if isinstance(src, SafetensorsFile) else src[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for src in self._sources:
            out.update(
                src.shapes() if isinstance(src, SafetensorsFile) else {k: tuple(v.shape) for k, v in src.items()}
            )
        return out

    def _by_file(self, keys: Iterable[str]) -> Iterator[tuple[SafetensorsFile, list[str]]]:
        """These keys grouped by the safetensors file holding them (.bin sources have no pages to advise on)."""
        by_source: dict[int, list[str]] = {}
        for k in keys:
            i, name = self._where[k]
            by_source.setdefault(i, []).append(name)
        for i, names in by_source.items():
            src = self._sources[i]
            if isinstance(src, SafetensorsFile):
                yield src, names

    def prefetch(self, keys: Iterable[str]) -> None:
        """Bring these tensors' pages in ahead of use (see SafetensorsFile.prefetch)."""
        for src, names in self._by_file(keys):
            src.prefetch(names)

    def release(self, keys: Iterable[str]) -> None:
        """Drop these tensors' pages from the process (see SafetensorsFile.release)."""
        for src, names in self._by_file(keys):
            src.release(names)

    def file_of(self, key: str) -> Path:
        return self.files[self._where[key][0]]

    def nbytes(self) -> int:
        total = 0
        for src in self._sources:
            if isinstance(src, SafetensorsFile):
                total += sum(i.nbytes for i in src.infos.values())
            else:
                total += sum(t.numel() * t.element_size() for t in src.values())
        return total


def _load_bin(f: Path) -> dict[str, torch.Tensor]:
    """A PyTorch .bin, never unpickled beyond plain tensors (weights_only=True); memory-mapped when it can be."""
    import pickle

    log.warning("%s: pickle-based .bin checkpoint; loading with weights_only=True (prefer model.safetensors)", f)
    try:
        with open(f, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise CheckpointError(f"{f}: cannot read ({e.strerror or e})") from None
    if not (magic.startswith(b"PK\x03\x04") or magic[:1] == b"\x80"):  # torch.save's zip, or a pickle (PROTO >= 2)
        raise CheckpointError(
            f"{f}: not a PyTorch checkpoint (expected a torch.save zip archive or a pickle; the file "
            f"starts with {magic!r})"
        )
    try:
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            sd = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a paragraph; keep the line that says what the pickle asked for ("... GLOBAL posix.system")
        why = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), _first_line(e))
        raise CheckpointError(
            f"{f}: refused to unpickle: the file holds more than plain tensors ({why[:160]}); it may run code, "
            "and it was not loaded"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise CheckpointError(
            f"{f}: not a readable PyTorch checkpoint ({e.__class__.__name__}: {_first_line(e)[:160]})"
        ) from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{f}: expected a mapping of tensor names to tensors")
    return sd


def read_config(ckpt: Checkpoint, sd: LazyStateDict) -> GPT2Config:
    if ckpt.config_file is not None:
        return read_config_json(ckpt.config_file)
    log.info("%s: no config.json; inferring the config from tensor shapes", ckpt.source)
    return infer_from_shapes(sd.shapes())


@dataclass
class LoadReport:
    """What a load did: for `inspect`, the CLI's timing line, and the checker."""

    checkpoint: Checkpoint
    config: GPT2Config
    conversion: adapter.Conversion
    file_bytes: int
    load_s: float = 0.0
    nonfinite: list[str] = field(default_factory=list)


def convert_checkpoint(model: str | os.PathLike[str], revision: str | None = None) -> tuple[LazyStateDict, LoadReport]:
    """Locate, read and convert a checkpoint without building a model (what `inspect` shows)."""
    ckpt = locate(model, revision)
    sd = LazyStateDict(ckpt)
    cfg = read_config(ckpt, sd)
    if ckpt.config_file is not None:  # names the config.json key the weights contradict (and bounds n_layer)
        check_against_shapes(cfg, sd.shapes(), source=str(ckpt.config_file))
    try:
        conv = adapter.hf_to_scratch(sd, cfg)
    except (CheckpointError, ConfigError) as e:
        where = ckpt.weight_files[0] if len(ckpt.weight_files) == 1 else ckpt.root
        hint = ""
        if ckpt.config_file is not None and "expected shape" in str(e):
            hint = (
                f" (shapes expected from {ckpt.config_file.name}: n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
                f"n_positions={cfg.n_positions}, vocab_size={cfg.vocab_size})"
            )
        raise type(e)(f"{where}: {e}{hint}") from None
    return sd, LoadReport(ckpt, cfg, conv, sd.nbytes())


def nonfinite_tensors(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of tensors holding NaN or Inf."""
    return [k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


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
) -> tuple[GPT2, LoadReport]:
    t0 = time.perf_counter()
    dt = parse_dtype(dtype)
    dev = parse_device(device)
    sd, report = convert_checkpoint(model, revision)
    cfg, state = report.config, report.conversion.state
    sd.release(report.conversion.dropped)  # checked and discarded (mask buffers): out of the RSS, 4 MB per layer
    sd.prefetch(k for k in sd if k not in report.conversion.dropped)  # cold cache: one sequential read, not faults
    if check_finite:
        report.nonfinite = nonfinite_tensors(state)
    with torch.device("meta"), _no_random_init():
        m = GPT2(cfg)
    if any(t.dtype != dt for t in state.values()) or dev.type != "cpu":
        state = {k: t.to(device=dev, dtype=dt) for k, t in state.items()}
    m.load_state_dict(state, strict=True, assign=True)
    m.eval().requires_grad_(False)
    report.load_s = time.perf_counter() - t0
    log.info(
        "loaded %s (%s layers, %s params) as %s on %s in %.2fs",
        model,
        cfg.n_layer,
        f"{m.num_params():,}",
        dt,
        dev,
        report.load_s,
    )
    return m, report


def save_pretrained(
    model: GPT2,
    directory: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write `model` in the official layout, loadable by transformers' and gpt2_port's `from_pretrained`.

    `config.json` (with the dropout and init fields); `model.safetensors` in float32 or the model's dtype, Conv1D
    weights as [in, out], q/k/v fused back into `c_attn`, no mask buffers; tied head: un-prefixed keys and no
    `lm_head` (as openai-community/gpt2 ships), untied: transformers' `save_pretrained` layout (`transformer.`
    prefix, `lm_head.weight`). Tokenizer files (vocab.json, merges.txt) are copied beside the weights from
    `tokenizer_dir`, else from the checkpoint the model was loaded from, when either has them. Every file is written
    atomically; tensors are streamed one at a time.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{out}: exists and is not a directory (save_pretrained writes a checkpoint directory)")
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    prefix = "" if cfg.tie_word_embeddings else "transformer."
    state = {k: v for k, v in model.state_dict().items()}
    tensors = adapter.hf_tensors(state, cfg, prefix)
    shapes = {k: tuple(make().shape) for k, make in tensors}  # views and small cats: cheap next to the write

    def on_cpu(make):  # noqa: ANN001, ANN202
        return lambda: make().cpu()

    entries = [(k, shapes[k], model.dtype, on_cpu(make)) for k, make in tensors]
    write_safetensors(out / "model.safetensors", entries, metadata={"format": "pt"})
    atomic_write_text(out / "config.json", json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    src = _tokenizer_source(model, tokenizer_dir)
    if src is not None:
        for name, f in zip(("vocab.json", "merges.txt"), src):
            if f.resolve() != (out / name).resolve():
                atomic_write_bytes(out / name, f.read_bytes())
    log.info("saved %s (%s params) to %s", cfg, f"{model.num_params():,}", out)
    return out


def _tokenizer_source(model: GPT2, tokenizer_dir: str | os.PathLike[str] | None) -> tuple[Path, Path] | None:
    if tokenizer_dir is not None:
        d = Path(tokenizer_dir)
        for v, m in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
            if (d / v).is_file() and (d / m).is_file():
                return d / v, d / m
        raise UsageError(f"tokenizer directory {d}: no vocab.json + merges.txt (or encoder.json + vocab.bpe)")
    report = getattr(model, "load_report", None)
    return None if report is None else report.checkpoint.tokenizer_files()
