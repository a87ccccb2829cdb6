"""Where a training step's and a decode token's device time goes: torch.profiler over a few of them, after warm-up
(and compilation), for ours beside transformers in one process, the device named. Per side: wall time and the
device's busy time per unit (a training step, a new token), the share of the wall the device was busy (low: the host
holds it back), kernels per unit, the time by kind of kernel (matmul, attention, triton's fused kernels, elementwise,
reduction, copy) and the kernels that took the most. What the speed goals' remaining gaps are made of, measured
instead of guessed.

    python -m benchmarks.gpu_profile [--kinds train,decode] [--sizes gpt2] [--dtype bf16] [--batch 16] [--block 1024]
                                     [--steps 3] [--new-tokens 64] [--decode-dtypes bfloat16,float32] [--top 20]
                                     [--no-compile] [--out JSON] [--markdown MD]

train sides: ours fast compiled (`train --compile`'s model) and transformers compiled (with --no-compile: both eager),
one optimizer step each as benchmarks.gpu times it, float32 matmuls on TF32 as `train` runs them. decode sides: greedy
batch 1 through `generate` (the CUDA graph, with the forward's ops, attending with cuDNN's kernel and with the math one;
compiled first too, `generate --compile`) and transformers' `generate` with its static cache (compiled on a GPU), in
bfloat16; then ours in float32, uncompiled (--decode-dtypes), TF32 off as `generate` runs. On the CPU (--device cpu
--sizes tiny, a smoke run) the "kernels" are the top-level aten ops.

Not a test: the numbers depend on the machine and its load (say so when quoting them). The profiler adds its own
host time, so the wall figures here are above benchmarks.gpu's; the device's kernel times are what to read.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from benchmarks.gpu import (
    TINY,
    _hf,
    checkpoint,
    decode_loops,
    failure,
    free,
    machine,
    optimizer_step,
    sync,
    train_sides,
)
from gpt2_port.config import PRESETS
from gpt2_port.devices import parse_device
from gpt2_port.errors import GPT2PortError, UsageError
from gpt2_port.files import check_writable, write_output

# A kernel's kind by its name (the first that matches; "other" else): cuBLAS/cuBLASLt/CUTLASS GEMMs, the attention
# kernels SDPA dispatches to, inductor's triton kernels, torch's own elementwise and reduction kernels, copies.
KINDS = (
    ("triton", r"^triton_(poi|red|per)_|cpp_fused"),  # named after the ops they fused, addmm's bias add among them
    ("attention", r"flash|fmha|attention|cudnn|sdpa"),  # before matmul: CUTLASS's attention is fmha_cutlass...
    ("matmul", r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitkreduce|triton_tem|addmm|\bmm\b|bmm|linear"),
    ("reduction", r"reduce|softmax|norm|argmax|\ball\b|sum"),
    ("copy", r"memcpy|memset|copy|fill|\bcat\b|catarray|^_accept$"),  # _accept: the tokens into the sequence
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|::"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def _busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals, in their unit: the device's busy time, overlaps once."""
    busy, end = 0.0, -float("inf")
    for s, e in sorted(spans):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def device_events(events: Iterable) -> list:
    """The device's own work among a profile's events: its kernels, copies and fills, not the ranges that
    `record_function` annotations project onto its timeline (torch's `Optimizer.step#AdamW.step`, 1.36 ms a training
    step on an H100), which span kernels counted already and are no kernel."""
    return [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def profile(fn: Callable[[], object], dev: torch.device, runs: int, units: int, top: int) -> dict:
    """`fn` run `runs` times under torch.profiler; `units` the steps or tokens they made in all. On CUDA the device's
    kernels (and its copies and fills); elsewhere the top-level ops (aten::, mkldnn::), by their host time."""
    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(dev)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(runs):
            fn()
        sync(dev)
    wall_us = (time.perf_counter() - t0) * 1e6
    if cuda:
        events = device_events(prof.events())
    else:
        events = [e for e in prof.events() if e.cpu_parent is None and "::" in e.name]  # aten::, mkldnn::
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by_name[e.name].append(e.time_range.elapsed_us())
    total = sum(sum(v) for v in by_name.values()) or 1.0
    kinds: dict[str, dict] = defaultdict(lambda: {"us_per_unit": 0.0, "count_per_unit": 0.0})
    for name, ts in by_name.items():
        k = kinds[kind_of(name)]
        k["us_per_unit"] += sum(ts) / units
        k["count_per_unit"] += len(ts) / units
    for k in kinds.values():
        k["share"] = k["us_per_unit"] * units / total
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    busy = _busy_us(spans)
    return {
        "units": units,
        "wall_us_per_unit": wall_us / units,
        "busy_us_per_unit": busy / units,
        "busy_share": busy / wall_us,
        "kernels_per_unit": len(events) / units,
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["us_per_unit"])),
        "top": [
            {
                "name": name[:160],
                "kind": kind_of(name),
                "count_per_unit": len(ts) / units,
                "us_per_unit": sum(ts) / units,
                "mean_us": sum(ts) / len(ts),
                "share": sum(ts) / total,
            }
            for name, ts in ranked
        ],
    }


