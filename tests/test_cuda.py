"""The CUDA paths, where a GPU is: bit-exact float32 forward parity, backward parity, a bf16 training step with each
kernel set, training and resume on the GPU and across devices, the measured memory check, torch.compile with
inductor, and the CUDA-graph decode step. Every test here is marked `cuda`: on a machine without a GPU each is
reported NOT RUN with the reason (tests/conftest.py), never dropped silently."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_greedy, same_tokens_where_decided, summed_in_order, weights

from gpt2_port.cli import main
from gpt2_port.config import GPT2Config
from gpt2_port.io.demo import write_demo_checkpoint

pytestmark = [pytest.mark.cuda, pytest.mark.exactness]
SMALL = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=512)


@pytest.fixture(autouse=True)
def _tf32_put_back():
    """A training run turns TF32 on for the process (--tf32, the default, as nanoGPT does) and leaves it so: the
    float32 tests after one must not run on TF32 tensor cores."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("cuda")
    ck = write_demo_checkpoint(d / "ck", config=SMALL, seed=3)
    data = d / "data"
    data.mkdir()
    ids = np.random.default_rng(0).integers(0, SMALL.vocab_size, 20000).astype("<u2")
    ids.tofile(data / "train.bin")
    ids[:4000].tofile(data / "val.bin")
    return ck, data


def _log(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]


def _train(ck: Path, data: Path, out: Path, *extra: str) -> int:
    argv = ["train", "--init", str(ck), "--data", str(data), "--out", str(out), "--batch-size", "4"]
    argv += ["--block-size", "64", "--eval-every", "2", "--eval-batches", "2", "--no-plot", "--dropout", "0.1"]
    return main([*argv, *extra])


@pytest.mark.parametrize("size", ["tiny", "124M"])
def test_the_float32_forward_is_bit_exact_on_cuda(size: str, tiny_official: Path, request, tmp_path: Path) -> None:
    """q, k and v stay views of one c_attn on the GPU (one matmul, as transformers runs it): 0 at every forward
    point, the padded batch's too. The cached decodings (the static step replayed as a CUDA graph, attending over its
    whole cache, against transformers' growing cache) are held to their tolerance, as on the CPU."""
    ck = tiny_official if size == "tiny" else request.getfixturevalue("ckpt124")
    js = tmp_path / "r.json"
    assert main(["parity", str(ck), "--device", "cuda", "--json", str(js)]) == 0
    r = json.loads(js.read_text())
    forward = [p for p in r["points"] if not p["name"].startswith("decode.")]
    decode = [p for p in r["points"] if p["name"].startswith("decode.")]
    assert r["device"].startswith("cuda") and r["decode_path"] == "cuda graph", r["decode_path"]
    assert all(p["norm_rel"] == 0.0 for p in forward), forward
    assert len(decode) == 2 and all(p["passed"] for p in decode), decode


def test_backward_parity_on_cuda_is_within_transformers_own_noise(tiny_official: Path, tmp_path: Path) -> None:
    js = tmp_path / "b.json"
    assert (
        main(["parity", str(tiny_official), "--backward", "--train-steps", "3", "--device", "cuda", "--json", str(js)])
        == 0
    )
    d = json.loads(js.read_text())
    assert d["passed"] and d["as_close_as_reference"] is True


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_a_bf16_step_on_cuda_lies_within_transformers_own_bf16_distance(tiny_official: Path, kernels: str) -> None:
    from gpt2_port_checks import backward

    r = backward.run_backward(
        str(tiny_official), ["The students opened their books"], dtypes="bfloat16", devices="cuda", kernels=kernels
    ).reports[0]
    assert r.precision == "bfloat16 autocast" and r.as_close_as_reference is True and r.passed


@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "float32"])
def test_training_runs_on_cuda_and_resumes_exactly(small: tuple[Path, Path], tmp_path: Path, dtype: str, kernels):
    """6 steps == 3 steps + a resume to 6 on the GPU: the same losses and the same weights bit for bit (fused AdamW
    restored with its step count on the GPU, the CUDA generator's state restored; fp16 with its GradScaler's).
    --deterministic: the default flash attention backward sums dQ with atomics, in another order each run."""
    ck, data = small
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--device", "cuda", "--dtype", dtype, "--kernels", kernels, "--steps", "6", "--deterministic"]
    assert _train(ck, data, full, *common) == 0
    assert _train(ck, data, part, *common, "--stop-at", "3") == 0
    assert main(["train", "--resume", str(part), "--device", "cuda", "--no-plot"]) == 0
    a, b = _log(full), _log(part)
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    wa, wb = weights(full), weights(part)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    from gpt2_port.train.throughput import peak_flops

    known = peak_flops(torch.device("cuda"), dtype, tf32=True)[0] is not None  # a GPU in the peak table
    assert len(a) == 6 and all((r["mfu"] is not None) == known for r in a), a
    assert all(r["mfu"] is None or 0 < r["mfu"] < 1 for r in a)


