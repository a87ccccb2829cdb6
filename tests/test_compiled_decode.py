"""The compiled decode step (`generate(..., compile_step=...)`, `gpt2-port generate --compile`): torch.compile of the
static step, compiled once per kept step and then (on CUDA) recorded as the CUDA graph; tests/test_cuda.py replays it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import TINY, chaotic_model, same_tokens_where_decided
from torch._dynamo.testing import CompileCounter

from gpt2_port.cli import main
from gpt2_port.errors import UsageError
from gpt2_port.generate import generate_full
from gpt2_port.model import from_pretrained

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

# Inductor's step against the uncompiled one, as a fraction of their largest |score| (conftest.same_tokens_where_
# decided): its fused kernels round elsewhere. Worst seen on this CPU: 2.7e-7 (default configuration), 3.5e-7 (second).
COMPILED_SCORES = 2e-5
# A bf16 model's compiled step (F.linear in bf16) against its eager one, which may take the CPU's packed bf16 kernels
# or float32 products rounded once (model/lowp.py): bf16 rounding apart where it does. Worst seen on this CPU: 0 in
# both configurations (this tiny model at 2 rows takes F.linear eagerly too).
BF16_SCORES = 2e-2

IDS = torch.tensor([[5, 17, 42, 7, 99, 3], [0, 0, 0, 8, 11, 12]])
MASK = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])


@pytest.mark.parametrize("sample", [False, True])
def test_the_compiled_step_is_the_static_step_compiled_once(sample: bool) -> None:
    """Through the `eager` backend (dynamo's one graph, run by the same aten ops) the compiled step's scores are the
    uncompiled static step's bit for bit, on a left-padded batch, greedy and sampled; the step is traced once for the
    whole generation (no recompile as the slot, the positions and the mask change: they are device tensors), a
    second generation of the same batch and length bucket reuses it, and one of another batch, traced once too, leaves
    the first's trace valid. (The step reads its cache's per-layer views, made before the first trace: made inside
    it, they would change what the trace read, and the second token would trace the step again.)"""
    m = chaotic_model(TINY, 3)
    opts = dict(attention_mask=MASK, eos_token_id=None, do_sample=sample, seed=3, output_scores=True)
    ref = generate_full(m, IDS, 30, static_cache=True, **opts)
    counter = CompileCounter()
    got = generate_full(m, IDS, 30, compile_step=counter, **opts)
    assert ref.extra["step"] == "static" and got.extra["step"] == "static (compiled)"
    assert counter.frame_count == 1 and counter.op_count > 0
    assert torch.equal(ref.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.scores, got.scores, strict=True))
    again = generate_full(m, IDS, 25, compile_step=counter, **opts)  # 31 and 36 tokens: one 64-slot bucket
    assert counter.frame_count == 1 and torch.equal(again.sequences, got.sequences[:, :31])
    # another batch is another kept step, traced once; going back to the first reads nothing the second changed
    one = dict(opts, attention_mask=MASK[:1])
    generate_full(m, IDS[:1], 30, compile_step=counter, **one)
    back = generate_full(m, IDS, 30, compile_step=counter, **opts)
    assert counter.frame_count == 2 and torch.equal(back.sequences, got.sequences)


def test_the_fused_step_compiles_as_one_graph_too(tiny_official: Path) -> None:
    """generate's step on CUDA (the one-kernel GELU, the residual added in place by the projections' matmuls, c_attn's
    output holding k and v as one view written in one copy) traced whole, once, with no graph break (`fullgraph`), and
    through the `eager` backend the uncompiled step's scores bit for bit."""
    m, _ = from_pretrained(tiny_official)
    opts = dict(attention_mask=MASK, eos_token_id=None, output_scores=True, fused_kernels=True)
    ref = generate_full(m, IDS, 20, static_cache=True, **opts)
    counter = CompileCounter()
    got = generate_full(m, IDS, 20, compile_step=counter, **opts)
    assert got.extra["step"] == "static (compiled)" and got.extra["fused_kernels"] is True
    assert counter.frame_count == 1 and torch.equal(ref.sequences, got.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ref.scores, got.scores, strict=True))