def _side(name: str, run: Callable[[], dict], save: Callable[[], None], into: dict, dev: torch.device) -> None:
    free(dev)
    print(f"{name} ...", file=sys.stderr)
    try:
        into[name] = run()
    except Exception as e:  # noqa: BLE001 - one side failing (OOM, a compile error) leaves the others
        into[name] = failure(e)
        print(f"{name}: {into[name]['error']}", file=sys.stderr)
    save()


def train_profiles(a: argparse.Namespace, dev: torch.device, size: str, into: dict, save: Callable[[], None]) -> None:
    from gpt2_port.train.setup import set_tf32

    set_tf32(dev, True)  # as `train` and benchmarks.gpu run on CUDA
    ck = checkpoint(size, Path(a.weights_dir))
    cfg = TINY if size == "tiny" else PRESETS[size]
    T = min(a.block, cfg.n_positions)
    w = torch.randint(0, cfg.vocab_size, (a.batch, T + 1), generator=torch.Generator().manual_seed(0)).to(dev)
    x, y = w[:, :-1], w[:, 1:]
    opts = argparse.Namespace(compile_backend=a.compile_backend, no_compile=a.no_compile, key_only=True)
    key, _ = train_sides(ck, dev, opts)
    names = (
        ["ours fast eager", "transformers eager"] if a.no_compile else ["ours fast compiled", "transformers compiled"]
    )

    def run(make: Callable[[], tuple]) -> dict:
        model, loss_fn = make()
        step = optimizer_step(model, loss_fn, dev, a.dtype)
        for _ in range(a.warmup):  # the compile, the allocator's pools, cuBLAS's plans
            step(x, y)
        out = profile(lambda: step(x, y), dev, a.steps, a.steps, a.top)
        return out | {"unit": f"training step ({a.batch} x {T} tokens, {a.dtype})"}

    for name in names:
        _side(name, partial(run, key[name]), save, into, dev)


def decode_profiles(a: argparse.Namespace, dev: torch.device, size: str, into: dict, save: Callable[[], None]) -> None:
    """Each of --decode-dtypes in turn: the first with every side, the later ones ours alone, uncompiled (what a dtype
    changes in the same step's kernels; no compile repeated)."""
    from gpt2_port.model import from_pretrained
    from gpt2_port.train.setup import set_tf32

    set_tf32(dev, False)  # as `generate` runs, after the train sides turned it on: float32 decodes in float32
    ck = checkpoint(size, Path(a.weights_dir))
    ids = torch.randint(0, 50257, (1, a.prompt_len), generator=torch.Generator().manual_seed(0)).to(dev)
    N = a.new_tokens
    for i, dname in enumerate(a.decode_dtypes.split(",")):
        dt = getattr(torch, dname)
        free(dev)
        ours, _ = from_pretrained(ck, dtype=dt, device=dev)
        hf = None
        if i == 0:
            hf = _hf(ck, dev).to(dt).eval()
            hf.generation_config.eos_token_id = None
        compile_ours = None if a.no_compile or i > 0 else a.compile_backend
        loops = decode_loops(ours, hf, ids, N, compile_ours, hf_compile=not a.no_compile)
        # transformers' static cache, compiled where it compiles (a GPU), else eager; not the other loops timed there
        static = next((n for n in reversed(loops) if n.startswith("transformers, static cache")), None)
        keep = ["ours", "ours, compiled", "ours, op for op", "ours, cuBLAS matmuls", "ours, SDPA attention"]
        keep += ["ours, cuDNN attention", "ours, math attention", static]
        tag = "" if i == 0 else f" ({dname})"
        fns = {name + (tag if name.startswith("ours") else ""): fn for name, fn in loops.items() if name in keep}

        def run(fn: Callable[[], object], dname: str = dname) -> dict:
            for _ in range(2):  # the capture or compile, then a warm run
                fn()
            out = profile(fn, dev, 1, N, a.top)
            return out | {"unit": f"new token (batch 1, greedy, {dname}, {N} tokens after {a.prompt_len})"}

        for name, fn in fns.items():
            _side(name, partial(run, fn), save, into, dev)
        ours = hf = fns = None


