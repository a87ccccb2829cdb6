"""Locating a checkpoint's files (a directory, one file, shards, or a Hub id through hub.py) and reading its tensors.

`locate` turns what the user named into a Checkpoint (weight files, config.json, tokenizer files); `LazyStateDict`
maps every tensor name to a memory-mapped tensor (safetensors) or a tensor from a `.bin` read with
`torch.load(weights_only=True)`, never unpickling anything else.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError, HubError, UsageError
from . import hub
from .safetensors_io import SafetensorsFile
from .tokenizer import find_files

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """A located checkpoint: where it lives, its weight files, and its config.json (if any)."""

    source: str  # what the user named
    root: Path  # directory holding config/tokenizer files (for a single file: its directory)
    weight_files: list[Path]
    config_file: Path | None
    fmt: str  # "safetensors" or "bin"
    from_hub: bool = False  # a Hub id's snapshot (a local path of the same name is read first, and is not one)
    _handles: list[SafetensorsFile] = field(default_factory=list, repr=False)

    def tokenizer_files(self) -> tuple[Path, Path] | None:
        """The checkpoint's vocab.json + merges.txt (or OpenAI's encoder.json + vocab.bpe), if both are there."""
        return find_files(self.root)


def weights_in_dir(d: Path) -> tuple[list[Path], str]:
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
            files, fmt = weights_in_dir(p_resolved)
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
    if looks_like_path(s):
        hint = hub.did_you_mean(s, _local_candidates(p) + hub.OFFICIAL_IDS)
        raise CheckpointError(
            f"{s}: no such file or directory (it looks like a path, so it was not looked up as a Hub model id){hint}"
        )
    if hub.looks_like_hub_id(s):
        try:
            return _from_hub(s, revision)
        except HubError as e:
            if "/" not in s:
                raise
            # owner/name reads as a relative path too (a run directory not written yet, a typo'd folder)
            raise HubError(f"{e} (nor is there a local directory {s} here)") from None
    hint = hub.did_you_mean(s, _local_candidates(p) + hub.OFFICIAL_IDS)
    raise CheckpointError(
        f"{s}: no such file or directory, and not a Hub model id (like gpt2 or openai-community/gpt2){hint}"
    )


def looks_like_path(s: str) -> bool:
    """MODEL names a path, not a Hub id: it starts with `.`, `/` or `~`, holds a backslash or more than one `/`,
    ends in a separator or a weight-file suffix, or its first component exists here (`weights/gpt2-randon`)."""
    if s.startswith((".", "/", "~")) or "\\" in s or s.count("/") > 1 or s.endswith(("/", os.sep)):
        return True
    if s.endswith((".safetensors", ".bin", ".pt", ".pth", ".json")):
        return True
    first = s.split("/")[0]
    return "/" in s and os.path.lexists(first)


def _local_candidates(p: Path, limit: int = 2000) -> list[str]:
    """Entries beside the missing path, spelled as the user would type them (parent/name)."""
    parent = p.parent
    try:
        names = []
        with os.scandir(parent) as it:
            for i, e in enumerate(it):
                if i >= limit:
                    break
                if not e.name.startswith("."):
                    names.append(e.name)
    except OSError:
        return []
    prefix = "" if str(parent) in ("", ".") else str(parent).rstrip("/") + "/"
    return [prefix + n for n in names]


def _from_hub(model_id: str, revision: str | None) -> Checkpoint:
    root = hub.download(model_id, revision, hub.HUB_PATTERNS)
    try:
        files, fmt = weights_in_dir(root)
    except CheckpointError:  # a fine-tune that only ships pytorch_model.bin
        root = hub.download(model_id, revision, hub.HUB_PATTERNS + hub.HUB_PATTERNS_BIN)
        files, fmt = weights_in_dir(root)
    cfg = root / "config.json"
    return Checkpoint(model_id, root, files, cfg if cfg.is_file() else None, fmt, from_hub=True)


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
        why = next(
            (ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), hub.first_line(e)
        )
        raise CheckpointError(
            f"{f}: refused to unpickle: the file holds more than plain tensors ({why[:160]}); it may run code, "
            "and it was not loaded"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        raise CheckpointError(
            f"{f}: not a readable PyTorch checkpoint ({e.__class__.__name__}: {hub.first_line(e)[:160]})"
        ) from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{f}: expected a mapping of tensor names to tensors")
    return sd
