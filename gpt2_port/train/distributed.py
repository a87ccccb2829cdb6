"""Data-parallel context from torchrun's environment: gloo on CPU, nccl on CUDA; a single process otherwise.

torchrun (and its multi-node flags) sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE; without them the run is
one process and nothing here touches torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UsageError


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None:
        return default
    if not v.isdigit():
        raise UsageError(f"environment variable {name}={v!r}: expected a non-negative integer (set by torchrun)")
    return int(v)


def from_env() -> Dist:
    """The process group torchrun describes (not yet joined): world size 1 when not under torchrun."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Dist()
    return Dist(
        rank=_env_int("RANK", 0),
        world_size=world,
        local_rank=_env_int("LOCAL_RANK", 0),
        local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
    )


def device_for(d: Dist, requested: torch.device) -> torch.device:
    """Each process of a multi-GPU run takes the GPU of its local rank: one GPU a process, so a machine running more
    processes than it has GPUs is refused (every process says so: each sees the same counts)."""
    if d.enabled and requested.type == "cuda":
        n, procs = torch.cuda.device_count(), max(d.local_world_size, d.local_rank + 1)
        if procs > n:
            seen = os.environ.get("CUDA_VISIBLE_DEVICES")
            shown = f" shown to it (CUDA_VISIBLE_DEVICES={seen})" if seen is not None else ""
            raise UsageError(
                f"torchrun started {procs} processes on this machine, which has {n} GPU{'' if n == 1 else 's'}"
                f"{shown}: one process a GPU (--nproc_per_node {n}), or CPU processes with --device cpu (gloo)"
            )
        return torch.device("cuda", d.local_rank)
    return requested


_joined: list[bool] = []  # one entry once this process has joined a process group


def init(d: Dist, device: torch.device) -> None:
    """Join the process group: nccl for CUDA, gloo for CPU (DDP that does not demand a GPU)."""
    if not d.enabled or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    _joined.append(True)


PEER_FAILED = "another process of this torchrun job stopped, so this one cannot go on (that process's error says why)"


def peer_failed(e: BaseException) -> bool:
    """Whether `e` is a collective of this process's group failing because another process left (gloo's "Connection
    reset by peer", an NCCL error): that process reports its own error, and this one's is not a bug."""
    if not joined():
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(w in str(e) for w in ("gloo", "NCCL", "Connection reset by peer"))


def joined() -> bool:
    """Whether this process joined a process group (and so has torch.distributed's threads to tear down at exit)."""
    return bool(_joined)


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()
