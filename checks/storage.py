"""Where a large model's extra copies live during a backward parity run: tensors made only when read (our gradients in
transformers' layout), tensors spilled to a safetensors file and mapped back (the reference's gradients and trained
weights of 774M and 1.5B), and AdamW's moments in file-backed mappings (1.5B's training state on a 24 GiB machine)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from gpt2_port.errors import UsageError
from gpt2_port.io.safetensors_io import SafetensorsFile, write_safetensors

# Above this many bytes of gradients (774M and 1.5B in float32), the reference's are kept on disk (SpilledTensors):
# the peak is then about twice the parameters instead of three times.
SPILL_BYTES = 2_000_000_000
# AdamW's moments go to disk (moments_on_disk) when weights + gradients + moments exceed this share of the free
# memory: 1.5B's 25 GB on a 24 GiB machine.
DISK_MOMENTS_SHARE = 0.8


class LazyTensors(Mapping[str, torch.Tensor]):
    """name -> tensor, each made when it is read (from adapter.hf_tensors' makers)."""

    def __init__(self, makers: Sequence[tuple[str, Callable[[], torch.Tensor]]]) -> None:
        self._makers = dict(makers)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._makers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


def spills(tensors: Mapping[str, torch.Tensor], spill_bytes: int | None) -> bool:
    """Whether these tensors go to disk (SpilledTensors): more than `spill_bytes` of them, all in the host's memory.
    Tensors on an accelerator stay where they are: the spill saves host memory, and a GPU's copies (6.2 GB of
    gradients at 1.5B) fit beside the two models on an 80 GB card."""
    if spill_bytes is None or any(t.device.type != "cpu" for t in tensors.values()):
        return False
    return sum(t.numel() * t.element_size() for t in tensors.values()) > spill_bytes


class SpilledTensors(Mapping[str, torch.Tensor]):
    """name -> tensor, written once to a safetensors file and read back zero-copy from its mapping: the reference's
    gradients of a large model stay on disk (reclaimable page cache) instead of in the process's memory."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        write_safetensors(path, [(n, tuple(t.shape), t.dtype, lambda t=t: t) for n, t in tensors.items()])
        tensors.clear()  # the caller's dict held the only references
        self._file = SafetensorsFile(path)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file.keys())

    def __len__(self) -> int:
        return len(self._file.keys())


def moments_on_disk(opt: torch.optim.Optimizer, directory: Path) -> None:
    """Give AdamW its state before the first step, as it would make it (step 0, both moments zero), with the moments
    in file-backed shared mappings under `directory` (one file per parameter): the kernel writes their pages back
    and evicts them under memory pressure, so weights + gradients + moments of 1.5B (25 GB in float32) run on a
    24 GiB machine. The arithmetic is torch's own; only where the moments live changes."""
    scalar = torch.get_default_dtype()  # torch.optim keeps `step` as a scalar tensor of the default dtype
    need = 2 * sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])
    free = shutil.disk_usage(directory).free
    if need > free:  # a mapping that cannot be backed by the disk dies with SIGBUS mid-step: refuse up front
        raise UsageError(
            f"AdamW's moments on disk need {need / 2**30:.1f} GiB in {directory}, {free / 2**30:.1f} GiB free: "
            "free space there (or set TMPDIR to a larger disk)"
        )
    k = 0
    for group in opt.param_groups:
        for p in group["params"]:
            moments = {}
            for name in ("exp_avg", "exp_avg_sq"):
                path = directory / f"{k:05d}.{name}.bin"
                moments[name] = torch.from_file(str(path), shared=True, size=p.numel(), dtype=p.dtype).view_as(p)
            opt.state[p] = {"step": torch.tensor(0.0, dtype=scalar), **moments}
            k += 1
