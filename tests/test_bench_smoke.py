"""The benchmark harness end to end on a tiny checkpoint (structure of the JSON and the Markdown; no timing
assertions), and the decode loops it times."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from benchmarks.__main__ import main as bench_main
from benchmarks.decode import first_difference, greedy_hf, greedy_ours, same_prefix
from benchmarks.report import BEGIN, END, update_markdown
from gpt2_port.model import from_pretrained

REPO = Path(__file__).resolve().parents[1]


def test_greedy_loops_agree(tiny_official: Path) -> None:
    """The loops the benchmark times give the same tokens: ours (product path, and without the graph), transformers
    with its dynamic cache and with its static one; same_prefix counts up to the first difference only."""
    from transformers import GPT2LMHeadModel

    model, _ = from_pretrained(tiny_official)
    ref = GPT2LMHeadModel.from_pretrained(tiny_official).eval()
    ref.generation_config.eos_token_id = None
    ids = torch.randint(0, 50257, (1, 5), generator=torch.Generator().manual_seed(1))
    a = greedy_ours(model, ids, 6)
    b = greedy_ours(model, ids, 6, cuda_graph=False)
    c = greedy_hf(ref, ids, 6)
    d = greedy_hf(ref, ids, 6, static=True)
    assert a.shape == (1, 6)
    assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    assert same_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and same_prefix([1, 2], [1, 2]) == 2
    with pytest.raises(ValueError, match="static cache only"):
        greedy_hf(ref, ids, 6, compiled=True)


def test_a_decode_row_with_other_attention_kernels_sets_them_for_its_call_alone(tiny_official: Path) -> None:
    """greedy_ours(attention=...) (the GPU benchmark's rows `ours, SDPA attention`, `ours, cuDNN attention` and `ours,
    math attention`): generate's static step is made with those SDPA kernels in place of its one-kernel attention
    (steps.STATIC_BACKENDS and steps.ATTENTION_KERNEL for the call, then put back); the same tokens here, where the
    CPU's SDPA has one kernel for both; greedy_ours(linear_kernel=False) (`ours, cuBLAS matmuls`) likewise makes a
    step with steps.LINEAR_KERNEL off, and greedy_ours(split_attention=False) (`ours, attention unsplit`) one with
    steps.SPLIT_ATTENTION off."""
    from functools import partial
    from unittest import mock

    from torch.nn.attention import SDPBackend

    from benchmarks import decode
    from gpt2_port.generate import generate_full, steps

    model, _ = from_pretrained(tiny_official)
    ids = torch.randint(0, 50257, (1, 5), generator=torch.Generator().manual_seed(1))
    default = steps.STATIC_BACKENDS
    with mock.patch.object(decode, "generate_full", partial(generate_full, static_cache=True)):
        a = greedy_ours(model, ids, 6)
        b = greedy_ours(model, ids, 6, attention=[SDPBackend.MATH])
        c = greedy_ours(model, ids, 6, linear_kernel=False)  # the row `ours, cuBLAS matmuls`
        d = greedy_ours(model, ids, 6, split_attention=False)  # the row `ours, attention unsplit`
    assert steps.STATIC_BACKENDS is default and steps.ATTENTION_KERNEL is True and steps.LINEAR_KERNEL is True
    assert steps.SPLIT_ATTENTION is True
    assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    kept = model.__dict__["_static_steps"].values()
    made = [(s.backends, s.attention_kernel, s.linear_kernel, s.split_attention) for s in kept]
    assert len(made) == 4 and ([SDPBackend.MATH], False, True, True) in made and (default, True, True, True) in made
    assert (default, True, False, True) in made and (default, True, True, False) in made


def test_the_decode_rows_keep_a_step_each_across_the_rounds(tiny_official: Path, monkeypatch) -> None:  # noqa: ANN001
    """Each of our decode rows keeps a step of its own on the model (on CUDA four: the graph, compiled, uncaptured, op
    for op); the product keeps fewer per model (steps.KEEP_CAPTURED, 4), which would push one out each
    interleaved round to be recorded, and compiled, again: the benchmark's loops raise the limit to their number."""
    from benchmarks.gpu import decode_loops
    from gpt2_port.generate import steps

    monkeypatch.setattr(steps, "KEEP_CAPTURED", 1)
    model, _ = from_pretrained(tiny_official)
    fns = decode_loops(model, None, torch.tensor([[1, 2, 3]]), 4, compile_ours="eager", hf_compile=False)
    assert len(fns) > 1 and steps.KEEP_CAPTURED == len(fns)


def test_where_tokens_part_the_row_says_by_how_much_transformers_chose_its_own(tiny_official: Path) -> None:
    """first_difference reads transformers' own scores at the step where another path's greedy tokens leave its own:
    0 where two tokens tie there (here two identical rows of the tied head: their scores are equal at every step), a
    positive lead otherwise; the table says which."""
    from transformers import GPT2LMHeadModel

    from benchmarks.gpu import _parting

    ref = GPT2LMHeadModel.from_pretrained(tiny_official).eval()
    ref.generation_config.eos_token_id = None
    ids = torch.randint(0, 50257, (1, 5), generator=torch.Generator().manual_seed(1))
    theirs = greedy_hf(ref, ids, 6)[0].tolist()
    k, i = 3, theirs[3]
    j = next(t for t in range(i + 1, 50257) if t not in ids[0].tolist() + theirs)  # a higher id, seen nowhere
    with torch.no_grad():
        ref.transformer.wte.weight[j] = ref.transformer.wte.weight[i]  # j's score is i's: argmax keeps the lower id
    assert greedy_hf(ref, ids, 6)[0].tolist() == theirs
    tie = first_difference(ref, ids, theirs, theirs[:k] + [j, 1, 2])
    assert tie == {"step": k, "reference_margin": 0.0, "reference_top2_gap": 0.0}
    assert _parting(tie) == " (then a tie in transformers' own scores)"
    other = next(t for t in range(50257) if t not in (i, j))
    lead = first_difference(ref, ids, theirs, theirs[:k] + [other])
    assert lead["step"] == k and lead["reference_margin"] > 0 and lead["reference_top2_gap"] == 0
    assert _parting(lead).startswith(" (then transformers' token ahead by ")
    with pytest.raises(ValueError, match="do not differ"):
        first_difference(ref, ids, theirs, theirs)


def test_the_compiled_transformers_row_is_an_error_where_generate_did_not_compile(tiny_official: Path) -> None:
    """transformers' generate compiles its static-cache forward only where its criteria hold (a GPU, by default) and
    otherwise runs it eagerly without a word: the row named "compiled" then fails instead of timing eager code. With
    generate's own switch for other devices (backend eager on the CPU) it compiles, and the row runs."""
    from transformers import CompileConfig, GPT2LMHeadModel

    ref = GPT2LMHeadModel.from_pretrained(tiny_official).eval()
    ref.generation_config.eos_token_id = None
    ids = torch.randint(0, 50257, (1, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="ran its static-cache forward eagerly"):
        greedy_hf(ref, ids, 3, static=True, compiled=True)
    cc = CompileConfig(backend="eager", mode=None)
    cc._compile_all_devices = True  # transformers' own switch for compiling on any device (a class attribute)
    ref.generation_config.compile_config = cc
    assert torch.equal(greedy_hf(ref, ids, 3, static=True, compiled=True), greedy_hf(ref, ids, 3, static=True))


def test_the_graph_row_is_an_error_where_the_step_did_not_run_as_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that failed makes generate run the same step eagerly; the benchmark's row named for the CUDA graph
    must then fail, not time the eager step under the graph's name (a CUDA model's generate stood in for)."""
    from types import SimpleNamespace

    from benchmarks import decode

    ran = {"step": "static (capture failed)"}

    def fake_generate_full(model, ids, n, **kw):  # noqa: ANN001, ANN003, ANN202
        return SimpleNamespace(sequences=torch.zeros(1, ids.shape[1] + n, dtype=torch.long), extra=dict(ran))

    monkeypatch.setattr(decode, "generate_full", fake_generate_full)
    cuda_model = SimpleNamespace(device=torch.device("cuda"))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(RuntimeError, match="ran as 'static \\(capture failed\\)', not as a CUDA graph"):
        greedy_ours(cuda_model, ids, 4)
    assert greedy_ours(cuda_model, ids, 4, cuda_graph=False).shape == (1, 4)  # the row that asks for no graph
    mask = torch.ones_like(ids)
    with pytest.raises(RuntimeError, match="ran as 'static \\(capture failed\\)', not as a CUDA graph"):
        decode.sampled_ours(cuda_model, ids, mask, 4)  # the sampled batches' row
    ran["step"] = "cuda graph"
    assert greedy_ours(cuda_model, ids, 4).shape == (1, 4)
    assert decode.sampled_ours(cuda_model, ids, mask, 4).shape == (1, 4)


@pytest.mark.parametrize("name", ["results.json", "results-xl-rounds.json", "results-loads.json"])
def test_every_recorded_sweep_renders(name: str) -> None:
    """The sweeps BENCHMARKS.md quotes render with today's report (results from before a column was added name
    float32 transformers, the only reference they had): the table can be made again from its JSON."""
    from benchmarks.report import render

    res = json.loads((REPO / "benchmarks" / name).read_text())
    text = render(res)
    assert text.startswith("## Speed and memory") and res["command"] in text
    if any(k.endswith("_tok_s") and "int8" in k for k in res["sizes"]["gpt2-xl"].get("summary", {})):
        assert "int8-fast" in text and "(float32) |" in text
    if name == "results.json":  # BENCHMARKS.md's section is that rendering, as it would be made again now
        md = (REPO / "BENCHMARKS.md").read_text()
        assert md[md.index(BEGIN) + len(BEGIN) : md.index(END)].strip() == text.strip()


def test_update_markdown_keeps_other_sections(tmp_path: Path) -> None:
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\n## parity\nkeep me\n")
    update_markdown(md, "## bench v1\n")
    update_markdown(md, "## bench v2\n")
    text = md.read_text()
    assert "keep me" in text and "v2" in text and "v1" not in text
    assert text.count(BEGIN) == 1 and text.count(END) == 1


def test_bench_end_to_end(tiny_official: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, md = tmp_path / "r.json", tmp_path / "B.md"
    rc = bench_main(
        [
            "--sizes",
            str(tiny_official),
            "--new-tokens",
            "3",
            "--prompt-len",
            "4",
            "--prefill",
            "1x8,2x8",
            "--lowp",
            "int8,bfloat16",
            "--no-cold",
            "--load-rounds",
            "2",
            "--no-parity",
            "--max-seconds",
            "0.1",
            "--membw-mb",
            "16",
            "--out",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert {"command", "machine", "membw", "settings", "sizes"} <= set(res)
    assert res["machine"]["torch"] == torch.__version__ and res["machine"]["transformers"]
    assert res["membw"]["read_GBps"] > 0
    (size,) = res["sizes"].values()
    assert size["file_bytes"] == (tiny_official / "model.safetensors").stat().st_size
    assert set(size["runs"]) == {"ours_float32", "hf_float32", "ours_int8", "ours_bfloat16", "hf_bfloat16"}
    for impl in ("ours", "hf"):
        r = size["runs"][f"{impl}_float32"]
        assert r["impl"] == impl and r["peak_rss_MB"] >= r["rss_before_load_MB"] > 0 and r["load_s"] > 0
        assert set(r["prefill"]) == {"1x8", "2x8"}
        assert len(r["decode"]["tokens"]) == 3 and r["decode"]["tok_s"] > 0
        assert r["interleaved"]  # both timed in one process, runs alternating
        assert len(size["loads"][f"{impl}_warm"]["load_runs"]) == 2  # fresh-process loads, alternating
    s = size["summary"]
    assert s["decode_tok_s"][2] == pytest.approx(s["decode_tok_s"][0] / s["decode_tok_s"][1])
    assert s["decode_tokens_match"] == 3  # both greedy in float32 on the same weights
    assert "parity" not in size
    # bf16 beside transformers in bf16: decode and the prefills (int8, ours alone, decodes only)
    assert "prefill" not in size["runs"]["ours_int8"]
    for sh in ("1x8", "2x8"):
        po, ph, pr = s[f"ours_bfloat16_prefill_{sh}_s"]
        assert (po, ph) == tuple(size["runs"][f"{i}_bfloat16"]["prefill"][sh]["best_s"] for i in ("ours", "hf"))
        assert pr == pytest.approx(po / ph)
        assert s[f"ours_bfloat16_prefill_{sh}_vs_float32"] == pytest.approx(
            po / size["runs"]["ours_float32"]["prefill"][sh]["best_s"]
        )
    assert s["ours_bfloat16_tokens_against"] == "bfloat16"
    text = md.read_text()
    assert BEGIN in text and "| size |" in text and "int8" in text and "decode tok/s" in text
    assert "### Low-precision prefill" in text and "| bfloat16 |" in text.split("### Low-precision prefill")[1]
    assert "### Load" in text and "warm" in text
    assert text.strip() in capsys.readouterr().out.strip() or "## Speed and memory" in text


def test_quant_parity_report(tiny_official: Path) -> None:
    from benchmarks.quant_parity import quant_parity

    res = quant_parity(str(tiny_official), ["int8", "float32"], prompts=["The cat sat", "Hello"])
    assert res["prompts"] == ["The cat sat", "Hello"]
    f32, q = res["options"]["float32"], res["options"]["int8"]
    assert set(q["points"]) == {"embed", "block.0", "block.1", "ln_f", "logits"}
    assert q["n_positions"] == f32["n_positions"] > 2
    # float32 sdpa against the float32 eager reference is near-exact; int8 is measurably further but close
    assert f32["worst_block_norm_rel"] < 1e-5 and f32["top1_agreement"] == 1.0
    assert 1e-4 < q["worst_block_norm_rel"] < 0.2 and 0 <= q["top1_agreement"] <= 1


def test_the_gpu_benchmarks_run_end_to_end_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """benchmarks/gpu.py on the CPU with a tiny model (torch.compile with the `eager` backend: dynamo's graphs, run by
    eager kernels; tests/test_compile.py checks what they trace): every side runs and lands in the
    JSON, the Markdown and the plot (no timing asserted)."""
    from benchmarks import gpu

    w = str(tmp_path / "w")
    argv = ["train", "--device", "cpu", "--sizes", "tiny", "--batch", "2", "--block", "16", "--warmup", "1"]
    argv += ["--steps", "1", "--compile-backend", "eager", "--weights-dir", w, "--out", str(tmp_path / "t.json")]
    assert gpu.main([*argv, "--markdown", str(tmp_path / "t.md"), "--plot", str(tmp_path / "t.png")]) == 0
    t = json.loads((tmp_path / "t.json").read_text())
    rows = t["sizes"]["tiny"]["rows"]
    # `train`'s loop first, with --compile and without (not overlapped on the CPU), then the goals' sides (a run cut
    # short at the device's time limit keeps them), then the loop with --no-overlap and the rest
    key = ["ours fast compiled", "transformers compiled", "transformers eager", "ours fast eager"]
    loops = ["gpt2-port train loop", "gpt2-port train loop, no --compile", "gpt2-port train loop, --no-overlap"]
    assert list(rows)[:7] == [*loops[:2], *key, loops[2]] and len(rows) == 13
    assert [rows[n].get("overlap", rows[n]) for n in loops] == [False] * 3  # a failed row shows its error
    assert [rows[n]["compile"] for n in loops] == [True, False, True]
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    # as train's first lines: the attention kernel; the measured memory check runs on CUDA alone
    assert rows[loops[0]]["attention"] and rows[loops[0]]["memory_estimate_GB"] is None
    text = (tmp_path / "t.md").read_text()
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG" and "ours fast eager" in text
    assert f"gpt2-port train loop: attention {rows[loops[0]]['attention']}" in text
    argv = ["decode", "--device", "cpu", "--sizes", "tiny", "--new-tokens", "4", "--batches", "2", "--rounds", "1"]
    argv += ["--compile-backend", "eager"]  # dynamo's graphs, eager kernels: no inductor compile here
    assert gpu.main([*argv, "--weights-dir", w, "--out", str(tmp_path / "d.json")]) == 0
    d = json.loads((tmp_path / "d.json").read_text())
    b1 = d["sizes"]["tiny"]["batch1"]
    assert list(b1) == ["bfloat16", "float32", "float16"]  # bf16, the goals' figure, first
    vs = [b1[n]["rows"]["ours"]["tok_s"] / b1["float32"]["rows"]["ours"]["tok_s"] for n in ("bfloat16", "float16")]
    assert f"ours in bfloat16 {vs[0]:.2f}x, float16 {vs[1]:.2f}x of ours in float32 (batch 1)" in gpu.render(d)
    rows = d["sizes"]["tiny"]["batch1"]["float32"]["rows"]
    assert rows["ours"]["same_tokens"] == 4 and d["bandwidth_GBps"] > 0
    assert rows["ours, compiled"]["same_tokens"] == 4  # `generate --compile`'s step (here dynamo's eager backend)
    assert set(d["sizes"]["tiny"]["batched"]["2"]) == {"ours", "transformers"}
    assert "### tiny: sampled, padded batches (top-k 50), float32" in gpu.render(d)  # the dtype they ran in
    assert d["command"].startswith("python -m benchmarks.gpu decode --device cpu")


def test_the_profile_benchmark_says_where_a_steps_and_a_tokens_time_goes(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """benchmarks.gpu_profile at a toy size on the CPU (its "kernels" the top-level ops there): per side, the units
    profiled, the busy time within the wall, the kernels per unit, the time by kind adding up to the whole, and the
    top kernels in order; compiled sides (dynamo's graphs run eagerly) beside the eager ones; bad flags one line."""
    from benchmarks import gpu_profile

    out, md = tmp_path / "p.json", tmp_path / "p.md"
    argv = ["--device", "cpu", "--sizes", "tiny", "--batch", "2", "--block", "16", "--steps", "2", "--warmup", "1"]
    argv += ["--new-tokens", "4", "--compile-backend", "eager", "--top", "3", "--weights-dir", str(tmp_path / "w")]
    assert gpu_profile.main([*argv, "--out", str(out), "--markdown", str(md)]) == 0
    capsys.readouterr()
    r = json.loads(out.read_text())["sizes"]["tiny"]
    assert list(r["train"]) == ["ours fast compiled", "transformers compiled"]
    assert list(r["decode"]) == ["ours", "ours, compiled", "transformers, static cache", "ours (float32)"]
    for side in [*r["train"].values(), *r["decode"].values()]:
        assert "error" not in side, side
        assert side["units"] in (2, 4) and side["kernels_per_unit"] > 1
        assert 0 < side["busy_us_per_unit"] <= side["wall_us_per_unit"] and 0 < side["busy_share"] <= 1
        assert sum(k["share"] for k in side["kinds"].values()) == pytest.approx(1.0)
        assert sum(k["count_per_unit"] for k in side["kinds"].values()) == pytest.approx(side["kernels_per_unit"])
        us = [t["us_per_unit"] for t in side["top"]]
        assert len(us) == 3 and us == sorted(us, reverse=True)
    assert r["train"]["ours fast compiled"]["units"] == 2 and r["decode"]["ours"]["units"] == 4
    assert r["train"]["ours fast compiled"]["kinds"]["matmul"]["count_per_unit"] > 0
    text = md.read_text()
    assert "### tiny decode, ours: per new token (batch 1, greedy, bfloat16, 4 tokens after 16)" in text
    assert "### tiny decode, ours (float32): per new token (batch 1, greedy, float32, 4 tokens after 16)" in text
    assert "### tiny train, transformers compiled: per training step (2 x 16 tokens, bf16)" in text
    bad_flags = [
        (["--kinds", "train,eval"], "--kinds train,eval"),
        (["--steps", "0"], "--steps must be"),
        (["--decode-dtypes", "bfloat16,bfloat16"], "--decode-dtypes bfloat16,bfloat16: expected distinct"),
    ]
    for bad, what in bad_flags:
        assert gpu_profile.main([*argv, *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and what in err and err.startswith("python -m benchmarks.gpu_profile: error:")


def test_the_profiles_kernel_kinds_and_busy_time() -> None:
    from benchmarks.gpu_profile import _busy_us, kind_of

    assert _busy_us([(0, 2), (1, 3), (5, 6), (5.5, 5.8)]) == 4  # overlapping intervals counted once
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4>": "matmul",
        "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTT": "matmul",
        "triton_tem_fused_mm_1": "matmul",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",  # CUTLASS's attention, not its GEMM
        "triton_poi_fused_addmm_gelu_0": "triton",  # an epilogue named after the addmm it follows
        "triton_red_fused_native_layer_norm_2": "triton",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>": "reduction",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps<float>>>": "reduction",
        "Memcpy DtoH (Device -> Pinned)": "copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::tanh_kernel_cuda>": "elementwise",
        "mkldnn::_linear_pointwise": "matmul",
        "aten::add": "elementwise",
    }
    assert {n: kind_of(n) for n in names} == names


def test_the_profiles_device_time_is_its_kernels_not_the_annotations_over_them() -> None:
    """A CUDA profile's device events hold the ranges of `record_function` annotations (the optimizer's step) beside
    the kernels: only the kernels, copies and fills are counted."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.gpu_profile import device_events

    def event(name: str, device: DeviceType, annotation: bool = False) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation)

    events = [
        event("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_bias_NNT", DeviceType.CUDA),
        event("Optimizer.step#AdamW.step", DeviceType.CUDA, annotation=True),
        event("Memcpy DtoH (Device -> Pinned)", DeviceType.CUDA),
        event("aten::addmm", DeviceType.CPU),
        event("Optimizer.step#AdamW.step", DeviceType.CPU, annotation=True),
    ]
    assert [e.name for e in device_events(events)] == [events[0].name, events[2].name]


def test_a_cut_short_gpu_run_renders_from_its_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The JSON is rewritten after every side (train), and after every loop's first run and every round (decode): a
    run killed at the device's time limit leaves the rows it timed, and `--render-from` makes its Markdown and plot
    here; `--key-only` runs `train`'s loop and the goals' sides, then the eager rest and one compiled side (whether
    the fused head-and-loss pays under the compiler): no loop with --no-overlap, no other compiled rest."""
    from benchmarks import gpu

    w, out = str(tmp_path / "w"), tmp_path / "t.json"
    argv = ["train", "--device", "cpu", "--sizes", "tiny", "--batch", "2", "--block", "16", "--warmup", "0"]
    assert gpu.main([*argv, "--steps", "1", "--no-compile", "--key-only", "--weights-dir", w, "--out", str(out)]) == 0
    t = json.loads(out.read_text())
    eager_rest = ["ours reference eager", "ours fast eager, head not padded", "ours fast eager, no fused loss"]
    key = ["gpt2-port train loop", "transformers eager", "ours fast eager"]
    assert list(t["sizes"]["tiny"]["rows"]) == key + eager_rest
    a = gpu.build_parser().parse_args(["train", "--key-only"])  # compiled sides too: the rest eager but one
    key, rest = gpu.train_sides(tmp_path, torch.device("cpu"), a)  # factories: nothing is built here
    assert list(key) == ["ours fast compiled", "transformers compiled", "transformers eager", "ours fast eager"]
    assert list(rest) == [*eager_rest, "ours fast compiled, no fused loss"]
    a = gpu.build_parser().parse_args(["train"])
    assert list(gpu.train_sides(tmp_path, torch.device("cpu"), a)[1])[3:] == [
        "ours fast compiled, no fused loss",
        "ours reference compiled",
        "ours fast compiled, head not padded",
    ]
    saved: list[dict] = []
    real_write = gpu.write_output
    seen = lambda p, text, what: saved.append(json.loads(text)) if what == "--out" else real_write(p, text, what)  # noqa: E731
    argv = ["decode", "--device", "cpu", "--sizes", "tiny", "--new-tokens", "3", "--batches", "1", "--rounds", "2"]
    argv += ["--compile-backend", "eager"]  # dynamo's graphs, eager kernels: no inductor compile here
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu, "write_output", seen)
        assert gpu.main([*argv, "--weights-dir", w, "--out", str(tmp_path / "d.json")]) == 0
    # bf16: after each of its 5 loops' warm-up and first timed run (the loops not reached yet absent), after round 2;
    # then float32 the same
    first = saved[0]["sizes"]["tiny"]["batch1"]
    assert list(first) == ["bfloat16"] and list(first["bfloat16"]["rows"]) == ["ours"]
    assert first["bfloat16"]["rows"]["ours"]["tok_s"] > 0
    assert len(saved[4]["sizes"]["tiny"]["batch1"]["bfloat16"]["rows"]) == 5
    assert len(saved[5]["sizes"]["tiny"]["batch1"]["bfloat16"]["rows"]["ours"]["times"]) == 2
    # the goals' dtypes, then the sampled batches, then float16: a run cut short keeps the goals' figures
    batched_first = next(x["sizes"]["tiny"] for x in saved if x["sizes"]["tiny"]["batched"])
    assert list(batched_first["batch1"]) == ["bfloat16", "float32"]
    assert list(saved[-1]["sizes"]["tiny"]["batch1"]) == ["bfloat16", "float32", "float16"]
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps(saved[0]))  # what a kill in bf16's second loop's warm-up (a long compile) leaves
    md = tmp_path / "cut.md"
    assert (
        gpu.main(["decode", "--render-from", str(cut), "--markdown", str(md), "--plot", str(tmp_path / "c.png")]) == 0
    )
    assert re.search(r"\| ours \| [\d,.]+ \| - \| \d+% \| - \|", md.read_text()), md.read_text()  # no reference yet
    assert "`python -m benchmarks.gpu decode --device cpu" in md.read_text()
    capsys.readouterr()
    assert gpu.main(["train", "--render-from", str(cut)]) == 2  # a decode run's results
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--render-from {cut}: expected the JSON of a `benchmarks.gpu train` run" in err
    for bad in ("int8", "float32,float32", ""):
        assert gpu.main(["decode", "--device", "cpu", "--dtypes", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--dtypes {bad}: expected distinct names of bfloat16, float16, float32" in err


def test_a_failing_side_leaves_the_others_and_fp16_trains_with_a_grad_scaler(tmp_path: Path, monkeypatch) -> None:
    """A side that raises (here transformers' loading; in decode its static cache) gets its error in its row, the
    other sides still run, and the JSON holds them all; --dtype fp16 steps through a GradScaler, as `train` does."""
    from benchmarks import gpu

    scaled = []

    class Scaler(torch.amp.GradScaler):
        def scale(self, outputs):  # noqa: ANN001, ANN202
            scaled.append(float(self.get_scale()))
            return super().scale(outputs)

    def broken(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("no transformers here\nsecond line")

    monkeypatch.setattr(torch.amp, "GradScaler", Scaler)
    monkeypatch.setattr(gpu, "_hf", broken)
    w, out = str(tmp_path / "w"), tmp_path / "t.json"
    argv = ["train", "--device", "cpu", "--sizes", "tiny", "--batch", "2", "--block", "16", "--warmup", "1"]
    argv += ["--steps", "1", "--no-compile", "--dtype", "fp16", "--weights-dir", w, "--out", str(out)]
    assert gpu.main([*argv, "--markdown", str(tmp_path / "t.md")]) == 0
    rows = json.loads(out.read_text())["sizes"]["tiny"]["rows"]
    assert rows["transformers eager"] == {"error": "RuntimeError: no transformers here"}
    assert rows["ours fast eager"]["tokens_per_s"] > 0 and rows["ours reference eager"]["tokens_per_s"] > 0
    assert "| transformers eager | RuntimeError: no transformers here |" in (tmp_path / "t.md").read_text()
    assert scaled and scaled[0] == 2.0**16  # every timed side scaled its loss
    assert gpu.failure(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried")) == {"error": "out of memory"}
    assert gpu.failure(RuntimeError("backend='inductor' raised:\nCUDA out of memory")) == {"error": "out of memory"}

    monkeypatch.undo()
    real = gpu.greedy_hf

    def no_static(*a, static=False, **k):  # noqa: ANN002, ANN003, ANN202
        if static:
            raise ValueError("static cache refused")
        return real(*a, **k)

    monkeypatch.setattr(gpu, "greedy_hf", no_static)
    argv = ["decode", "--device", "cpu", "--sizes", "tiny", "--new-tokens", "3", "--batches", "", "--rounds", "1"]
    argv += ["--compile-backend", "eager"]  # dynamo's graphs, eager kernels: no inductor compile here
    assert gpu.main([*argv, "--weights-dir", w, "--out", str(out), "--markdown", str(tmp_path / "d.md")]) == 0
    rows = json.loads(out.read_text())["sizes"]["tiny"]["batch1"]["float32"]["rows"]
    assert rows["transformers, static cache"] == {"error": "ValueError: static cache refused"}
    assert "| transformers, static cache | ValueError: static cache refused |" in (tmp_path / "d.md").read_text()
    assert rows["ours"]["same_tokens"] == 3 and rows["transformers"]["same_tokens"] == 3


def gpu_check_commands() -> list[tuple[str, list[str]]]:
    """scripts/gpu_check.sh's gpt2-port and benchmarks.gpu command lines (continuations joined), "$RESULTS/x" read
    as out/x, the checkpoint helper's "$1" as gpt2 and eval_check's "$dev" and "$dt" as cuda and float32."""
    text = (REPO / "scripts" / "gpu_check.sh").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        line = re.sub(r'"\$RESULTS/([^"]*)"', r"out/\1", line.strip())
        line = line.replace("$1", "gpt2").replace('"${TRAIN_EXTRA[@]}"', "").replace('"${DECODE_EXTRA[@]}"', "")
        line = line.replace("$dev", "cuda").replace("$dt", "float32")
        for marker, tool in (
            ('"${G[@]}" ', "gpt2-port"),
            ("-m benchmarks.gpu ", "benchmarks.gpu"),
            ("-m benchmarks.head_padding ", "benchmarks.head_padding"),
            ("-m benchmarks.gpu_profile ", "benchmarks.gpu_profile"),
        ):
            if marker in line:
                out.append((tool, shlex.split(line.split(marker, 1)[1])))
    return out


def test_the_gpu_check_scripts_commands_parse() -> None:
    """Every command scripts/gpu_check.sh runs on a GPU machine parses with the real parsers here, so a renamed flag
    is caught before a lent GPU's minutes are spent on it."""
    from benchmarks import gpu, gpu_profile, head_padding
    from gpt2_port.cli.main import build_parser

    cmds = gpu_check_commands()
    parsers = {
        "gpt2-port": build_parser,
        "benchmarks.gpu": gpu.build_parser,
        "benchmarks.head_padding": head_padding.build_parser,
        "benchmarks.gpu_profile": gpu_profile.build_parser,
    }
    assert sum(c[0] == "benchmarks.gpu_profile" for c in cmds) == 2  # on the GPU, and its smoke run
    subcommands = {c[1][0] for c in cmds if c[0] in ("gpt2-port", "benchmarks.gpu")}
    assert subcommands == {"demo-checkpoint", "parity", "train", "decode", "eval"}
    assert sum(c[1][0] == "parity" for c in cmds) >= 5
    assert [c[1][c[1].index("--device") + 1] for c in cmds if c[1][0] == "eval"] == ["cuda"]  # eval_check's one line
    assert sum(c[0] == "benchmarks.head_padding" for c in cmds) == 2  # on the GPU, and its smoke run
    for tool, argv in cmds:
        parser = parsers[tool]()
        assert "$" not in " ".join(argv), argv
        parser.parse_args(argv)
    # the plan's DECODE_ARGS for decode-xl (in the script's help), after the phase's own --batches
    xl = next(argv for tool, argv in cmds if tool == "benchmarks.gpu" and "gpt2-xl" in argv and argv[0] == "decode")
    a = gpu.build_parser().parse_args([*xl, "--no-hf-compile", "--batches="])
    assert a.no_hf_compile and a.batches == "" and a.sizes == "gpt2-xl"


def test_the_gpu_check_script_refuses_an_unknown_phase() -> None:
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "tests", "benchmark"], capture_output=True)
    assert r.returncode == 2 and r.stdout == b""
    assert r.stderr.decode().strip().splitlines() == [
        "gpu_check: unknown phase 'benchmark' (expected tests, suite, parity, train, train-xl, decode, decode-xl, "
        "decode-long, profile or smoke)"
    ]


def test_the_gpu_check_script_runs_from_the_checkout_when_the_install_fails(tmp_path: Path) -> None:
    """An old pip or setuptools on the GPU machine must not cost the call: the script says so and runs every command
    with the checkout (and checks/ as gpt2_port_checks) on PYTHONPATH. A stand-in python fails `pip` and records
    the PYTHONPATH each other command sees."""
    fake, seen, out = tmp_path / "python3", tmp_path / "seen", tmp_path / "out"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$2" = pip ]; then echo "ERROR: setuptools too old" >&2; exit 1; fi\n'
        f'echo "$PYTHONPATH" >> {seen}\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "RESULTS": str(out)}
    env.pop("PYTHONPATH", None)
    env.pop("OUT", None)
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "decode"], capture_output=True, env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert "pip install -e . failed, running from the checkout" in r.stderr.decode()
    paths = set(seen.read_text().split())
    assert paths == {f"{REPO}:{out}/pythonpath"}
    assert (out / "pythonpath" / "gpt2_port_checks").resolve() == REPO / "checks"


def test_the_gpu_check_script_passes_train_and_decode_args_and_says_when_shared_is_missing(tmp_path: Path) -> None:
    """TRAIN_ARGS and DECODE_ARGS reach the benchmark commands (word-split, after the script's own flags), so a call
    can be sized to the device time left; the train phase times the benchmark before the head-padding one; a missing
    ../shared is named before the tests fail on it; the cuda tests run with the CLI's tracebacks on and pytest's
    faulthandler timeout (a hang names itself). A stand-in python records each command line (and GPT2_PORT_DEBUG)."""
    fake, seen, out = tmp_path / "python3", tmp_path / "seen", tmp_path / "out"
    fake.write_text(
        f'#!/usr/bin/env bash\necho "$*${{GPT2_PORT_DEBUG:+ [GPT2_PORT_DEBUG=$GPT2_PORT_DEBUG]}}" >> {seen}\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "RESULTS": str(out), "INSTALL": "0", "SHARED_FROM": ""}
    env.pop("GPT2_PORT_DEBUG", None)
    env |= {"TRAIN_ARGS": "--key-only --steps 10", "DECODE_ARGS": "--batches 8,32", "TESTS_ARGS": "-x --maxfail 3"}
    env.pop("OUT", None)
    script = REPO / "scripts" / "gpu_check.sh"
    r = subprocess.run(["bash", str(script), "train", "decode"], capture_output=True, env=env)
    assert r.returncode == 0, r.stderr.decode()
    runs = [line for line in seen.read_text().splitlines() if line.startswith("-m benchmarks.")]
    assert [line.split()[1] for line in runs] == ["benchmarks.gpu", "benchmarks.head_padding", "benchmarks.gpu"]
    assert runs[0].startswith("-m benchmarks.gpu train") and runs[0].endswith("train.png --key-only --steps 10")
    assert runs[2].startswith("-m benchmarks.gpu decode") and runs[2].endswith("decode.png --batches 8,32")
    assert "--key-only" not in runs[1]
    # the tests phase in a copy of the checkout with no ../shared beside it
    repo = tmp_path / "box" / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(script, repo / "scripts" / "gpu_check.sh")
    r = subprocess.run(["bash", str(repo / "scripts" / "gpu_check.sh"), "tests"], capture_output=True, env=env)
    assert "../shared/gpt2-tokenizer is missing" in r.stderr.decode()
    assert (
        seen.read_text()
        .splitlines()[-1]
        .endswith(
            "-m pytest -q -m cuda -rs --durations=15 -o faulthandler_timeout=150 -x --maxfail 3 [GPT2_PORT_DEBUG=1]"
        )
    )


def test_the_gpu_check_script_bundles_its_results_into_the_devices_out(tmp_path: Path) -> None:
    """On the device machine OUT (its folder of files sent back) returns only a few files: the script writes its
    RESULTS folder there as one gpu-results.tgz after env.log and after every step, so a call cut off at its time limit
    still returns the steps done. A stand-in python writes each command's log line; `decode` is one step here."""
    fake, results, out = tmp_path / "python3", tmp_path / "res", tmp_path / "device-out"
    fake.write_text('#!/usr/bin/env bash\necho "ran $*"\n')
    fake.chmod(0o755)
    out.mkdir()
    env = {**os.environ, "PYTHON": str(fake), "RESULTS": str(results), "OUT": str(out), "INSTALL": "0"}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "decode"], capture_output=True, env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.tgz"]
    with tarfile.open(out / "gpu-results.tgz") as tar:
        names = set(tar.getnames())
        assert {"res/env.log", "res/bench-decode.log"} <= names, names
        log = tar.extractfile("res/bench-decode.log").read().decode()  # type: ignore[union-attr]
    assert log.startswith("ran -m benchmarks.gpu decode --sizes gpt2")


def test_a_step_past_the_calls_deadline_is_stopped_and_what_it_wrote_is_bundled(tmp_path: Path) -> None:
    """A lent GPU's call ends at 600 s, and whatever has not reached OUT by then is lost: a step still running at the
    script's deadline (BUDGET_S) is stopped, the bundle made after it holds its log, and the steps left are named as
    not run. A stand-in python prints, then hangs."""
    fake, results, out = tmp_path / "python3", tmp_path / "res", tmp_path / "device-out"
    fake.write_text('#!/usr/bin/env bash\n[ "$1" = - ] && exit 0\necho "started $*"\nexec sleep 60\n')
    fake.chmod(0o755)
    out.mkdir()
    env = {**os.environ, "PYTHON": str(fake), "RESULTS": str(results), "OUT": str(out), "INSTALL": "0", "BUDGET_S": "4"}
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "tests", "suite"], capture_output=True, env=env)
    err = r.stderr.decode()
    assert time.monotonic() - t0 < 30 and r.returncode == 1, err
    assert "== tests-cuda: stopped at the deadline" in err and "== tests-all: not run (the deadline" in err
    with tarfile.open(out / "gpu-results.tgz") as tar:
        log = tar.extractfile("res/tests-cuda.log").read().decode()  # type: ignore[union-attr]
    assert log.startswith("started -m pytest -q -m cuda")