@pytest.mark.parametrize(("first", "then"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_run_saved_on_one_device_resumes_on_the_other(small: tuple[Path, Path], tmp_path: Path, first, then):
    ck, data = small
    out = tmp_path / "run"
    assert _train(ck, data, out, "--device", first, "--steps", "4", "--stop-at", "2") == 0
    js = tmp_path / "s.json"
    assert main(["train", "--resume", str(out), "--device", then, "--no-plot", "--json", str(js)]) == 0
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4]
    assert json.loads(js.read_text())["device"].startswith(then)  # the resume ran where it was asked to


def test_the_measured_memory_check_is_within_10_percent_of_the_peak(small: tuple[Path, Path], ckpt124: Path, tmp_path):
    """At 124M (about 2 GB of weights, gradients and moments, and the activations of 8 x 256 tokens): on the 2-layer
    model cuBLAS's workspaces (32 MiB per handle and stream, in both figures) would outweigh all it measures."""
    _, data = small  # ids below 512, valid for GPT-2's vocabulary too
    js = tmp_path / "s.json"
    argv = ["train", "--init", str(ckpt124), "--data", str(data), "--out", str(tmp_path / "run"), "--device", "cuda"]
    argv += ["--batch-size", "8", "--block-size", "256", "--steps", "3", "--eval-every", "0", "--no-plot"]
    assert main([*argv, "--json", str(js)]) == 0
    s = json.loads(js.read_text())
    assert s["peak_device_mb"] > 2000, s  # the model's state is in it
    assert s["memory_method"] == "measured"
    assert abs(s["memory_estimate_mb"] - s["peak_device_mb"]) <= 0.10 * s["peak_device_mb"], s


def test_train_compile_with_inductor_on_cuda(small: tuple[Path, Path], tmp_path: Path) -> None:
    ck, data = small
    eager, compiled = tmp_path / "e", tmp_path / "c"
    common = ["--device", "cuda", "--dtype", "bf16", "--steps", "4", "--dropout", "0"]
    js = tmp_path / "c.json"
    assert _train(ck, data, eager, *common) == 0
    assert _train(ck, data, compiled, *common, "--compile", "--json", str(js)) == 0
    assert json.loads(js.read_text())["compile"] is True
    a, b = _log(eager), _log(compiled)
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert y["train_loss"] == pytest.approx(x["train_loss"], rel=2e-2)


def test_bf16_training_on_cuda_pads_the_fused_head_by_default_and_keeps_the_real_rows(
    small: tuple[Path, Path], tmp_path: Path
) -> None:
    """`train`'s CUDA default pads the fast kernels' head (SMALL's 512 rows are already a multiple of 64, so 96 is
    asked for here: 576 rows); the padded run's losses track the unpadded one's, and the saved head has 512 rows."""
    ck, data = small
    runs = {}
    for pad in ("1", "96"):
        js = tmp_path / f"{pad}.json"
        common = ["--device", "cuda", "--dtype", "bf16", "--steps", "4", "--dropout", "0", "--json", str(js)]
        assert _train(ck, data, tmp_path / pad, *common, "--pad-vocab", pad) == 0
        runs[pad] = (_log(tmp_path / pad), json.loads(js.read_text()))
        assert weights(tmp_path / pad)["wte.weight"].shape[0] == SMALL.vocab_size
    assert runs["1"][1]["head_vocab"] == 512 and runs["96"][1]["head_vocab"] == 576
    assert len(runs["1"][0]) == len(runs["96"][0]) == 4
    for a, b in zip(runs["1"][0], runs["96"][0]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-2)
    from gpt2_port.train import TrainArgs

    assert TrainArgs(dtype="bf16").resolved_pad_vocab("cuda") == 64


def test_the_cuda_graph_decode_gives_the_eager_steps_tokens(tiny_official: Path) -> None:
    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        m = GPT2.from_pretrained(str(tiny_official), dtype=dtype, device="cuda")
        ids = torch.tensor([[464, 2444, 4721, 511, 3835]])
        opts = dict(eos_token_id=None, output_scores=True)
        first = generate_full(m, ids, 40, cuda_graph=True, **opts)
        graph = generate_full(m, ids, 40, cuda_graph=True, **opts)  # the kept graph, replayed
        eager = generate_full(m, ids, 40, cuda_graph=False, **opts)
        assert first.extra["step"] == graph.extra["step"] == "cuda graph" and eager.extra["step"] == "static"
        # the replay runs the eager step's kernels; should cuBLAS pick others under capture, the scores round apart,
        # so the tokens are compared where the scores decide them (conftest.same_tokens_where_decided)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        want, want_scores = eager.sequences[:, 5:].cpu(), [s.cpu() for s in eager.scores]
        for g in (first, graph):
            got, got_scores = g.sequences[:, 5:].cpu(), [s.cpu() for s in g.scores]
            assert min(same_tokens_where_decided(want, want_scores, got, got_scores, tol)) >= 1, dtype
        assert first.capture_s > 0 and graph.capture_s == 0 and graph.decode_s > 0  # recorded once, not counted


def test_a_generation_started_from_anothers_callback_records_a_graph_of_its_own(tiny_official: Path) -> None:
    """A generation of the same shapes started from a running one's callback on CUDA gets a captured step of its own
    (the first one's cache and graph are that generation's until it ends): each gives its tokens alone."""
    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full

    m = GPT2.from_pretrained(str(tiny_official), dtype=torch.bfloat16, device="cuda")
    a_ids, b_ids = torch.tensor([[464, 2444, 4721]]), torch.tensor([[5, 6, 7]])
    opts = dict(eos_token_id=None)
    alone_a, alone_b = (generate_full(m, ids, 12, **opts).sequences for ids in (a_ids, b_ids))
    inner: list[torch.Tensor] = []

    def start_b(made: int) -> None:
        if made == 4:
            inner.append(generate_full(m, b_ids, 12, **opts).sequences)

    outer = generate_full(m, a_ids, 12, progress=start_b, **opts)
    assert outer.extra["step"] == "cuda graph" and torch.equal(outer.sequences, alone_a)
    assert torch.equal(inner[0], alone_b) and len(m.__dict__["_static_steps"]) == 2


@pytest.mark.parametrize("kernel", ["memory-efficient", "cuDNN", "math"])
def test_the_static_step_with_another_attention_kernel_records_and_gives_its_tokens(
    tiny_official: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """The GPU benchmark's rows `ours, SDPA attention`, `ours, cuDNN attention` and `ours, math attention`
    (steps.STATIC_BACKENDS set for the call, steps.ATTENTION_KERNEL off): in bf16 the static step attends through SDPA
    with that kernel alone (seen in the aten ops it dispatches, run eagerly), is recorded as a CUDA graph (not `static
    (capture failed)`), and gives the default step's tokens (its one-kernel attention) wherever the scores decide
    them."""
    from torch.nn.attention import SDPBackend

    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full, steps
    from gpt2_port.model.attention_kernel import attention_kernels

    m = GPT2.from_pretrained(str(tiny_official), dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([[464, 2444, 4721, 511, 3835]])
    opts = dict(eos_token_id=None, output_scores=True)
    want = generate_full(m, ids, 40, **opts)
    backend = {"memory-efficient": SDPBackend.EFFICIENT_ATTENTION, "cuDNN": SDPBackend.CUDNN_ATTENTION}
    monkeypatch.setattr(steps, "STATIC_BACKENDS", [backend.get(kernel, SDPBackend.MATH)])
    monkeypatch.setattr(steps, "ATTENTION_KERNEL", False)
    seen = attention_kernels(lambda: generate_full(m, ids, 4, cuda_graph=False, **opts), torch.device("cuda"))
    assert kernel in seen, seen  # the prefill's own kernel beside it
    got = generate_full(m, ids, 40, **opts)
    assert want.extra["step"] == got.extra["step"] == "cuda graph"
    new = [g.sequences[:, 5:].cpu() for g in (want, got)]
    scores = [[s.cpu() for s in g.scores] for g in (want, got)]
    assert min(same_tokens_where_decided(new[0], scores[0], new[1], scores[1], 2e-2)) >= 1


def test_the_compiled_step_recorded_as_a_cuda_graph_gives_the_uncompiled_graphs_tokens(tiny_official: Path) -> None:
    """`compile_step=True` (`generate --compile`): inductor's triton kernels, compiled once during the graph's warm-up
    and recorded in it; float32 and bf16 tokens are the uncompiled graph's wherever the scores decide them, the step
    is traced once for the whole generation, and the second generation replays the kept graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full

    for dtype in (torch.float32, torch.bfloat16):
        m = GPT2.from_pretrained(str(tiny_official), dtype=dtype, device="cuda")
        ids = torch.tensor([[464, 2444, 4721, 511, 3835]])
        opts = dict(eos_token_id=None, output_scores=True)
        plain = generate_full(m, ids, 40, **opts)
        inductor = CompileCounterWithBackend("inductor")
        first = generate_full(m, ids, 40, compile_step=inductor, **opts)
        again = generate_full(m, ids, 40, compile_step=inductor, **opts)
        assert plain.extra["step"] == "cuda graph"
        assert first.extra["step"] == again.extra["step"] == "cuda graph (compiled)", first.extra
        assert inductor.frame_count == 1 and first.capture_s > 0 and again.capture_s == 0
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        want, want_scores = plain.sequences[:, 5:].cpu(), [s.cpu() for s in plain.scores]
        for g in (first, again):
            got, got_scores = g.sequences[:, 5:].cpu(), [s.cpu() for s in g.scores]
            assert min(same_tokens_where_decided(want, want_scores, got, got_scores, tol)) >= 1, dtype


@pytest.mark.parametrize("rows", [8, 32, 64])
def test_a_padded_sampled_batch_runs_through_the_captured_step_with_the_eager_steps_tokens(
    tiny_official: Path, rows: int
) -> None:
    """Left-padded prompts of several lengths, sampled with a seed, in bf16: the captured step serves the batch (one
    shape for every row), and its tokens are the eager static step's wherever the scores decide them (the same
    seeded noise on both sides: the draw is outside the graph)."""
    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full

    m = GPT2.from_pretrained(str(tiny_official), dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(rows)
    lens = torch.randint(3, 12, (rows,), generator=g)
    T, V, N = int(lens.max()), m.config.vocab_size, 24
    ids = torch.randint(0, V, (rows, T), generator=g)
    mask = (torch.arange(T)[None] >= (T - lens)[:, None]).long()
    opts = dict(attention_mask=mask, do_sample=True, seed=5, eos_token_id=None, output_scores=True)
    graph = generate_full(m, ids, N, cuda_graph=True, **opts)
    eager = generate_full(m, ids, N, cuda_graph=False, **opts)
    assert graph.extra["step"] == "cuda graph" and eager.extra["step"] == "static"
    gen = torch.Generator(device="cuda").manual_seed(5)  # the noise sampling.draw takes from the seeded generator
    noise = [torch.empty(rows, V, device="cuda").exponential_(1, generator=gen).cpu() for _ in range(N)]
    want, want_scores = eager.sequences[:, T:].cpu(), [s.cpu() for s in eager.scores]
    got, got_scores = graph.sequences[:, T:].cpu(), [s.cpu() for s in graph.scores]
    assert min(same_tokens_where_decided(want, want_scores, got, got_scores, 2e-2, noise)) >= 1


def test_generation_under_autocast_runs_through_the_captured_step(tiny_official: Path) -> None:
    """A float32 model generating under bf16 autocast: the step's k and v (bf16 out of the matmuls) go into the
    float32 cache, so the capture and the eager static step both run, with the same tokens where decided. The
    weights require grad (a model mid-training), so autocast caches their bf16 copies: the graph must not read
    those, which autocast frees when its block ends (here reused by other tensors before the replay). Without
    autocast the model gets its own float32 graph, not the bf16 one."""
    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full

    m = GPT2.from_pretrained(str(tiny_official), device="cuda").requires_grad_(True)
    ids = torch.tensor([[464, 2444, 4721, 511, 3835]])
    opts = dict(eos_token_id=None, output_scores=True)

    def same(a, b, tol: float) -> bool:  # noqa: ANN001
        want, want_scores = a.sequences[:, 5:].cpu(), [s.cpu() for s in a.scores]
        got, got_scores = b.sequences[:, 5:].cpu(), [s.cpu() for s in b.scores]
        return min(same_tokens_where_decided(want, want_scores, got, got_scores, tol)) >= 1

    with torch.autocast("cuda", dtype=torch.bfloat16):
        graph = generate_full(m, ids, 24, cuda_graph=True, **opts)
        eager = generate_full(m, ids, 24, cuda_graph=False, **opts)
    assert graph.extra["step"] == "cuda graph" and eager.extra["step"] == "static"
    assert same(eager, graph, 2e-2)
    scribble = [torch.full((n,), 7.0, device="cuda", dtype=torch.bfloat16) for n in (4096, 16384, 65536) * 4]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        replayed = generate_full(m, ids, 24, cuda_graph=True, **opts)
    assert replayed.capture_s == 0 and same(eager, replayed, 2e-2)  # the kept graph, over the weights themselves
    del scribble
    plain = generate_full(m, ids, 24, cuda_graph=True, **opts)
    plain_eager = generate_full(m, ids, 24, cuda_graph=False, **opts)
    assert plain.capture_s > 0 and same(plain_eager, plain, 2e-5)  # its own float32 graph


@pytest.mark.parametrize("how", ["hook", "edit"])
def test_a_hook_or_an_edit_keeps_the_captured_step_out(tiny_official: Path, how: str) -> None:
    """A steering vector added to block 0's output (a forward hook, or model.edit): every step runs the forward, so
    it steers every token (the captured step calls no module and passes no tap); gone, the graph is back."""
    import contextlib

    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full

    m = GPT2.from_pretrained(str(tiny_official), device="cuda")
    ids = torch.tensor([[464, 2444, 4721, 511, 3835]])
    d = torch.randn(m.config.n_embd, generator=torch.Generator().manual_seed(0)).cuda() * 3.0
    plain = generate_full(m, ids, 16, eos_token_id=None)
    if how == "hook":
        handle = m.h[0].register_forward_hook(lambda mod, args, out: out + d)
        ctx = contextlib.nullcontext()
    else:
        handle, ctx = None, m.edit({"block.0": lambda t: t + d})
    with ctx:
        steered = generate_full(m, ids, 16, eos_token_id=None, output_scores=True)
        slow = generate_full(m, ids, 16, eos_token_id=None, output_scores=True, use_cache=False)  # all recomputed
    if handle is not None:
        handle.remove()
    assert plain.extra["step"] == "cuda graph" and steered.extra["step"] == "forward"
    want, got = slow.sequences[:, 5:].cpu(), steered.sequences[:, 5:].cpu()
    scores = ([s.cpu() for s in slow.scores], [s.cpu() for s in steered.scores])
    assert min(same_tokens_where_decided(want, scores[0], got, scores[1], 2e-5)) >= 1
    assert not torch.equal(steered.sequences, plain.sequences)
    assert generate_full(m, ids, 16, eos_token_id=None).extra["step"] == "cuda graph"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("static", [True, False], ids=["static-step", "growing-keys"])
def test_low_precision_decoding_never_dispatches_to_cudnn_attention(
    tiny_official: Path, static: bool, dtype: torch.dtype
) -> None:
    """cuDNN's SDPA kernel builds a plan for every new shape (bf16 decode on an H100 ran 10x slower than float32 from
    it): the prefill and every step, the static one and the one whose keys grow, run SDPA's other kernels (watched
    in the aten ops each call dispatches; eager steps, as a capture would record the same kernels)."""
    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full
    from gpt2_port.model.attention_kernel import attention_kernels

    m = GPT2.from_pretrained(str(tiny_official), dtype=dtype, device="cuda")
    ids = torch.tensor([[464, 2444, 4721, 511, 3835]])
    run = lambda: generate_full(m, ids, 8, cuda_graph=False, static_cache=static, eos_token_id=None)  # noqa: E731
    seen = attention_kernels(run, torch.device("cuda"))
    assert seen and "cuDNN" not in seen, seen


def _syncs(fn) -> int:  # noqa: ANN001
    """The waits for the GPU `fn()` makes: the synchronising CUDA operations torch's sync debug mode flags, and the
    waits for an event (the decode loop's read of a step's ids waits for its copy's event, which the mode does not
    flag), counted."""
    import warnings

    events = []
    real = torch.cuda.Event.synchronize

    def counted(self: torch.cuda.Event) -> None:
        events.append(1)
        real(self)

    with warnings.catch_warnings(record=True) as seen, pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda.Event, "synchronize", counted)
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in seen) + len(events)


def test_reading_a_steps_ids_waits_for_their_copy_not_for_the_work_queued_after_it() -> None:
    """The decode loop queues step k + 1 before it reads step k's ids: the read (readback.Readback) waits for the
    copy of those ids alone, while the device still runs what was queued after it (here a sleep of about a second);
    its two pinned buffers serve the steps in turn."""
    from gpt2_port.generate.readback import Readback

    r = Readback(4, torch.device("cuda"))
    ids = torch.arange(4, device="cuda")
    a = r.send(ids)
    torch.cuda._sleep(2_000_000_000)  # GPU clock cycles: about a second of device time queued after the copy
    later = torch.cuda.Event()
    later.record()
    assert r.read(a) == [0, 1, 2, 3]
    assert not later.query()  # the sleep runs on: the read did not wait for it
    b, c = r.send(ids + 10), r.send(ids + 20)
    assert r.read(b) == [10, 11, 12, 13] and r.read(c) == [20, 21, 22, 23]
    torch.cuda.synchronize()


def test_a_token_waits_for_the_gpu_once(small: tuple[Path, Path]) -> None:
    """Sampled decode with the captured step: one wait per token (the new ids and the finite flag, read together, one
    step late; multinomial's own checks would be two more)."""
    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full

    ck, _ = small
    m = GPT2.from_pretrained(str(ck), device="cuda")
    ids = torch.tensor([[5, 17, 42]], device="cuda")
    opts = dict(eos_token_id=None, do_sample=True, top_k=50, seed=1)
    generate_full(m, ids, 24, **opts)  # records the graph
    n = _syncs(lambda: generate_full(m, ids, 24, **opts))
    assert 24 <= n <= 24 + 1, n  # one per token, and the prompt's id range (none counted: the count did not work)
    # a left-padded batch with EOS, temperature, top-k, top-p and a repetition penalty: still one wait a token
    ids = torch.tensor([[0, 0, 5, 17, 42], [3, 9, 11, 2, 8], [0, 7, 7, 1, 4]], device="cuda")
    mask = (ids != 0).long()
    opts = dict(attention_mask=mask, eos_token_id=11, do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
    opts.update(repetition_penalty=1.3, seed=2)
    made = generate_full(m, ids, 24, **opts).sequences.shape[1] - ids.shape[1]  # records this batch's graph
    n = _syncs(lambda: generate_full(m, ids, 24, **opts))
    one = _syncs(lambda: generate_full(m, ids, 1, **opts))  # the prompt's checks (ids and mask on the GPU) + 1
    assert made >= 2 and n - one == made - 1, (made, n, one)


@pytest.mark.parametrize(
    ("dtype", "kernels", "accum"), [("bf16", "fast", 1), ("fp16", "reference", 2)], ids=["bf16-fast", "fp16-accum"]
)
def test_a_training_step_waits_for_the_gpu_once(
    small: tuple[Path, Path], tmp_path: Path, dtype: str, kernels: str, accum: int
) -> None:
    """A training step (overlapped, the default on CUDA: the AdamW step queued before the read): one wait (the loss
    and the gradient norm), in bf16 and in fp16 under the grad scaler (its unscale, inf check and fused AdamW step on
    the device), with gradient accumulation too; every micro-batch leaves from pinned memory."""
    from gpt2_port import GPT2
    from gpt2_port.io.tokens import TokenFile
    from gpt2_port.train import TrainArgs, Trainer, prepare_model

    ck, data = small
    pinned: list[bool] = []
    real_pin = torch.Tensor.pin_memory

    def pin(self: torch.Tensor, *a, **k) -> torch.Tensor:  # noqa: ANN002, ANN003
        out = real_pin(self, *a, **k)
        pinned.append(out.is_pinned())
        return out

    args = TrainArgs(
        steps=6, batch_size=4, block_size=64, dtype=dtype, kernels=kernels, grad_accum=accum, eval_every=0, dropout=0.0
    )
    model = GPT2.from_pretrained(str(ck))
    prepare_model(model, args, torch.device("cuda"))
    t = Trainer(model, args, TokenFile(data / "train.bin", SMALL.vocab_size), None, tmp_path / "o", "cuda")
    t.step(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "pin_memory", pin)
        waits = [_syncs(lambda s=s: t.step(s)) for s in range(1, 5)]
    assert max(waits) <= 1 and sum(waits) >= 1, waits  # at most one a step (none at all: the count did not work)
    assert len(pinned) == 4 * accum and all(pinned)  # each micro-batch left from pinned memory


@pytest.mark.parametrize("dtype", ["float32", "fp16"])
def test_an_overlapped_run_waits_once_a_step_and_trains_as_the_loop_that_reads_first(
    small: tuple[Path, Path], tmp_path: Path, dtype: str
) -> None:
    """On the GPU the loop queues step k + 1 before it reads step k (overlap, the default there), its AdamW step
    queued too (in fp16 with the grad scaler's unscale, inf check and update): over a whole run, one wait a step (8
    steps against 4: the setup and the save wait alike), and the losses and weights bit for bit those of the loop
    that reads each step first (deterministic kernels)."""
    from gpt2_port import GPT2
    from gpt2_port.io.tokens import TokenFile
    from gpt2_port.train import TrainArgs, Trainer, prepare_model
    from gpt2_port.train.setup import deterministic_kernels

    ck, data = small
    dev = torch.device("cuda")

    def run(steps: int, overlap: bool | None, out: str) -> tuple[Trainer, int]:
        args = TrainArgs(steps=steps, batch_size=4, block_size=64, eval_every=0, dropout=0.0, overlap=overlap)
        args.dtype = dtype
        model = GPT2.from_pretrained(str(ck))
        prepare_model(model, args, dev)
        t = Trainer(model, args, TokenFile(data / "train.bin", SMALL.vocab_size), None, tmp_path / out, dev)
        with deterministic_kernels(dev, True):
            return t, _syncs(t.run)

    (_, w4), (t8, w8), (ref, _) = run(4, None, "4"), run(8, None, "8"), run(8, False, "ref")
    assert t8.overlap and not ref.overlap
    assert w8 - w4 == 4, (w4, w8)
    assert [r["train_loss"] for r in t8.records] == [r["train_loss"] for r in ref.records]
    assert all(torch.equal(p, q) for p, q in zip(t8.model.parameters(), ref.model.parameters(), strict=True))


def test_a_model_moved_to_cuda_after_the_load_keeps_c_attn_one_tensor(tiny_official: Path) -> None:
    """`.to("cuda")` after a CPU load: q, k and v stay views of one c_attn, so the forward is bit for bit the one a
    load straight onto the GPU gives (three matmuls instead of one were not bit-exact at 124M on an H100)."""
    from gpt2_port import GPT2
    from gpt2_port.model.c_attn import qkv_tied

    moved = GPT2.from_pretrained(str(tiny_official)).to("cuda")
    direct = GPT2.from_pretrained(str(tiny_official), device="cuda")
    assert all(qkv_tied(b.attn.q_proj, b.attn.k_proj, b.attn.v_proj) for b in moved.h)
    ids = torch.tensor([[464, 2444, 4721, 511, 3835], [464, 3797, 26172, 262, 10211]], device="cuda")
    with torch.no_grad():
        assert torch.equal(moved(ids), direct(ids))


def test_greedy_124m_on_cuda_gives_transformers_tokens_for_128(ckpt124: Path) -> None:
    """float32 greedy on the GPU, through the captured step (fused, generate's default there, and with the forward's
    ops) and through the eager step whose keys grow, against transformers' generate on the same GPU: scores within
    float32 rounding (SCORES_F32 of tests/test_generate.py) and the same tokens wherever the scores decide them, over
    128 new tokens."""
    from transformers import GPT2LMHeadModel

    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full

    hf = GPT2LMHeadModel.from_pretrained(ckpt124, dtype=torch.float32).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([[464, 2444, 4721, 511, 3835]], device="cuda")
    with torch.inference_mode():
        ref = hf_greedy(hf, ids, None, 128)
    del hf
    want, want_scores = ref.sequences[:, 5:].cpu(), [x.float().cpu() for x in ref.scores]
    assert want.shape == (1, 128)
    m = GPT2.from_pretrained(str(ckpt124), device="cuda")
    for graph, fused in ((True, None), (True, False), (False, None)):
        opts = dict(cuda_graph=graph, static_cache=graph, fused_kernels=fused, eos_token_id=None, output_scores=True)
        g = generate_full(m, ids, 128, **opts)
        assert (g.extra["step"] == "cuda graph") == graph and g.extra["fused_kernels"] == (graph and fused is None)
        got, got_scores = g.sequences[:, 5:].cpu(), [x.cpu() for x in g.scores]
        assert min(same_tokens_where_decided(want, want_scores, got, got_scores, 2e-5)) >= 1


def test_generate_and_eval_commands_run_on_cuda(tiny_official: Path, tmp_path: Path, capsys) -> None:
    """The commands on the GPU: `generate` in bf16 decodes through the captured step and reports its capture, the
    device's peak memory, the device and the dtype; `eval` in float32 gives the CPU's perplexity to rounding."""
    js = tmp_path / "g.json"
    argv = ["generate", str(tiny_official), "The cat", "--device", "cuda", "--dtype", "bf16", "--max-new-tokens", "8"]
    assert main([*argv, "--min-new-tokens", "8", "--seed", "0", "--json", str(js)]) == 0  # no sampled EOS ends it
    err = capsys.readouterr().err
    g = json.loads(js.read_text())
    assert g["decode_step"] == "cuda graph" and g["cuda_graph_capture_s"] > 0 and g["peak_device_mb"] > 0, g
    assert g["device"].startswith("cuda") and g["dtype"] == "bfloat16" and len(g["generated_ids"][0]) == 8
    assert "CUDA graph recorded in" in err and "step: cuda graph" in err
    text = tmp_path / "t.txt"
    text.write_text("The students opened their books and began to read. " * 20)
    res = {}
    for dev in ("cuda", "cpu"):
        out = tmp_path / f"{dev}.json"
        assert main(["eval", str(tiny_official), "--text", str(text), "--device", dev, "--json", str(out)]) == 0
        res[dev] = json.loads(out.read_text())
    assert res["cuda"]["device"].startswith("cuda") and res["cuda"]["tokens"] == res["cpu"]["tokens"]
    assert res["cuda"]["nll"] == pytest.approx(res["cpu"]["nll"], rel=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eval_check_on_cuda_lies_within_its_tolerance_beside_the_floor(
    tiny_official: Path, tmp_path: Path, dtype: str
) -> None:
    """`eval --check` on the GPU: the port's NLLs against sdpa transformers in the same dtype, each within its
    tolerance, beside transformers' eager-against-sdpa floor (in float32 also within that floor)."""
    text = tmp_path / "t.txt"
    text.write_text("The students opened their books and began to read. " * 40)
    out = tmp_path / "e.json"
    argv = ["eval", str(tiny_official), "--text", str(text), "--device", "cuda", "--dtype", dtype, "--check"]
    assert main([*argv, "--max-length", "64", "--json", str(out)]) == 0
    c = json.loads(out.read_text())["check"]
    assert c["passed"] and c["noise_floor"] is not None and all(r["floor"] is not None for r in c["rows"]), c
    if dtype == "float32":
        assert c["as_close_as_reference"] is True, c


def test_the_fused_step_takes_five_kernels_a_block_and_eleven_fewer_with_cublas_matmuls_than_op_for_op(
    tiny_official: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU, through the profiler as benchmarks.gpu_profile reads it (every kernel of a replayed CUDA graph
    counted), a batch-1 bf16 decode token through the fused step (generate's default on CUDA):

    - with cuBLAS's matmuls (steps.LINEAR_KERNEL off: the GPU benchmark's row `ours, cuBLAS matmuls`), 11 kernels a
      block and three more a token fewer than with the forward's ops (`--op-for-op`): c_fc with its GELU is one
      `_addmm_activation` (cuBLASLt's GELU-and-bias epilogue), where op for op c_fc is one GEMM with its bias and
      gelu_new eight elementwise kernels; each residual add (two a block, and the embeddings', whose two lookups the
      kernel makes too) is one kernel with the layer norm after it (model/add_norm.py's `_add_layer_norm`, a norm by
      its name: as many as torch's layer norms); the cache write (index_copy_, a copy) is one kernel with the attention
      (model/decode_attention.py's, an attention by its name: as many as SDPA's); the same matmul count either way
      (torch's addmm of a bias takes cuBLASLt's bias epilogue at batch 1 as well: 124M on an H100, torch 2.11,
      benchmarks/results-gpu-h100/profile.json);
    - by default, five a block: each matmul one `_norm_linear` (model/norm_linear.py: a matmul by its name), the
      adds and norms inside them (no `_add_layer_norm` left), the attention, and ln_f's add as one `_add_norm` a
      token: 2 a block fewer than with cuBLAS's matmuls, and fewer still by whatever split-K reductions cuBLAS ran.
    Its kernels are seen at all (the profile's own premise)."""
    from benchmarks.gpu_profile import profile
    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full, steps
    from gpt2_port.model import add_norm, decode_attention, norm_linear

    m = GPT2.from_pretrained(str(tiny_official), dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([[464, 2444, 4721, 511, 3835]], device="cuda")
    N = 16
    per_token, kinds, counts = {}, {}, {}
    for name, fused, linear in (("op for op", False, False), ("cuBLAS", True, False), ("default", True, True)):
        monkeypatch.setattr(steps, "LINEAR_KERNEL", linear)
        run = lambda f=fused: generate_full(m, ids, N, eos_token_id=None, do_sample=False, fused_kernels=f)  # noqa: E731
        g = run()  # the capture
        assert g.extra["step"] == "cuda graph" and g.extra["fused_kernels"] is fused
        r = profile(run, torch.device("cuda"), 1, N, 100)  # every kernel's name among the top
        per_token[name] = r["kernels_per_unit"]
        kinds[name] = {k: v["count_per_unit"] * N for k, v in r["kinds"].items()}
        counts[name] = {k["name"]: round(k["count_per_unit"] * N) for k in r["top"]}
        assert r["busy_us_per_unit"] > 0 and kinds[name].get("matmul", 0) >= 4 * N
    broken = [k.broken for k in (add_norm.KERNEL, decode_attention.KERNEL, *norm_linear.KERNELS)]
    assert broken == [None] * len(broken), broken
    n = m.config.n_layer

    def named(run: str, prefix: str) -> int:
        return sum(c for k, c in counts[run].items() if k.startswith(prefix))

    assert named("cuBLAS", "_add_layer_norm") == (2 * n + 1) * (N - 1) and named("cuBLAS", "_norm_linear") == 0
    fewer = (per_token["op for op"] - per_token["cuBLAS"]) * N
    # by kind: the GELU's eight elementwise kernels a block and the residual adds, the cache writes, every other kind
    # the same
    by_kind = {k: round(kinds["op for op"].get(k, 0) - kinds["cuBLAS"].get(k, 0)) for k in kinds["op for op"]}
    by_kind |= {k: -round(v) for k, v in kinds["cuBLAS"].items() if k not in kinds["op for op"]}
    assert fewer == pytest.approx((11 * n + 3) * (N - 1)), (per_token, by_kind)
    assert {k: v for k, v in by_kind.items() if v} == {"elementwise": (10 * n + 3) * (N - 1), "copy": n * (N - 1)}
    # the default step: four matmul kernels and the attention a block, ln_f's add and norm a token
    assert named("default", "_norm_linear") == 4 * n * (N - 1), counts["default"]
    assert named("default", "_decode_attention") == n * (N - 1) and named("default", "_add_layer_norm") == 0
    assert named("default", "_add_norm") == N - 1, counts["default"]
    assert (per_token["cuBLAS"] - per_token["default"]) * N >= 2 * n * (N - 1) - 0.5, per_token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bf16", "fp16"])
def test_the_attention_kernel_writes_the_slot_and_attends_within_rounding_of_float64(dtype: torch.dtype) -> None:
    """model/decode_attention.py's Triton kernel on the GPU (the fused decode step's): the token's key and value in
    their slot bit for bit, the rest of the cache untouched, and the attention over the masked cache within the
    dtype's epsilon times the output's largest value of float64's (4 in float32), a block all masked first included;
    CUDA graph capture and replay give the same output. The CPU test's inputs (tests/test_gpu_kernels.py), on the GPU,
    GPT-2's head size."""
    import torch.nn.functional as F
    from conftest import attention_inputs

    from gpt2_port.model import decode_attention

    q, kv, layer, bias, slot = (t.cuda() for t in attention_inputs(dtype, 64))
    assert decode_attention.in_kernel(q, kv, layer, bias)
    want_layer = layer.clone().index_copy_(3, slot, kv)
    first = layer.clone()  # the first call for these shapes is checked against the cache write and SDPA (gpu_kernel.py)

    def write_and_sdpa() -> torch.Tensor:
        keys, values = first.index_copy_(3, slot, kv).unbind(0)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias[:, None, None], scale=0.125)

    decode_attention.attend(q, kv, first, bias, slot, 0.125, write_and_sdpa)
    out = decode_attention.attend(q, kv, layer, bias, slot, 0.125, lambda: pytest.fail("the fallback ran"))
    assert decode_attention.KERNEL.broken is None and torch.equal(layer, want_layer)
    keys, values = want_layer.double().unbind(0)
    truth = F.scaled_dot_product_attention(
        q.double(), keys, values, attn_mask=bias.double()[:, None, None], scale=0.125
    )
    err = (out.double() - truth).abs().max().item() / (torch.finfo(dtype).eps * truth.abs().max().item())
    assert out.shape == q.shape and err <= (4.0 if dtype == torch.float32 else 1.0), err
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = decode_attention.attend(q, kv, layer, bias, slot, 0.125, lambda: pytest.fail("the fallback ran"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_a_long_cache_split_over_programs_attends_within_rounding_of_float64(dtype: torch.dtype) -> None:
    """The attention kernel over a 1,024-slot cache with 6 (row, head)s, split into spans (a program each) and
    combined by a second kernel, on the GPU: the token's slot written, the output within 4 (float32) or 1 (bf16) of
    the dtype's epsilon of float64's, a row left-padded past its first spans; recorded in a CUDA graph (the spans'
    sums in the graph's memory) and replayed, the same output; and unsplit (`split=False`) within the same bound."""
    import torch.nn.functional as F
    from conftest import attention_inputs

    from gpt2_port.model import decode_attention
    from gpt2_port.model.decode_attention_triton import splits

    q, kv, layer, _, _ = (t.cuda() for t in attention_inputs(dtype, 64, L=1024))
    B, nh = q.shape[:2]
    assert splits(B * nh, 1024)[0] > 1
    slot = torch.tensor([1013], device="cuda")
    bias = torch.full((B, 1024), float("-inf"), device="cuda")
    bias[0, 543:1014] = 0.0
    bias[1, :1014] = 0.0
    bias = bias.to(dtype)
    want_layer = layer.clone().index_copy_(3, slot, kv)
    keys, values = want_layer.double().unbind(0)
    truth = F.scaled_dot_product_attention(
        q.double(), keys, values, attn_mask=bias.double()[:, None, None], scale=0.125
    )
    unit = torch.finfo(dtype).eps * truth.abs().max().item()
    bound = 4.0 if dtype == torch.float32 else 1.0

    def sdpa() -> torch.Tensor:
        keys, values = want_layer.unbind(0)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias[:, None, None], scale=0.125)

    for split in (True, False):
        decode_attention.attend(q, kv, layer.clone(), bias, slot, 0.125, sdpa, split)  # the first call's check
        cache = layer.clone()
        out = decode_attention.attend(q, kv, cache, bias, slot, 0.125, lambda: pytest.fail("the fallback ran"), split)
        assert decode_attention.KERNEL.broken is None and torch.equal(cache, want_layer)
        err = (out.double() - truth).abs().max().item() / unit
        assert err <= bound, (split, err)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = decode_attention.attend(q, kv, cache, bias, slot, 0.125, lambda: pytest.fail("the fallback ran"))
    g.replay()
    torch.cuda.synchronize()
    first = decode_attention.attend(q, kv, cache, bias, slot, 0.125, lambda: pytest.fail("the fallback ran"))
    assert torch.equal(replayed, first)


def test_a_long_generation_attends_through_the_split_kernel_with_the_unsplit_steps_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """500 new tokens make a 512-slot cache: the captured step attends through the split kernel and its combine,
    and gives the tokens of the step made with steps.SPLIT_ATTENTION off, wherever the scores decide them."""
    from conftest import chaotic_model

    from gpt2_port.generate import generate_full, steps

    m = chaotic_model(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=1024), seed=3).cuda()
    ids = torch.tensor([[464, 2444, 4721, 511]])
    opts = dict(eos_token_id=None, output_scores=True)
    split = generate_full(m, ids, 500, **opts)
    monkeypatch.setattr(steps, "SPLIT_ATTENTION", False)
    whole = generate_full(m, ids, 500, **opts)
    assert split.extra["step"] == whole.extra["step"] == "cuda graph"
    assert sorted(s.split_attention for s in m.__dict__["_static_steps"].values()) == [False, True]
    a, b = split.sequences[:, 4:].cpu(), whole.sequences[:, 4:].cpu()
    a_scores, b_scores = [s.cpu() for s in split.scores], [s.cpu() for s in whole.scores]
    assert min(same_tokens_where_decided(b, b_scores, a, a_scores, 2e-5)) >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bf16", "fp16"])
def test_the_add_norm_kernel_adds_as_torch_adds_and_norms_within_an_ulp_of_torchs_layer_norm(
    dtype: torch.dtype,
) -> None:
    """model/add_norm.py's Triton kernel on the GPU (the fused decode step's): the residual sum bit for bit torch's
    `x + d` (the float32 sum rounded to nearest even, in every dtype), its layer norm within an ulp of torch's
    `F.layer_norm` in bf16 and fp16 (8 in float32) farther from float64's than torch's at most, at the size of each
    value's larger term, and within twice that of torch's. GPT-2's widths (768, gpt2-xl's 1600) over 3 rows."""
    from conftest import norm_ulps

    from gpt2_port.model import add_norm

    ulps = {torch.float32: 8, torch.float16: 1, torch.bfloat16: 1}[dtype]  # as on the CPU (tests/test_gpu_kernels.py)
    g = torch.Generator(device="cuda").manual_seed(0)
    for width in (768, 1600):
        x = (torch.randn(3, 1, width, device="cuda", generator=g) * 4).to(dtype)  # a residual stream's scale
        d = torch.randn(3, 1, width, device="cuda", generator=g).to(dtype)
        w = (1 + 0.5 * torch.randn(width, device="cuda", generator=g)).to(dtype)
        b = (0.5 * torch.randn(width, device="cuda", generator=g)).to(dtype)
        assert add_norm.in_kernel(x, d, (w, b))
        s, y = add_norm.add_norm(x, d, (w, b), 1e-5, kernel=True)
        assert add_norm.KERNEL.broken is None, add_norm.KERNEL.broken
        assert torch.equal(s, x + d)
        off, ours, theirs = norm_ulps(y, s, w, b, 1e-5)
        assert off <= 2 * ulps and ours <= theirs + ulps, (width, off, ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bf16", "fp16"])
def test_the_norm_linear_kernels_add_as_torch_adds_and_multiply_within_rounding_of_float64(
    tiny_official: Path, dtype: torch.dtype
) -> None:
    """model/norm_linear.py's Triton kernels on the GPU (the fused decode step's matmuls), 124M's and gpt2-xl's
    shapes, 1 and 3 rows: a projection's partial sums (the same bits on a second run) and the next kernel's residual
    sum, torch's add of the projection's output bit for bit (the partials summed in order, the bias added, rounded
    once), in every dtype; the matmul after the sum's layer norm (with c_fc's GELU) within the dtype's epsilon times
    the output's largest value of float64's over torch's own normalised rows (8 in float32, where the CPU's
    interpreter saw 5.1; 1 in 16 bits, where torch's is about 0.5), recorded by a CUDA graph and replayed to the same
    bits; and a bf16 generation through them gives the tokens of the same step with cuBLAS's matmuls
    (steps.LINEAR_KERNEL off) wherever the scores decide them."""
    import torch.nn.functional as F

    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full, steps
    from gpt2_port.model import norm_linear as nl

    g = torch.Generator(device="cuda").manual_seed(0)
    eps = torch.finfo(dtype).eps
    for rows, C in ((1, 768), (3, 1600)):
        x = (torch.randn(rows, 1, C, device="cuda", generator=g) * 4).to(dtype)
        y = torch.randn(rows, 1, 4 * C, device="cuda", generator=g).to(dtype)
        lnw = (1 + 0.5 * torch.randn(C, device="cuda", generator=g)).to(dtype)
        lnb = (0.5 * torch.randn(C, device="cuda", generator=g)).to(dtype)
        proj = (torch.randn(4 * C, C, device="cuda", generator=g) / (4 * C) ** 0.5).to(dtype).t()  # (C, 4C) view
        pb = (0.5 * torch.randn(C, device="cuda", generator=g)).to(dtype)
        fc = (torch.randn(C, 4 * C, device="cuda", generator=g) / C**0.5).to(dtype).t()  # (4C, C) view
        fb = (0.5 * torch.randn(4 * C, device="cuda", generator=g)).to(dtype)
        parts = nl.project(y, lambda t: F.linear(t, proj, pb), (proj, pb), kernel=True)  # noqa: B023
        assert isinstance(parts, nl.Parts) and nl.PROJECT.broken is None, nl.PROJECT.broken
        again = nl.project(y, lambda t: pytest.fail("the fallback ran"), (proj, pb), kernel=True)
        assert torch.equal(again.sums, parts.sums)
        d = (summed_in_order(parts.sums) + pb).to(dtype)
        bound = 8.0 if dtype == torch.float32 else 1.0  # eps x the largest value, as the outputs below
        want = F.linear(y.double(), proj.double(), pb.double())
        assert (parts.total().double() - want).abs().max() <= bound * eps * want.abs().max()

        def mlp_in(h: torch.Tensor) -> torch.Tensor:
            return F.gelu(F.linear(h, fc, fb), approximate="tanh")  # noqa: B023

        s, out = nl.norm_linear((x, parts), (lnw, lnb), 1e-5, (fc, fb), mlp_in, True, True, True)
        assert nl.KERNEL.broken is None, nl.KERNEL.broken
        assert torch.equal(s, x + d)
        h = F.layer_norm(x + d, (C,), lnw, lnb, 1e-5)
        truth = F.gelu(F.linear(h.double(), fc.double(), fb.double()), approximate="tanh")
        far = (out.double() - truth).abs().max().item() / (eps * truth.abs().max().item())
        assert far <= bound, far
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _, replayed = nl.norm_linear((x, parts), (lnw, lnb), 1e-5, (fc, fb), mlp_in, True, True, True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)
    if dtype != torch.bfloat16:
        return
    m = GPT2.from_pretrained(str(tiny_official), dtype=dtype, device="cuda")
    ids = torch.tensor([[464, 2444, 4721, 511, 3835]])
    opts = dict(eos_token_id=None, output_scores=True)
    want = generate_full(m, ids, 40, **opts)
    steps_before = steps.LINEAR_KERNEL
    steps.LINEAR_KERNEL = False
    try:
        got = generate_full(m, ids, 40, **opts)
    finally:
        steps.LINEAR_KERNEL = steps_before
    assert want.extra["step"] == got.extra["step"] == "cuda graph"
    new = [r.sequences[:, 5:].cpu() for r in (want, got)]
    scores = [[s.cpu() for s in r.scores] for r in (want, got)]
    assert min(same_tokens_where_decided(new[0], scores[0], new[1], scores[1], 2e-2)) >= 1


def test_c_fc_with_its_gelu_in_cublaslts_epilogue_is_the_tanh_gelu() -> None:
    """gelu_projected on the GPU in bf16 (generate's fused step: `torch._addmm_activation`, cuBLASLt's GELU-and-bias
    epilogue): GPT-2's tanh GELU of c_fc, not the erf one, and no farther from it in float64 than c_fc
    then torch's tanh-GELU kernel. bf16's rounding (up to 0.016 here) hides the two GELUs' difference (at most 4.7e-4)
    in any one value, so the errors are projected onto it: s = sum(err * d) / sum(d * d), d = erf - tanh, is about 0
    for a tanh GELU rounded once and about 1 for the erf one (simulated on the CPU: -0.006 and 0.999 at these shapes).
    A 124M-shaped c_fc, 64 rows, inputs at ln_2's output's scale."""
    import torch.nn.functional as F

    from gpt2_port.model.decode import gelu_in_epilogue, gelu_projected

    g = torch.Generator(device="cuda").manual_seed(0)
    lin = torch.nn.Linear(768, 3072, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    lin.weight.copy_(torch.randn(3072, 768, device="cuda", generator=g) * 0.05)
    lin.bias.copy_(torch.randn(3072, device="cuda", generator=g) * 0.5)
    h = torch.randn(64, 1, 768, device="cuda", generator=g).to(torch.bfloat16)
    wb = (lin.weight, lin.bias)
    assert gelu_in_epilogue(h, wb) and not gelu_in_epilogue(h.float(), (lin.weight.float(), lin.bias.float()))
    with torch.no_grad():
        pre = F.linear(h.double(), lin.weight.double(), lin.bias.double())
        tanh, d = F.gelu(pre, approximate="tanh"), F.gelu(pre) - F.gelu(pre, approximate="tanh")
        err = gelu_projected(h, lin, wb).double() - tanh
        apart = (F.gelu(lin(h), approximate="tanh").double() - tanh).abs().max().item()
    s = ((err * d).sum() / (d * d).sum()).item()
    assert abs(s) < 0.5, s  # the tanh GELU
    assert err.abs().max().item() <= 1.05 * apart, (err.abs().max().item(), apart)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bf16", "fp16"])
def test_the_greedy_pick_kernel_is_torchs_argmax_and_finite_check(tiny_official: Path, dtype: torch.dtype) -> None:
    """generate/greedy_pick.py's Triton kernel on the GPU (a plain greedy token's choice): torch.argmax's tokens, ties
    to the lower id, over GPT-2's 50,257 logits with a row stride of their own, and the flag 0 for a NaN, +Inf or -Inf
    anywhere; a greedy generation on CUDA chooses through it."""
    from gpt2_port import GPT2
    from gpt2_port.generate import generate_full, greedy_pick

    V = 50257
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(3, V + 47, device="cuda", generator=g) * 3).to(dtype)[:, :V]
    top = logits.max().item() + 1
    logits[0, 5] = logits[0, V - 3] = top
    assert greedy_pick.in_kernel(logits)
    ids, ok = greedy_pick.argmax_finite(logits)
    assert greedy_pick.KERNEL.broken is None and torch.equal(ids, torch.argmax(logits, -1)) and int(ok) == 1
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = logits.clone()
        broken[1, 777] = bad
        assert int(greedy_pick.argmax_finite(broken)[1]) == 0, bad
    m = GPT2.from_pretrained(str(tiny_official), dtype=dtype, device="cuda")
    greedy_pick.KERNEL.checked.clear()
    generate_full(m, torch.tensor([[464, 2444, 4721]]), 8, eos_token_id=None)
    assert greedy_pick.KERNEL.checked and greedy_pick.KERNEL.broken is None


@pytest.mark.parametrize("status_dtype", [torch.long, torch.bool], ids=["int64", "bool"])
def test_the_token_taking_kernel_is_torchs_where_ne_and_cat(tiny_official: Path, status_dtype: torch.dtype) -> None:
    """generate/accept.py's Triton kernel on the GPU: a strided choice into a column of the sequence, finished rows
    padded, the rows that chose EOS ended, the ids and the status side by side: torch's ops' values exactly; given a
    static cache, the next step's inputs fed as StaticKVCache.feed feeds them (at slots 16 and 17 too, where triton
    would have specialised the slot); a generation with EOS on CUDA takes its tokens through it."""
    from gpt2_port import GPT2
    from gpt2_port.generate import accept, generate_full
    from gpt2_port.generate.cache import StaticKVCache

    g = torch.Generator(device="cuda").manual_seed(0)
    choice = torch.randint(0, 9, (37, 2), device="cuda", generator=g)[:, 1]
    choice[0] = 7
    running = torch.rand(37, device="cuda", generator=g) < 0.7
    seq = torch.randint(100, 200, (37, 6), device="cuda", generator=g)
    status = torch.ones((), dtype=status_dtype, device="cuda")
    pad = (7, torch.full((), 7, device="cuda"))
    assert accept.in_kernel(choice, status, running, seq[:, 4])
    want = accept._torch_ops(choice, status, running, pad[1], 7, seq.clone()[:, 4])
    got = accept.take(choice, status, running, pad, 7, seq[:, 4])
    assert accept.KERNEL.broken is None and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    m = GPT2.from_pretrained(str(tiny_official), device="cuda")
    # the next step's inputs fed with them: StaticKVCache.feed's values, at a left-padded batch's positions
    kernel_fed, torch_fed = (StaticKVCache(m.config, 37, 64, torch.bfloat16, "cuda") for _ in range(2))
    prompt_mask = (torch.arange(4, device="cuda") >= torch.arange(37, device="cuda")[:, None] % 4).long()  # (37, 4)
    for cache in (kernel_fed, torch_fed):
        cache.start(prompt_mask, 4)
    for at in (4, 16, 17):
        column = accept.take(choice, status, running, pad, 7, seq[:, 4], (kernel_fed, at))[0]
        torch_fed.feed(column, at)
        for name in ("tok", "slot", "bias", "pos"):
            assert torch.equal(getattr(kernel_fed, name), getattr(torch_fed, name)), (at, name)
    assert accept.KERNEL.broken is None
    accept.KERNEL.checked.clear()
    g = generate_full(m, torch.tensor([[464, 2444, 4721], [3, 4, 5]]), 8, eos_token_id=11)
    assert accept.KERNEL.checked and accept.KERNEL.broken is None and g.extra["step"] == "cuda graph"
