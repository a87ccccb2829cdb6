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


def test_all_finite_is_isfinite_all_in_one_reduction() -> None:
    """The decode loop's finite check: the answer torch.isfinite(t).all() gives, NaN, +inf and -inf anywhere, the
    largest finite values and bf16 included, as a () bool on the tensor's device, with one reduction and a compare
    (isfinite alone is four elementwise ops)."""
    from conftest import OpNames

    from gpt2_port.devices import all_finite

    big = torch.finfo(torch.float32).max
    cases = [[1.0, -2.0], [float("nan"), 1.0], [1.0, float("inf")], [-float("inf"), 0.0], [big, -big]]
    cases += [[float("nan"), float("inf")], [0.0, -0.0]]
    for case in cases:
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.tensor([[0.5, 0.25], case], dtype=dtype)
            got = all_finite(t)
            assert got.shape == () and got.dtype == torch.bool
            assert bool(got) == bool(torch.isfinite(t).all()), (case, dtype)
    t = torch.randn(3, 7)
    with OpNames() as ops:
        all_finite(t)
    assert ops.seen == ["linalg_vector_norm", "lt"]
