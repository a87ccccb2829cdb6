"""devices.py's out_of_memory: torch's OOM, also wrapped as torch.compile wraps what it meets while compiling."""

from __future__ import annotations

import torch

from gpt2_port.devices import out_of_memory


def _raised(inner: BaseException, wrap: bool) -> BaseException:
    try:
        try:
            raise inner
        except Exception as e:
            if wrap:  # as torch._dynamo raises BackendCompilerFailed(...) from the backend's error
                raise RuntimeError("backend='inductor' raised: see above") from e
            raise
    except Exception as outer:
        return outer


def test_out_of_memory_sees_through_a_wrapping_exception() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert out_of_memory(_raised(oom, wrap=False)) and out_of_memory(_raised(oom, wrap=True))
    assert not out_of_memory(_raised(ValueError("bad shape"), wrap=True))
    assert not out_of_memory(RuntimeError("mentions out of memory but is not one")) and not out_of_memory(None)
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a  # a cycle ends the walk
    assert not out_of_memory(a)


def test_values_are_read_on_the_host_only_from_a_cpu_tensor_outside_compile() -> None:
    """host_readable gates every check that reads a value: a CPU tensor in eager code, never a device tensor (a
    sync) or a tensor torch.compile is tracing (a graph break). `meta` stands in for a device."""
    from gpt2_port.devices import host_readable

    assert host_readable(torch.zeros(2)) and not host_readable(torch.zeros(2, device="meta"))
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x: torch.Tensor) -> torch.Tensor:
        seen.append(host_readable(x))
        return x + 1

    traced(torch.zeros(2))
    assert seen == [False]
    torch._dynamo.reset()