@pytest.mark.parametrize("fused", [False, True], ids=["forward-ops", "fused"])
def test_inductor_compiles_the_step_on_the_cpu_with_the_same_tokens(tiny_official: Path, fused: bool) -> None:
    """The real backend, as `--compile` runs it: inductor's fused kernels (C++ on the CPU, triton on a GPU) compute the
    same function with other roundings, so the tokens are the uncompiled step's wherever the scores decide them; the
    official layout's one c_attn matmul is what it compiles. Both steps: the forward's ops (the CPU's default) and the
    fused one (CUDA's, whose projections add into the residual in place: functionalized by the compile)."""
    m, _ = from_pretrained(tiny_official)
    opts = dict(attention_mask=MASK, eos_token_id=None, output_scores=True, fused_kernels=fused)
    ref = generate_full(m, IDS, 24, static_cache=True, **opts)
    got = generate_full(m, IDS, 24, compile_step=True, **opts)
    assert got.extra["step"] == "static (compiled)" and got.capture_s > 0  # the compile, not counted as decoding
    assert ref.extra["fused_kernels"] is got.extra["fused_kernels"] is fused
    new_ref, new_got = ref.sequences[:, 6:], got.sequences[:, 6:]
    assert min(same_tokens_where_decided(new_ref, ref.scores, new_got, got.scores, COMPILED_SCORES)) >= 1


def test_the_compiled_step_writes_a_tokens_key_and_value_in_place(tiny_official: Path) -> None:
    """Inductor's code for the static step (torch._inductor.utils.run_and_get_code, C++ on this CPU) writes each
    layer's new key and value into the cache where they go and copies no layer's whole cache: no loop of it runs over
    a layer's 2 x B x nh x max_len x hs values. Each layer's keys and values are a tensor of their own, and the step
    makes its key and value views of it itself; a layer's slice of one cache-wide tensor, or views made before the
    step (inputs aliasing it), had inductor copy the layer's whole cache out and back around the write, a step (at
    124M and 1,024 slots in bf16, 150 MB read and written a token; gpt2-xl 1.3 GB)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from gpt2_port.generate.cache import StaticKVCache
    from gpt2_port.model.decode import DecodePlan

    m, _ = from_pretrained(tiny_official)
    cfg, slots = m.config, 64
    plan, cache = DecodePlan.for_model(m), StaticKVCache(m.config, 1, slots, m.dtype, "cpu")
    with torch.no_grad():
        m(torch.tensor([[3, 4, 5]]), cache=cache, hidden_only=True)
        cache.start(None, 3)
        cache.feed(torch.tensor([4]), 3)
        views = plan.cache_views(cache)
        eager = plan.static_step(cache, views, True)
        step = torch.compile(lambda: plan.static_step(cache, views, True), fullgraph=True, dynamic=False)
        got, codes = run_and_get_code(step)
    code = "\n".join(codes)
    layer = 2 * cfg.n_head * slots * cfg.head_dim  # a layer's cache, B = 1
    assert "index_copy" in code and not re.search(rf"\b{layer}L\b", code)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


def test_inductor_compiles_cudas_fused_step_with_its_gelu_in_c_fc(
    tiny_official: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused step as CUDA runs it at batch 1 (c_fc and its GELU as one torch._addmm_activation: forced here on
    the CPU, where that op's GELU is the erf one, on both sides) compiles as one graph with inductor and gives the
    uncompiled step's tokens wherever the scores decide them."""
    from gpt2_port.model import decode

    monkeypatch.setattr(decode, "gelu_in_epilogue", lambda h, wb: wb is not None and wb[1] is not None)
    m, _ = from_pretrained(tiny_official)
    opts = dict(eos_token_id=None, output_scores=True, fused_kernels=True)
    ref = generate_full(m, IDS[:1], 24, static_cache=True, **opts)
    got = generate_full(m, IDS[:1], 24, compile_step=True, **opts)
    assert got.extra["step"] == "static (compiled)"
    new_ref, new_got = ref.sequences[:, 6:], got.sequences[:, 6:]
    assert min(same_tokens_where_decided(new_ref, ref.scores, new_got, got.scores, COMPILED_SCORES)) >= 1


