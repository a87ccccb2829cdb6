"""Dtype and device names: parsing what the user typed, and the one short name of a torch dtype; whether an error is
running out of device memory; the memory a device has free and this process's peak resident memory on the host; the
SDPA kernels allowed where shapes vary from call to call."""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .errors import DeviceMemoryError, UsageError

GiB = 1 << 30
MEMORY_HEADROOM = 0.9  # a memory check uses at most this share of the available memory: its estimate is not exact

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def dtype_name(dt: torch.dtype) -> str:
    """torch.float32 -> "float32" (the name used in messages, JSON and tolerance tables)."""
    return str(dt).removeprefix("torch.")


def compiling() -> bool:
    """Whether torch.compile is tracing the code that asks (a data-dependent branch there would break the graph)."""
    return getattr(torch.compiler, "is_compiling", lambda: False)()


def host_readable(t: torch.Tensor) -> bool:
    """Whether reading `t`'s value costs nothing: a CPU tensor (no device sync) outside torch.compile's tracing. Checks
    of values (token ids in range, a gradient of exactly 1) run only then."""
    return t.device.type == "cpu" and not compiling()


def value_range(t: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor, read in one transfer: one device sync where `int(t.min())` and
    `int(t.max())` would wait twice."""
    lo, hi = torch.stack(torch.aminmax(t)).tolist()
    return lo, hi


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """() bool on t's device, read without a wait: whether every value of the floating-point tensor t is finite. Its
    largest |value| (one reduction, NaN carried through) below infinity: two kernels, where torch.isfinite(t).all()
    launches five (isfinite is abs, ne, eq and mul, then all), each one a decode token pays outside its CUDA graph."""
    return torch.linalg.vector_norm(t, ord=math.inf) < math.inf


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matmul inputs to on this device type, or None when autocast is off (or this device
    type has none: meta; named, as torch.amp.is_autocast_available would be a graph break under torch.compile)."""
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


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
    if dev.type == "cpu":  # torch takes cpu:N for any N and runs on the one CPU: cpu:1 would silently mean cpu
        if dev.index not in (None, 0):
            raise UsageError(
                f"unknown device {name!r}: the CPU has no index but 0; expected cpu, cuda, cuda:N, mps or auto"
            )
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


def error_chain(e: BaseException | None) -> Iterator[BaseException]:
    """e, then the error it wraps, and so on: torch.compile's wrapper's `inner_exception`, else `__cause__`, else
    `__context__` (each error once: a chain that loops ends)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        yield e
        seen.add(id(e))
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__


def _out_of_memory_error(e: BaseException | None) -> BaseException | None:
    return next((x for x in error_chain(e) if isinstance(x, torch.OutOfMemoryError)), None)


def out_of_memory(e: BaseException | None) -> bool:
    """e is torch's out-of-memory error or was raised from one (torch.compile re-raises an error met while compiling,
    autotuning included, as its own exception with the original as its cause)."""
    return _out_of_memory_error(e) is not None


@contextlib.contextmanager
def memory_errors(during: str) -> Iterator[None]:
    """Out of memory inside the block (see out_of_memory) raises DeviceMemoryError naming `during`; else as is."""
    try:
        yield
    except Exception as e:
        if (mem := memory_error(e, during)) is None:
            raise
        raise mem from e


def memory_error(e: BaseException, during: str = "") -> DeviceMemoryError | None:
    """A DeviceMemoryError for an out-of-memory error (see out_of_memory), else None: torch's first two sentences
    ("CUDA out of memory. Tried to allocate 2.00 GiB"), and `during` (the step it was in) when given."""
    oom = _out_of_memory_error(e)
    if oom is None:
        return None
    said = ". ".join(str(oom).replace("\n", " ").split(". ")[:2]).strip().rstrip(".") or "out of memory"
    return DeviceMemoryError(f"{said}{' ' + during if during else ''}")


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: VmHWM, which starts afresh at exec (ru_maxrss would carry over the
    peak of a parent that forked it), or ru_maxrss where there is no /proc (KiB on Linux, bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_cpu_memory() -> tuple[int, str]:
    """Bytes this process may still use on the host: MemAvailable, or less when a cgroup limit is nearer."""
    avail, source = None, "MemAvailable in /proc/meminfo"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        avail, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "free physical pages"
    for limit_f, usage_f in (
        (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),  # cgroup v2
        (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
    ):
        limit, usage = _read_int(limit_f), _read_int(usage_f)
        if limit is not None and usage is not None and limit < (1 << 60) and limit - usage < avail:
            avail, source = max(0, limit - usage), f"the cgroup limit in {limit_f}"
    return avail, source


def available_memory(device: torch.device) -> tuple[int, str]:
    """Free bytes on `device` and where the figure comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory on {device}"
    return available_cpu_memory()


# SDPA's kernels but cuDNN's: for calls whose shapes change from one call to the next (decode steps over keys that
# grow a token a step, prefills, evaluation batches of varying lengths), and for the fixed-shape static decode step,
# which a CUDA graph records. cuDNN's attention builds an execution plan for every new shape: bf16 decoding on an
# H100 spent 4.9 ms of host time a call on it and ran 10x slower than float32.
VARYING_SHAPE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device, backends: list[SDPBackend]) -> contextlib.AbstractContextManager:
    """On CUDA, SDPA restricted to `backends` while the block runs (torch's global backend flags, put back after);
    elsewhere nothing (the choice is among CUDA's kernels)."""
    return sdpa_kernel(backends) if device.type == "cuda" else contextlib.nullcontext()


def without_cudnn_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA, SDPA without its cuDNN kernel while the block runs; elsewhere nothing."""
    return attention_backends(device, VARYING_SHAPE_BACKENDS)