def test_the_head_padding_benchmark_times_each_multiple_with_the_same_loss(tmp_path: Path) -> None:
    from benchmarks import head_padding

    out = tmp_path / "h.json"
    argv = ["--device", "cpu", "--rows", "8", "--width", "16", "--vocab", "97", "--rounds", "2", "--json", str(out)]
    assert head_padding.main([*argv, "--chunk-rows", "3,8"]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "head_padding" and res["machine"]["device"] == "cpu"
    rows, chunks = res["multiples"], res["chunks"]
    assert [rows[m]["vocab"] for m in ("1", "64", "128")] == [97, 128, 128]
    assert {x["chunk_rows"] for x in rows.values()} == {256} and [chunks[c]["chunk_rows"] for c in ("3", "8")] == [3, 8]
    assert all(len(x["runs_s"]) == 2 and x["median_s"] > 0 for x in [*rows.values(), *chunks.values()])
    assert rows["1"]["speed_vs_unpadded"] == 1.0 and all(x["speed_vs_default_chunks"] > 0 for x in chunks.values())
    for x in [*rows.values(), *chunks.values()]:  # the pad takes no probability, chunks change rounding only
        assert abs(x["loss"] - rows["1"]["loss"]) <= 1e-6 * rows["1"]["loss"]
    assert res["compiled"] is None and res["settings"]["compile"] is False
    with pytest.raises(SystemExit):
        head_padding.build_parser().parse_args(["--chunk-rows", "0,8"])


def test_the_head_padding_benchmark_times_the_compiled_loss_beside_eager(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """--compile adds the head padded to 64 under torch.compile (inductor on the GPU; aot_eager here, which needs no
    C++ compiler): the same loss, and its speed against the eager loss's."""
    from benchmarks import head_padding

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f, **kw: compile_(f, backend="aot_eager", **kw))
    torch._dynamo.reset()
    out = tmp_path / "h.json"
    argv = ["--device", "cpu", "--rows", "8", "--width", "16", "--vocab", "97", "--rounds", "2", "--json", str(out)]
    assert head_padding.main([*argv, "--compile"]) == 0
    torch._dynamo.reset()
    res = json.loads(out.read_text())
    x, eager = res["compiled"], res["multiples"]["64"]
    assert res["settings"]["compile"] is True and x["vocab"] == 128 and len(x["runs_s"]) == 2
    assert x["speed_vs_eager"] == eager["median_s"] / x["median_s"]
    assert abs(x["loss"] - eager["loss"]) <= 1e-6 * eager["loss"]


def test_the_lowp_gemm_benchmark_times_both_paths_and_names_lowps_choice(tmp_path: Path) -> None:
    from benchmarks import lowp_gemm
    from gpt2_port.model import lowp

    out = tmp_path / "l.json"
    assert lowp_gemm.main(["--rows", "1,200", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "lowp_gemm" and res["machine"]["features"] == sorted(lowp.cpu_features())
    want = [(d, n) for d in ("bfloat16", "float16") for n in (1, 200)]
    assert [(r["dtype"], r["rows"]) for r in res["results"]] == want
    for r in res["results"]:
        assert r["float32"] > 0 and r["kernel"] > 0 and r["float32_copies"] > 0 and r["head_kernel"] > 0
        dt = getattr(torch, r["dtype"])
        threshold, copies = lowp.upcast_min_rows(dt), "float32 copies"
        packed = lowp.packs(dt) and r["packed"] is not None  # None: the reorder refused (no packed kernel here)
        assert (r["packed"] is None) is (r["head_packed"] is None)
        assert r["lowp"] == (
            copies if threshold is not None and r["rows"] >= threshold else "packed" if packed else "kernel"
        )
        assert r["lowp_head"] == (copies if r["lowp"] == copies else r["lowp"])
    for bad in (["--rows", "0,8"], ["--rows", "8,x"], ["--dtypes", "float32"]):
        with pytest.raises(SystemExit):
            lowp_gemm.build_parser().parse_args(bad)


def test_a_decode_loop_failing_in_a_timed_round_is_left_out_not_fatal() -> None:
    """One path failing after its warm-up (an OOM, a recompile error) becomes that row's error; the other paths keep
    their rounds and the benchmark goes on (it used to end the process, losing the size's unsaved rows)."""
    from benchmarks import gpu

    calls = {"flaky": 0}

    def flaky() -> torch.Tensor:
        calls["flaky"] += 1
        if calls["flaky"] == 3:  # the warm-up and the first round pass
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return torch.tensor([[7, 8]])

    out = gpu._interleaved({"steady": lambda: torch.tensor([[1, 2]]), "flaky": flaky}, torch.device("cpu"), 4)
    assert len(out["steady"]["times"]) == 4 and out["steady"]["tokens"] == [1, 2]
    assert out["flaky"] == {"error": "out of memory"} and calls["flaky"] == 3


def test_a_path_whose_tokens_leave_transformers_gets_where_and_by_how_much(tmp_path: Path, monkeypatch) -> None:
    """The decode benchmark adds first_difference to a row whose tokens part from transformers' (here ours with its
    last token changed): the step, transformers' lead there, in the JSON and in the table; rows that agree get none."""
    from benchmarks import gpu

    real = gpu.greedy_ours

    def parts_at_the_last(*args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        out = real(*args, **kwargs).clone()
        out[:, -1] = (out[:, -1] + 1) % 50257
        return out

    monkeypatch.setattr(gpu, "greedy_ours", parts_at_the_last)
    argv = ["decode", "--device", "cpu", "--sizes", "tiny", "--new-tokens", "4", "--batches", "", "--rounds", "1"]
    argv += ["--compile-backend", "eager"]  # dynamo's graphs, eager kernels: no inductor compile here
    argv += ["--dtypes", "float32", "--weights-dir", str(tmp_path / "w"), "--out", str(tmp_path / "d.json")]
    assert gpu.main(argv) == 0
    d = json.loads((tmp_path / "d.json").read_text())
    rows = d["sizes"]["tiny"]["batch1"]["float32"]["rows"]
    assert rows["ours"]["same_tokens"] == 3 and rows["ours"]["first_difference"]["step"] == 3
    assert rows["ours"]["first_difference"]["reference_margin"] > 0
    assert "first_difference" not in rows["transformers, static cache"]
    assert "| 3/4 (then transformers' token ahead by " in gpu.render(d)


def test_each_decode_loop_is_timed_once_right_after_its_warm_up() -> None:
    """A run cut short in a later loop's warm-up (a long compile at a call's deadline) keeps every earlier loop's first
    timed run: each loop's round 0 follows its own warm-up, saved at once; the rounds after alternate their order."""
    import copy

    from benchmarks import gpu

    calls: list[str] = []
    seen: list[dict] = []

    def loop(name: str):  # noqa: ANN202
        return lambda: calls.append(name) or torch.tensor([[1]])

    save = lambda o: seen.append(copy.deepcopy(o))  # noqa: E731
    out = gpu._interleaved({"a": loop("a"), "b": loop("b")}, torch.device("cpu"), 3, save)
    assert calls == ["a", "a", "b", "b", "b", "a", "a", "b"]  # warm-up + round 0 each; round 1 reversed; round 2
    assert list(seen[0]) == ["a"] and len(seen[0]["a"]["times"]) == 1  # saved before b's warm-up begins
    assert len(out["a"]["times"]) == len(out["b"]["times"]) == 3


def test_the_dtype_decode_script_times_each_dtype_with_and_without_the_fast_head(tiny_official: Path) -> None:
    """scripts/decode_dtypes.py on a tiny checkpoint: a row per dtype and head, the fast runs' tokens equal to the
    exact ones; a dtype it does not know is one line on stderr and exit 2."""
    script = [sys.executable, str(REPO / "scripts" / "decode_dtypes.py"), str(tiny_official)]
    run = subprocess.run(
        [*script, "--dtypes", "float32,float16", "--rounds", "2", "--new-tokens", "3", "--prompt-len", "4"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith(("float32 ", "float16 "))]
    assert [r[0] for r in rows] == ["float32", "float32", "float16", "float16"]
    assert rows[0][-1] == "True" and rows[2][-1] == "True"  # fast and exact: the same tokens
    assert rows[1][1:3] == ["exact", "logits"] and rows[0][1] in ("ScreenedHead", "TransposedHead")
    bad = subprocess.run([*script, "--dtypes", "int4"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "--dtypes" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_the_screen_candidates_script_counts_per_dtype(tiny_official: Path) -> None:
    """scripts/screen_candidates.py on a tiny checkpoint: a line per dtype with the candidate counts, where the screen
    runs; elsewhere one line saying why, exit 2 (as for a dtype it does not know)."""
    from gpt2_port.generate.greedy_head import ScreenedHead

    script = [sys.executable, str(REPO / "scripts" / "screen_candidates.py"), str(tiny_official)]
    run = subprocess.run([*script, "--prompts", "1", "--prompt-len", "4"], capture_output=True, text=True, cwd=REPO)
    if ScreenedHead.available():
        assert run.returncode == 0, run.stderr
        lines = run.stdout.strip().splitlines()
        assert [line.split(":")[0] for line in lines] == ["float32", "float16"]
        assert all(
            re.search(r"4 states, candidates median \S+, 90th percentile -?\d+, max -?\d+; declined \d", x)
            for x in lines
        )
    else:
        assert run.returncode == 2 and "packed bf16" in run.stderr
    bad = subprocess.run([*script, "--dtypes", "bfloat16"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_the_training_step_benchmark_runs_bf16_with_and_without_the_float32_products(
    tiny_official: Path, tmp_path: Path
) -> None:
    """benchmarks/train_step.py --dtype bf16 on a tiny checkpoint: every side (ours with each kernel set, ours on
    autocast's own bf16 kernels, ours in float32, transformers) timed, with its first loss; the bf16 sides' losses
    close to the float32 side's."""
    out = tmp_path / "t.json"
    argv = ["--ckpt", str(tiny_official), "--batch", "1", "--seq", "16", "--rounds", "1", "--dtype", "bf16"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.train_step", *argv, "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    sides = {"ours", "ours-fast", "ours-fast-kernels", "hf", "ours-fast-float32"}
    assert d["dtype"] == "bf16" and set(d["median_s"]) == sides and set(d["ratios_over_hf"]) == sides
    first = d["losses_first_step"]
    assert all(abs(first[k] - first["ours-fast-float32"]) < 0.05 * first["ours-fast-float32"] for k in sides)