def test_a_bf16_model_compiles_on_the_cpu_too() -> None:
    """The CPU's low-precision shortcuts (packed weights, float32 copies: model/lowp.py) read the CPU's capabilities,
    which dynamo will not trace: under torch.compile they step aside for F.linear, so a bf16 model's step compiles
    (it ran uncompiled before) and its tokens are the eager step's wherever the bf16 scores decide them."""
    m = chaotic_model(TINY, 3).to(torch.bfloat16)
    opts = dict(attention_mask=MASK, eos_token_id=None, output_scores=True)
    ref = generate_full(m, IDS, 16, static_cache=True, **opts)
    got = generate_full(m, IDS, 16, compile_step="eager", **opts)
    assert got.extra["step"] == "static (compiled)"
    new_ref, new_got = ref.sequences[:, 6:], got.sequences[:, 6:]
    assert min(same_tokens_where_decided(new_ref, ref.scores, new_got, got.scores, BF16_SCORES)) >= 1


def test_a_compile_that_fails_leaves_the_uncompiled_step(caplog: pytest.LogCaptureFixture) -> None:
    """A backend that fails (no C compiler or triton where inductor needs one, say) is logged once and the step runs
    uncompiled: the same tokens, and the step's name says so."""

    def broken(gm: torch.fx.GraphModule, example_inputs: list) -> None:  # noqa: ARG001
        raise RuntimeError("no C compiler found")

    m = chaotic_model(TINY, 3)
    ref = generate_full(m, IDS, 12, attention_mask=MASK, eos_token_id=None, static_cache=True)
    with caplog.at_level(logging.WARNING, logger="gpt2_port.generate.steps"):
        got = generate_full(m, IDS, 12, attention_mask=MASK, eos_token_id=None, compile_step=broken)
    assert got.extra["step"] == "static (compile failed)" and torch.equal(ref.sequences, got.sequences)
    warned = [r.getMessage() for r in caplog.records if "could not be compiled" in r.getMessage()]
    assert len(warned) == 1 and "no C compiler found" in warned[0], warned


def test_steps_of_many_shapes_each_compile() -> None:
    """Every kept step compiles a code object of its own: dynamo's recompile limit (8 by default, 2 here) counts
    entries per code object, and steps made from one shared function failed to compile past it (the 9th batch size
    in a process ran uncompiled)."""
    m = chaotic_model(TINY, 3)
    with torch._dynamo.config.patch(recompile_limit=2):  # (monkeypatch would delete the config's entry after)
        names = [generate_full(m, IDS[:1].repeat(b, 1), 2, compile_step="eager").extra["step"] for b in (1, 2, 3, 4)]
    assert names == ["static (compiled)"] * 4


def test_only_the_first_call_falls_back_and_out_of_memory_is_raised() -> None:
    """A compiled call that fails after the first is the step's own error (under a CUDA graph's capture, the
    capture's), raised; out of memory in the compile (dynamo wraps it) is raised too, not run eagerly."""
    from gpt2_port.devices import out_of_memory
    from gpt2_port.generate.steps import CompiledStep

    x = torch.ones(3)

    def breaks_on_second_call(gm: torch.fx.GraphModule, example_inputs: list):  # noqa: ANN202, ARG001
        calls = []

        def run(*args):  # noqa: ANN002, ANN202
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("operation not permitted when stream is capturing")
            return gm.forward(*args)

        return run

    step = CompiledStep(lambda: x * 2, breaks_on_second_call)
    assert torch.equal(step(), x * 2) and step.compile_s > 0
    with pytest.raises(RuntimeError, match="stream is capturing"):
        step()
    assert not step.failed

    def out_of_memory_backend(gm: torch.fx.GraphModule, example_inputs: list) -> None:  # noqa: ARG001
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    step = CompiledStep(lambda: x * 3, out_of_memory_backend)
    with pytest.raises(Exception) as raised:  # noqa: PT011 - dynamo's wrapper, whose cause is the error
        step()
    assert out_of_memory(raised.value) and not step.failed


def test_compile_step_names_a_backend_torch_knows() -> None:
    m = chaotic_model(TINY, 3)
    with pytest.raises(UsageError, match="'indcutor' is not a torch.compile backend"):
        generate_full(m, IDS[:1], 4, compile_step="indcutor")
    assert generate_full(m, IDS[:1], 4, compile_step=False).extra["step"] == "plan"  # the CPU's default


def test_generate_compile_on_the_command_line(tiny_official: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gpt2-port generate --compile` names the compiled step and the compile's time, not counted in decode tok/s."""
    assert main(["generate", str(tiny_official), "Hello", "--greedy", "--max-new-tokens", "6", "--compile"]) == 0
    err = capsys.readouterr().err
    assert "step: static (compiled)" in err and "step compiled in " in err, err