def render(res: dict) -> str:
    m = res["machine"]
    out = [
        f"## Profiles: {m['device_name']} ({m['device']})",
        "",
        f"- Command: `{res.get('command', '')}`",
        f"- Versions: torch {m['torch']}, transformers {m['transformers']}, CUDA {m.get('cuda')}, Python {m['python']}",
        "",
    ]
    for size, kinds in res["sizes"].items():
        for kind, sides in kinds.items():
            for name, r in sides.items():
                if "error" in r:
                    out += [f"### {size} {kind}, {name}: {r['error']}", ""]
                    continue
                out += [
                    f"### {size} {kind}, {name}: per {r['unit']}",
                    "",
                    f"wall {r['wall_us_per_unit']:,.0f} us, device busy {r['busy_us_per_unit']:,.0f} us "
                    f"({r['busy_share']:.0%} of the wall), {r['kernels_per_unit']:,.1f} kernels",
                    "",
                    "| kind | us | kernels | share |",
                    "|---|---|---|---|",
                    *[
                        f"| {k} | {v['us_per_unit']:,.1f} | {v['count_per_unit']:,.1f} | {v['share']:.1%} |"
                        for k, v in r["kinds"].items()
                    ],
                    "",
                    "| kernel | kind | per unit | us per unit | mean us | share |",
                    "|---|---|---|---|---|---|",
                    *[
                        f"| `{t['name'][:80]}` | {t['kind']} | {t['count_per_unit']:,.2f} | {t['us_per_unit']:,.1f} "
                        f"| {t['mean_us']:,.1f} | {t['share']:.1%} |"
                        for t in r["top"]
                    ],
                    "",
                ]
    return "\n".join(out) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="train,decode", help="comma-separated: train, decode")
    p.add_argument("--sizes", default="gpt2", help="comma-separated: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--weights-dir", default="weights/bench")
    p.add_argument("--dtype", default="bf16", choices=["float32", "bf16", "fp16"], help="train: autocast dtype")
    p.add_argument("--batch", type=int, default=16, help="train: micro-batch")
    p.add_argument("--block", type=int, default=1024, help="train: tokens per row")
    p.add_argument("--warmup", type=int, default=3, help="train: steps before profiling (the compile is here)")
    p.add_argument("--steps", type=int, default=3, help="train: steps profiled")
    p.add_argument(
        "--decode-dtypes",
        default="bfloat16,float32",
        help="decode: comma-separated bfloat16, float32, float16; every side in the first, ours uncompiled in the rest",
    )
    p.add_argument("--new-tokens", type=int, default=64, help="decode: greedy tokens profiled (batch 1)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--top", type=int, default=20, help="the kernels listed per side")
    p.add_argument("--no-compile", action="store_true", help="the eager sides only")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--out", default=None, help="JSON results (rewritten after each side)")
    p.add_argument("--markdown", default=None, help="the tables as Markdown (- for stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    command = "python -m benchmarks.gpu_profile " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        kinds = a.kinds.split(",")
        if not kinds or not set(kinds) <= {"train", "decode"}:
            raise UsageError(f"--kinds {a.kinds}: expected train, decode or both, comma-separated")
        for flag in ("batch", "block", "steps", "new_tokens", "prompt_len", "top"):
            if getattr(a, flag) < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(a, flag)}")
        if a.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {a.warmup}")
        names = a.decode_dtypes.split(",")
        if not set(names) <= {"bfloat16", "float32", "float16"} or len(set(names)) != len(names):
            expected = "expected distinct names of bfloat16, float16, float32"
            raise UsageError(f"--decode-dtypes {a.decode_dtypes}: {expected}")
        for path, what in ((a.out, "--out"), (a.markdown, "--markdown")):
            if path:
                check_writable(path, what)
        dev = parse_device(a.device)
        res: dict = {"kind": "profile", "command": command, "machine": machine(dev), "settings": vars(a), "sizes": {}}

        def save() -> None:
            if a.out:
                write_output(a.out, json.dumps(res, indent=1, default=str) + "\n", "--out")

        for size in a.sizes.split(","):
            res["sizes"][size] = {}
            for kind in kinds:
                into = res["sizes"][size][kind] = {}
                (train_profiles if kind == "train" else decode_profiles)(a, dev, size, into, save)
        md = render(res)
        print(md)
        if a.markdown:
            write_output(a.markdown, md, "--markdown")
    except GPT2PortError as e:
        print(f"python -m benchmarks.gpu_profile: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
