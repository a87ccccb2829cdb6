"""GPU benchmarks, each in one process beside transformers, the device named in every result.

    python -m benchmarks.gpu train  [--sizes gpt2,gpt2-xl] [--batch 16] [--block 1024] [--steps 20] ...
    python -m benchmarks.gpu decode [--sizes gpt2,gpt2-xl] [--new-tokens 128] [--batches 8,32,64] ...
    (both: --out results.json --markdown BENCHMARKS.md --plot out.png; --device cpu --sizes tiny for a smoke run)

train: one optimizer step = forward and backward under bf16 autocast (--dtype), the gradient clip, fused AdamW, on
random token windows of --batch x --block, for gpt2_port with each kernel set, eager and under torch.compile, beside
transformers' GPT2LMHeadModel (sdpa attention) eager and compiled; then `gpt2-port train`'s own loop (the Trainer,
compiled, with its data pipeline and its one device wait per step). Reported per side: tokens/s (the median of the
timed steps, after warm-up and compilation), MFU (gpt2_port.train.throughput: 6N + 12*L*C*T FLOPs per token against
the device's dense peak for the dtype) and peak device memory. Also timed: the features the anchors use, on and off:
the fused head-and-loss (the fast kernels with and without it), the fused head over a vocabulary padded to a multiple
of 64 (50304 rows, nanoGPT's; `train`'s default on CUDA) against GPT-2's 50257, and the bare head matmul either way.

decode: greedy decoding at batch 1 (ours through `generate`: the fixed-shape step replayed as a CUDA graph, and the same
step run eagerly; on a GPU also with the forward's ops and with other attention kernels in the step; transformers'
`generate` with its dynamic and its static cache, eager, and on a GPU the static cache compiled as generate compiles it:
torch.compile, "reduce-overhead"), in bfloat16, float32 and float16 (--dtypes; the larger sizes bfloat16 alone unless
--xl-all-dtypes; float16 after the sampled batches, so that a run cut short keeps the goals' figures), runs interleaved;
tokens/s, the tokens equal to transformers' in the same dtype before the first difference, the bandwidth cap (the GPU's
measured read bandwidth / bytes of weights read per token), and ours in each low precision against ours in float32. Then
sampled generation (top-k 50, seeded) of padded batches of prompts, ours against transformers: tokens/s of all rows
(ours an error where its step was not replayed as the CUDA graph).
A side that fails (out of memory, a compile error) gets its error in its row and the others still run; with --out the
JSON is rewritten after each side, so a run cut short keeps what it measured. --dtype fp16 trains with a GradScaler.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from benchmarks.decode import first_difference, greedy_hf, greedy_ours, same_prefix, sampled_ours
from gpt2_port.config import PRESETS, GPT2Config
from gpt2_port.devices import VARYING_SHAPE_BACKENDS, out_of_memory, parse_device
from gpt2_port.errors import GPT2PortError, UsageError
from gpt2_port.files import check_writable, write_output
from gpt2_port.generate import steps as generate_steps
from gpt2_port.train.schedule import FUSED_ADAMW_DEVICES

REPO = Path(__file__).resolve().parents[1]
TINY = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128)  # --sizes tiny: a smoke run anywhere


# -- the machine and the checkpoints ---------------------------------------------------------------------------------
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def machine(dev: torch.device) -> dict:
    import transformers

    info = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(total_memory_GB=p.total_memory / 1e9, capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
    return info


def bandwidth_GBps(dev: torch.device, mib: int = 1024, sums: int = 10) -> float:
    """Read bandwidth of the memory the weights are in: the best of 5 rounds over a `mib` MiB float32 tensor. On CUDA a
    round is `sums` sums timed between two events (one sum over 1 GiB takes ~0.35 ms on an H100, where a host timer's
    launch and synchronize would add several per cent); on the CPU one sum by the host clock."""
    a = torch.ones(mib * (1 << 20) // 4, device=dev)
    best = math.inf
    for _ in range(5):
        sync(dev)
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(sums):
                a.sum()
            end.record()
            end.synchronize()
            per_sum = start.elapsed_time(end) / 1e3 / sums
        else:  # one sum a round: ~35 ms over 1 GiB, the host clock's overhead negligible
            t0 = time.perf_counter()
            a.sum()
            per_sum = time.perf_counter() - t0
        best = min(best, per_sum)
    return a.numel() * 4 / best / 1e9


def checkpoint(size: str, weights_dir: Path) -> Path:
    """A random-weight checkpoint in the official layout, written once and reused."""
    from gpt2_port.io.demo import write_demo_checkpoint

    d = weights_dir / f"{size}-random"
    if (d / "model.safetensors").is_file():
        return d
    if size == "tiny":
        return write_demo_checkpoint(d, config=TINY, seed=0)
    if size not in PRESETS:
        raise UsageError(f"--sizes {size}: expected tiny or one of {', '.join(PRESETS)}")
    print(f"writing a random {size} checkpoint to {d} ...", file=sys.stderr)
    return write_demo_checkpoint(d, size=size, seed=0)


def free(dev: torch.device) -> None:
    """Between sides: what the last one compiled (dynamo's cache holds its graphs and, through them, its model; and
    a later side must not meet the recompile limit the earlier ones filled) and, on a GPU, whose peak memory each
    side reports, its memory go (a collection of the cycles first: 0.3 s a call in a process that has traced
    transformers, the CPU smoke runs' largest cost)."""
    torch._dynamo.reset()
    if dev.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_GB(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None


def failure(e: BaseException) -> dict:
    """A side that could not run, as its row says it: "out of memory" (also when torch.compile wrapped the OOM in
    its own exception), else the exception's type and first line. The other sides still run."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if out_of_memory(e) or "out of memory" in str(e).lower():
        return {"error": "out of memory"}
    return {"error": f"{type(e).__name__}: {text}"[:200]}


# -- train ----------------------------------------------------------------------------------------------------------
def _amp(dev: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(dev.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


def _ours(ck: Path, dev: torch.device, kernels: str, fused_loss: bool = True, pad_vocab: int | None = None):  # noqa: ANN202
    from gpt2_port.model import from_pretrained
    from gpt2_port.train import TrainArgs, prepare_model

    m, _ = from_pretrained(ck, device=dev)
    prepare_model(m, TrainArgs(dropout=0.0, kernels=kernels, pad_vocab=pad_vocab), dev)
    if not fused_loss:
        m._fused_loss = lambda: False  # the fast kernels without their fused head-and-loss
    return m


def _hf(ck: Path, dev: torch.device):  # noqa: ANN202
    import transformers

    transformers.logging.set_verbosity_error()
    m = transformers.GPT2LMHeadModel.from_pretrained(ck, attn_implementation="sdpa").to(dev)
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    return m.train()


def optimizer_step(
    model, loss_fn, dev: torch.device, dtype: str
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:  # noqa: ANN001
    """One optimizer step as `train` runs it, on (x, y): the forward under autocast (`dtype`), backward (scaled under
    fp16), the gradient clip, fused AdamW (decay on matrices), the gradients dropped; returns the detached loss, on the
    device (no wait)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-4, fused=dev.type in FUSED_ADAMW_DEVICES)  # as `train` runs it
    scaler = torch.amp.GradScaler(dev.type) if dtype == "fp16" else None  # as `train` runs fp16
    params = list(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with _amp(dev, dtype):
            loss = loss_fn(x, y)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def time_steps(model, loss_fn, batches, dev: torch.device, dtype: str, warmup: int, steps: int) -> dict:  # noqa: ANN001
    """Median step time of `steps` optimizer steps after `warmup` (compilation happens there)."""
    step = optimizer_step(model, loss_fn, dev, dtype)
    times, losses = [], []
    t_warm = time.perf_counter()
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        sync(dev)
        t0 = time.perf_counter()
        losses.append(step(x, y))
        sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        elif i == warmup - 1:
            t_warm = time.perf_counter() - t_warm
    return {
        "step_s": statistics.median(times),
        "step_runs_s": times,
        "warmup_s": t_warm,
        "final_loss": float(losses[-1]),
        "peak_GB": peak_GB(dev),
    }


Sides = dict[str, Callable[[], tuple]]


def train_sides(ck: Path, dev: torch.device, a: argparse.Namespace) -> tuple[Sides, Sides]:
    """The key sides and the rest: name -> () -> (model, loss_fn), each made when its turn comes (one model on the
    device at a time)."""

    def ours(kernels: str, compile_: bool, fused: bool = True, pad_vocab: int | None = None) -> Callable[[], tuple]:
        def make() -> tuple:
            m = _ours(ck, dev, kernels, fused, pad_vocab)
            f = torch.compile(m, fullgraph=True, backend=a.compile_backend) if compile_ else m
            return m, lambda x, y: f(x, targets=y, num_items_in_batch=y.numel()).loss

        return make

    def hf(compile_: bool) -> Callable[[], tuple]:
        def make() -> tuple:
            m = _hf(ck, dev)
            f = torch.compile(m, backend=a.compile_backend) if compile_ else m
            return m, lambda x, y: f(input_ids=x, labels=x, use_cache=False).loss

        return make

    # "ours fast": `train`'s defaults for the device (on CUDA the fused head padded to a multiple of 64); beside it
    # the same kernels with the head's own 50257 rows, and without the fused head-and-loss. The sides the goals are
    # stated on come first (a run cut short at a device's time limit keeps them): ours and transformers, compiled and
    # eager; `run_train` times `train`'s own loop before them, the rest after.
    key = {}
    if not a.no_compile:
        key |= {"ours fast compiled": ours("fast", True), "transformers compiled": hf(True)}
    key |= {"transformers eager": hf(False), "ours fast eager": ours("fast", False)}
    rest = {
        "ours reference eager": ours("reference", False),
        "ours fast eager, head not padded": ours("fast", False, pad_vocab=1),
        "ours fast eager, no fused loss": ours("fast", False, fused=False),
    }
    if not a.no_compile:  # whether, compiled, the fused head-and-loss still pays (inductor fuses the plain loss)
        rest["ours fast compiled, no fused loss"] = ours("fast", True, fused=False)
    if not a.no_compile and not a.key_only:  # --key-only: the rest eager but that one (no compile: seconds)
        rest |= {
            "ours reference compiled": ours("reference", True),
            "ours fast compiled, head not padded": ours("fast", True, pad_vocab=1),
        }
    return key, rest


def trainer_loop(
    ck: Path,
    dev: torch.device,
    a: argparse.Namespace,
    batch: int,
    tmp: Path,
    overlap: bool | None = None,
    compiled: bool = True,
) -> dict:
    """`gpt2-port train`'s loop itself (gpt2_port.train.Trainer) on random uint16 tokens, its own timing: with
    `--compile` unless `compiled` is False or the benchmark runs --no-compile; `overlap` as `--overlap` (None:
    train's default, on CUDA). As `train` starts it: the attention kernel SDPA picks (its first lines) and, on CUDA,
    the measured memory check (a dry step, which also compiles) before the run, so the estimate stands beside the
    run's peak."""
    import numpy as np

    from gpt2_port.model import from_pretrained
    from gpt2_port.train import TrainArgs, Trainer, prepare_model
    from gpt2_port.train.data import TokenFile

    data = tmp / "train.bin"
    np.random.default_rng(0).integers(0, 50257, 4_000_000, dtype=np.uint16).tofile(data)
    args = TrainArgs(
        data=str(tmp), steps=a.warmup + a.steps, batch_size=batch, block_size=a.block, dtype=a.dtype,
        kernels="auto", dropout=0.0, eval_every=0, compile=compiled and not a.no_compile, schedule="constant",
        overlap=overlap,
    )  # fmt: skip
    m, _ = from_pretrained(ck, device=dev)
    prepare_model(m, args, dev)
    import os

    os.environ.setdefault("GPT2_PORT_COMPILE_BACKEND", a.compile_backend)
    t = Trainer(m, args, TokenFile(data, m.config.vocab_size), None, tmp / "out", device=dev)
    attention = t.describe()["attention"]
    mem = t.check_cuda_memory() if dev.type == "cuda" else None
    res = t.run()
    out = {"tokens_per_s": res.tokens_per_s, "mfu": res.mfu, "peak_GB": peak_GB(dev), "kernels": args.resolved_kernels}
    estimate = None if mem is None else mem["estimate_bytes"] / 1e9
    return out | {"overlap": t.overlap, "compile": args.compile, "attention": attention, "memory_estimate_GB": estimate}


def head_gemm(dev: torch.device, dtype: str, rows: int, C: int, iters: int = 20) -> dict:
    """The head's forward and backward matmuls (rows x C) @ (C x V) for V = 50257 and 50304 (padded to 64)."""
    out = {}
    for V in (50257, 50304):
        w = torch.randn(V, C, device=dev, requires_grad=True)
        h = torch.randn(rows, C, device=dev, requires_grad=True)
        times = []
        for i in range(iters + 3):
            sync(dev)
            t0 = time.perf_counter()
            with _amp(dev, dtype):
                y = h @ w.t()
            y.float().sum().backward()
            sync(dev)
            if i >= 3:
                times.append(time.perf_counter() - t0)
            w.grad = h.grad = None  # each iteration makes its gradients, none accumulates
        out[V] = statistics.median(times)
        del w, h
    return {"vocab_50257_s": out[50257], "vocab_50304_s": out[50304], "padded_speedup": out[50257] / out[50304]}


def _train_side(
    size: str,
    name: str,
    make: Callable[[], tuple],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    dev: torch.device,
    a: argparse.Namespace,
    tokens: int,
    per_token: float,
    peak: float | None,
) -> dict:
    """One side's timed steps (`tokens` a step): tokens/s and MFU against `peak`, or {"error"} (OOM, a compile
    error) leaving the other sides."""
    free(dev)
    print(f"[{size}] {name} ...", file=sys.stderr)
    model = loss_fn = None
    try:
        model, loss_fn = make()
        r = time_steps(model, loss_fn, batches, dev, a.dtype, a.warmup, a.steps)
    except Exception as e:  # noqa: BLE001 - one side failing (OOM, a compile error) leaves the others
        r = failure(e)
        print(f"[{size}] {name}: {r['error']}", file=sys.stderr)
    model = loss_fn = None
    if "step_s" in r:
        r["tokens_per_s"] = tokens / r["step_s"]
        r["mfu"] = None if peak is None else r["tokens_per_s"] * per_token / peak
    return r


def _loop_side(
    size: str,
    name: str,
    overlap: bool | None,
    ck: Path,
    dev: torch.device,
    a: argparse.Namespace,
    batch: int,
    compiled: bool = True,
) -> dict:
    """`train`'s own loop as one side: its row, or {"error"} leaving the other sides."""
    import tempfile

    free(dev)
    print(f"[{size}] {name} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return trainer_loop(ck, dev, a, batch, Path(tmp), overlap, compiled)
        except Exception as e:  # noqa: BLE001 - one side failing (OOM, a compile error) leaves the others
            return failure(e)


def run_train(a: argparse.Namespace, dev: torch.device, save: Callable[[dict], None]) -> dict:
    from gpt2_port.train.setup import set_tf32
    from gpt2_port.train.throughput import flops_per_token, peak_flops

    set_tf32(dev, True)  # as `train` runs on CUDA (its loop sets it too): every side under the same setting
    results: dict = {"kind": "train", "machine": machine(dev), "settings": _settings(a), "sizes": {}}
    for size in a.sizes.split(","):
        ck = checkpoint(size, Path(a.weights_dir))
        cfg = TINY if size == "tiny" else PRESETS[size]
        batch = a.batch if size in ("gpt2", "tiny") else a.xl_batch
        T = min(a.block, cfg.n_positions)
        g = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(4):
            w = torch.randint(0, cfg.vocab_size, (batch, T + 1), generator=g).to(dev)
            batches.append((w[:, :-1], w[:, 1:]))
        per_token = flops_per_token(cfg, T)
        peak, peak_source = peak_flops(dev, a.dtype, tf32=True)
        rows: dict = {}
        results["sizes"][size] = {
            "batch": batch, "block": T, "flops_per_token": per_token, "peak": peak_source, "rows": rows,
            "head_gemm": None,
        }  # fmt: skip
        side = partial(
            _train_side, size, batches=batches, dev=dev, a=a, tokens=batch * T, per_token=per_token, peak=peak
        )
        key, rest = train_sides(ck, dev, a)
        loop = partial(_loop_side, size, ck=ck, dev=dev, a=a, batch=batch)
        # train's loop first, with --compile (the figure the goals are stated on) and without it, then the goals'
        # sides, then (but with --key-only) the loop without overlapped steps, what reading each step before queueing
        # the next costs, then the rest (eager alone with --key-only) and the head matmul; each row written as it
        # lands: a run cut short keeps what it measured
        rows["gpt2-port train loop"] = loop("gpt2-port train loop", None)
        save(results)
        if not a.no_compile:
            rows["gpt2-port train loop, no --compile"] = loop(
                "gpt2-port train loop, no --compile", None, compiled=False
            )
            save(results)
        for name, make in key.items():
            rows[name] = side(name, make)
            save(results)
        free(dev)
        if not a.key_only:
            rows["gpt2-port train loop, --no-overlap"] = loop("gpt2-port train loop, --no-overlap", False)
            save(results)
        for name, make in rest.items():
            rows[name] = side(name, make)
            save(results)
        free(dev)
        try:
            hg = head_gemm(dev, a.dtype, batch * T, cfg.n_embd) if size != "tiny" else None
        except Exception as e:  # noqa: BLE001
            hg = failure(e)
        results["sizes"][size]["head_gemm"] = hg
        save(results)
    return results


# -- decode ---------------------------------------------------------------------------------------------------------
def _interleaved(
    fns: dict[str, Callable[[], torch.Tensor]],
    dev: torch.device,
    rounds: int,
    progress: Callable[[dict[str, dict]], None] | None = None,
) -> dict[str, dict]:
    """name -> {"times", "tokens"}: each loop run `rounds` times after one warm-up run: its first timed run right after
    its warm-up (so a run cut short, a long compile in a later loop's warm-up say, keeps every loop timed so far), the
    rest interleaved (alternating order); a loop that fails its warm-up or a timed run gets {"error"} and is left out
    of the rounds after. `progress` sees the results so far after each loop's first run and after each round."""
    out: dict[str, dict] = {}

    def timed(n: str) -> None:
        try:  # a timed run failing (OOM, a recompile error) leaves that loop out, not the whole benchmark
            sync(dev)
            t0 = time.perf_counter()
            toks = fns[n]()
            sync(dev)
        except Exception as e:  # noqa: BLE001
            out[n] = failure(e)
            print(f"{n}: {out[n]['error']}", file=sys.stderr)
            return
        out[n]["times"].append(time.perf_counter() - t0)
        out[n]["tokens"] = toks[0].tolist()

    for n, f in fns.items():  # warm-up (kernels, the graph's capture, compilation, the allocator), then round 0
        try:
            f()
            out[n] = {"times": [], "tokens": None}
        except Exception as e:  # noqa: BLE001 - one path failing (OOM, a compile error) leaves the others
            out[n] = failure(e)
            print(f"{n}: {out[n]['error']}", file=sys.stderr)
        if "error" not in out[n] and rounds > 0:
            timed(n)
        if progress is not None:
            progress(out)
    names = list(fns)
    for r in range(1, rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            if "error" not in out[n]:
                timed(n)
        if progress is not None:
            progress(out)
    return out


DECODE_DTYPES = {"bfloat16", "float32", "float16"}


def run_decode(a: argparse.Namespace, dev: torch.device, save: Callable[[dict], None]) -> dict:
    bw = bandwidth_GBps(dev)
    results: dict = {"kind": "decode", "machine": machine(dev), "bandwidth_GBps": bw, "settings": _settings(a)}
    results["sizes"] = {}
    dtypes = a.dtypes.split(",")  # bf16 first by default: the goals' figure
    for size in a.sizes.split(","):
        ck = checkpoint(size, Path(a.weights_dir))
        ids = torch.randint(0, 50257, (1, a.prompt_len), generator=torch.Generator().manual_seed(0)).to(dev)
        per_dtype: dict = {}
        results["sizes"][size] = {"new_tokens": a.new_tokens, "batch1": per_dtype, "batched": {}}

        # the goals' dtypes, then the sampled batches (a goal too), then the rest: a run cut short keeps the goals
        goals = [d for d in dtypes if d in ("bfloat16", "float32")]
        for dname in goals:
            _batch1(a, dev, size, ck, ids, dname, bw, per_dtype, lambda: save(results))
        free(dev)
        results["sizes"][size]["batched"] = batched(a, ck, dev)
        results["sizes"][size]["batched_dtype"] = "bfloat16" if dev.type == "cuda" else "float32"  # as batched loads
        save(results)
        for dname in [d for d in dtypes if d not in goals]:
            _batch1(a, dev, size, ck, ids, dname, bw, per_dtype, lambda: save(results))
        free(dev)
    return results


def decode_loops(
    ours,  # noqa: ANN001
    hf,  # noqa: ANN001
    ids: torch.Tensor,
    N: int,
    compile_ours: str | None,
    hf_compile: bool,
) -> dict[str, Callable[[], torch.Tensor]]:
    """The greedy batch-1 loops by row name, in the order they run: ours through `generate` (the CUDA graph; compiled
    first with the backend `compile_ours`, unless None; the same step eagerly; on CUDA with the forward's ops, with
    cuBLAS's matmuls, and attending through SDPA after the cache write, with its memory-efficient kernel, cuDNN's
    (bf16/fp16) and the math one), then transformers' `generate` (hf None: none of its rows) with its dynamic and its
    static cache, that one also compiled on a GPU where `hf_compile`."""
    cuda = ours.device.type == "cuda"
    fns = {"ours": partial(greedy_ours, ours, ids, N)}
    if compile_ours:  # `generate --compile`: the step compiled (on CUDA, then recorded as the graph)
        fns["ours, compiled"] = partial(greedy_ours, ours, ids, N, compile_step=compile_ours)
    fns["ours, no cuda graph"] = partial(greedy_ours, ours, ids, N, cuda_graph=False)
    if cuda:  # what the fused step (generate's default there) gains: `generate --op-for-op`
        fns["ours, op for op"] = partial(greedy_ours, ours, ids, N, fused_kernels=False)
        # the fused step's matmuls as model/norm_linear.py's kernels (the add and norm before each inside) against
        # cuBLAS's after add_norm.py's kernel (what the step ran before them)
        fns["ours, cuBLAS matmuls"] = partial(greedy_ours, ours, ids, N, linear_kernel=False)
        if N + ids.shape[1] > 448:  # a cache of 512 slots or more: the attention split over programs, or not
            fns["ours, attention unsplit"] = partial(greedy_ours, ours, ids, N, split_attention=False)
        # the fused step's one-kernel attention (the cache write included) against SDPA's kernels after the cache
        # write: the memory-efficient one (what the step ran before), cuDNN's (bf16/fp16), which plans once over the
        # step's fixed shapes, and the math one (a few small kernels: matmul, softmax, matmul)
        fns["ours, SDPA attention"] = partial(greedy_ours, ours, ids, N, attention=list(VARYING_SHAPE_BACKENDS))
        if ours.dtype in (torch.bfloat16, torch.float16):
            fns["ours, cuDNN attention"] = partial(greedy_ours, ours, ids, N, attention=[SDPBackend.CUDNN_ATTENTION])
        fns["ours, math attention"] = partial(greedy_ours, ours, ids, N, attention=[SDPBackend.MATH])
    # each of our rows keeps a step of its own on the model (another batch, graph, compile or kernel choice): all of
    # them stay kept across the interleaved rounds, where the product's limit would push one out each round, to be
    # recorded (and compiled) again the next
    generate_steps.KEEP_CAPTURED = max(generate_steps.KEEP_CAPTURED, len(fns))
    if hf is not None:
        fns["transformers"] = partial(greedy_hf, hf, ids, N)
        fns["transformers, static cache"] = partial(greedy_hf, hf, ids, N, static=True)
        if cuda and hf_compile:  # generate compiles the static-cache forward on a GPU only
            fns["transformers, static cache, compiled"] = partial(greedy_hf, hf, ids, N, static=True, compiled=True)
    return fns


def _batch1(
    a: argparse.Namespace,
    dev: torch.device,
    size: str,
    ck: Path,
    ids: torch.Tensor,
    dname: str,
    bw: float,
    into: dict,
    save: Callable[[], None],
) -> None:
    """Greedy batch-1 decode of one size in dtype `dname`, every path interleaved: its record into[dname], saved
    after every round (the larger sizes in bfloat16 alone unless --xl-all-dtypes)."""
    from gpt2_port.model import from_pretrained

    dt, N = getattr(torch, dname), a.new_tokens
    if size not in ("gpt2", "tiny") and dname != "bfloat16" and not a.xl_all_dtypes:
        return
    free(dev)
    ours, _ = from_pretrained(ck, dtype=dt, device=dev)
    hf = _hf(ck, dev).to(dt).eval()
    hf.generation_config.eos_token_id = None
    compile_ours = None if a.no_compile else a.compile_backend
    fns = decode_loops(ours, hf, ids, N, compile_ours, hf_compile=not a.no_hf_compile)
    param_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())

    def record(runs: dict[str, dict]) -> None:
        into[dname] = _decode_rows(runs, N, bw, param_bytes, peak_GB(dev))
        save()

    runs = _interleaved(fns, dev, a.rounds, record)
    theirs = runs.get("transformers", {}).get("tokens")
    for name, r in runs.items():  # where a path's tokens leave transformers': by how much transformers chose its own
        if theirs and r.get("tokens") and r["tokens"] != theirs and name in into.get(dname, {}).get("rows", {}):
            try:
                into[dname]["rows"][name]["first_difference"] = first_difference(hf, ids, theirs, r["tokens"])
            except Exception as e:  # noqa: BLE001 - the figures measured stand without it
                into[dname]["rows"][name]["first_difference"] = failure(e)
    save()


def _decode_rows(runs: dict[str, dict], N: int, bw: float, param_bytes: int, peak: float | None) -> dict:
    """One dtype's batch-1 record from the timed runs so far: tokens/s (best round), the tokens shared with
    transformers' generate, the bandwidth cap; a row with no timed round yet has tok_s None."""
    ref = runs.get("transformers", {}).get("tokens") or []

    def row(r: dict) -> dict:
        if "error" in r:
            return r
        return {
            "tok_s": N / min(r["times"]) if r["times"] else None,
            "times": r["times"],
            "same_tokens": same_prefix(r["tokens"], ref) if ref and r["tokens"] else None,  # None: no reference
        }

    return {
        "param_bytes": param_bytes,
        "cap_tok_s": bw * 1e9 / param_bytes,
        "rows": {n: row(r) for n, r in runs.items()},
        "peak_GB": peak,  # both models and every path's buffers of this dtype
    }


def batched(a: argparse.Namespace, ck: Path, dev: torch.device) -> dict:
    """Sampled rows of padded prompts (left-padded, lengths 8..32), top-k 50, seeded: all rows' tokens/s."""
    from gpt2_port.model import from_pretrained

    out = {}
    free(dev)
    ours, _ = from_pretrained(ck, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev)
    hf = _hf(ck, dev).to(ours.dtype).eval()
    hf.generation_config.eos_token_id = None
    for B in [int(b) for b in a.batches.split(",") if b]:
        g = torch.Generator().manual_seed(B)
        lens = torch.randint(8, 33, (B,), generator=g)
        T = int(lens.max())
        ids = torch.randint(0, 50257, (B, T), generator=g)
        mask = (torch.arange(T)[None] >= (T - lens)[:, None]).long()
        ids, mask = ids.to(dev), mask.to(dev)
        N = a.new_tokens

        def ours_fn(ids=ids, mask=mask, N=N):  # noqa: ANN001, ANN202
            return sampled_ours(ours, ids, mask, N)

        def hf_fn(ids=ids, mask=mask, N=N):  # noqa: ANN001, ANN202
            return hf.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=True, top_k=50, pad_token_id=0)

        runs = _interleaved({"ours": ours_fn, "transformers": hf_fn}, dev, a.rounds)
        out[B] = {
            n: r if "error" in r else {"tok_s": B * N / min(r["times"]), "times": r["times"]} for n, r in runs.items()
        }
    return out


# -- output ---------------------------------------------------------------------------------------------------------
def _settings(a: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(a).items() if k != "func"}


def render(res: dict) -> str:
    m = res["machine"]
    head = [
        f"## GPU {res['kind']}: {m['device_name']} ({m['device']})",
        "",
        f"- Command: `{res.get('command') or 'python -m benchmarks.gpu ' + ' '.join(sys.argv[1:])}`",
        f"- Versions: torch {m['torch']}, transformers {m['transformers']}, CUDA {m.get('cuda')}, Python {m['python']}",
        "",
    ]
    out = head
    if res["kind"] == "train":
        for size, r in res["sizes"].items():
            out += [
                f"### {size}: batch {r['batch']} x {r['block']}, {res['settings']['dtype']}; MFU against {r['peak']}",
                "",
                "| side | tokens/s | vs transformers eager | vs transformers compiled | MFU | peak GB |",
                "|---|---|---|---|---|---|",
            ]
            rows = r["rows"]
            base_e = rows.get("transformers eager", {}).get("tokens_per_s")
            base_c = rows.get("transformers compiled", {}).get("tokens_per_s")
            for name, x in rows.items():
                if "tokens_per_s" not in x:
                    out.append(f"| {name} | {x.get('error')} | | | | |")
                    continue
                tps = x["tokens_per_s"]
                ve = f"{tps / base_e:.2f}x" if base_e else "-"
                vc = f"{tps / base_c:.2f}x" if base_c else "-"
                mfu = f"{100 * x['mfu']:.1f}%" if x.get("mfu") is not None else "-"
                pk = f"{x['peak_GB']:.1f}" if x.get("peak_GB") is not None else "-"
                out.append(f"| {name} | {tps:,.0f} | {ve} | {vc} | {mfu} | {pk} |")
            for name, x in rows.items():  # train's own first lines: its attention kernel, its memory check
                if x.get("attention"):
                    out += ["", f"{name}: attention {x['attention']}"]
                if x.get("memory_estimate_GB") and x.get("peak_GB"):
                    est, pk = x["memory_estimate_GB"], x["peak_GB"]
                    out.append(f"{name}: memory check {est:.2f} GB beside the run's peak {pk:.2f} GB ({est / pk:.2f}x)")
            if r.get("head_gemm") and "error" in r["head_gemm"]:
                out += ["", f"Head matmul: {r['head_gemm']['error']}"]
            elif r.get("head_gemm"):
                hg = r["head_gemm"]
                out += [
                    "",
                    f"Head matmul forward + backward at {r['batch'] * r['block']} rows: vocabulary 50257 "
                    f"{1e3 * hg['vocab_50257_s']:.2f} ms, padded to 50304 {1e3 * hg['vocab_50304_s']:.2f} ms "
                    f"({hg['padded_speedup']:.3f}x).",
                ]
            out.append("")
    else:
        out.insert(-1, f"- Measured read bandwidth of the device: {res['bandwidth_GBps']:.0f} GB/s")
        for size, r in res["sizes"].items():
            for dname, d in r["batch1"].items():
                out += [
                    f"### {size}, {dname}, batch 1, greedy, {r['new_tokens']} new tokens (cap "
                    f"{d['cap_tok_s']:,.0f} tok/s: the weights read once per token)",
                    "",
                    "| path | tok/s | vs transformers | share of cap | same tokens |",
                    "|---|---|---|---|---|",
                ]
                base = d["rows"].get("transformers", {}).get("tok_s")  # absent in a run cut short before it
                for name, x in d["rows"].items():
                    if x.get("tok_s") is None:  # failed, or cut short before its first timed round
                        out.append(f"| {name} | {x.get('error', 'not timed')} | | | |")
                        continue
                    vs = f"{x['tok_s'] / base:.2f}x" if base else "-"
                    same = "-" if x["same_tokens"] is None else f"{x['same_tokens']}/{r['new_tokens']}"
                    same += _parting(x.get("first_difference"))
                    out.append(f"| {name} | {x['tok_s']:,.1f} | {vs} | {x['tok_s'] / d['cap_tok_s']:.0%} | {same} |")
                out.append("")
            sampled_in = f", {r['batched_dtype']}" if "batched_dtype" in r else ""  # older results lack it
            vs32 = _against_float32(r["batch1"])
            if vs32:
                out += [f"ours in {vs32} ours in float32 (batch 1)", ""]
            out += [
                f"### {size}: sampled, padded batches (top-k 50){sampled_in}",
                "",
                "| batch | ours tok/s | transformers tok/s | ratio |",
            ]
            out.append("|---|---|---|---|")
            for B, x in r["batched"].items():
                o, h = x["ours"].get("tok_s"), x["transformers"].get("tok_s")
                if o is None or h is None:
                    out.append(f"| {B} | {o or x['ours'].get('error')} | {h or x['transformers'].get('error')} | |")
                    continue
                out.append(f"| {B} | {o:,.0f} | {h:,.0f} | {o / h:.2f}x |")
            out.append("")
    return "\n".join(out) + "\n"


def _parting(d: dict | None) -> str:
    """ " (then a tie in transformers' scores)" or " (transformers' token ahead by 0.031)": how the tokens parted."""
    if not d or "reference_margin" not in d:
        return ""
    if d["reference_margin"] == 0:
        return " (then a tie in transformers' own scores)"
    lead, gap = d["reference_margin"], d["reference_top2_gap"]
    return f" (then transformers' token ahead by {lead:.3g}; its top two {gap:.3g} apart)"


def _against_float32(batch1: dict) -> str:
    """ "bfloat16 1.83x, float16 1.80x of": each low-precision dtype's tokens/s through the product path over
    float32's, where both were timed ("" otherwise)."""
    rate = {d: x["rows"].get("ours", {}).get("tok_s") for d, x in batch1.items()}
    if not rate.get("float32"):
        return ""
    parts = [f"{d} {rate[d] / rate['float32']:.2f}x" for d in batch1 if d != "float32" and rate[d]]
    return f"{', '.join(parts)} of" if parts else ""


def plot(res: dict, path: str) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for size, r in res["sizes"].items():
        if res["kind"] == "train":
            for name, x in r["rows"].items():
                if "tokens_per_s" in x:
                    labels.append(f"{size}: {name}")
                    values.append(x["tokens_per_s"])
        else:
            for dname, d in r["batch1"].items():
                for name, x in d["rows"].items():
                    if x.get("tok_s") is not None:
                        labels.append(f"{size} {dname}: {name}")
                        values.append(x["tok_s"])
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(labels) + 1))
    ax.barh(labels[::-1], values[::-1], color=["C0" if "ours" in s else "C7" for s in labels[::-1]])
    ax.set_xlabel("tokens/s")
    ax.set_title(f"{res['kind']} on {res['machine']['device_name']}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_output(path, buf.getvalue(), "--plot")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["train", "decode"])
    p.add_argument("--sizes", default="gpt2", help="comma-separated: tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--weights-dir", default="weights/bench")
    p.add_argument("--dtype", default="bf16", choices=["float32", "bf16", "fp16"], help="train: autocast dtype")
    p.add_argument("--batch", type=int, default=16, help="train: micro-batch of 124M (and tiny)")
    p.add_argument("--xl-batch", type=int, default=4, help="train: micro-batch of the larger sizes")
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=5, help="train: steps before timing (compilation happens here)")
    p.add_argument("--steps", type=int, default=20, help="train: timed steps")
    p.add_argument(
        "--no-compile", action="store_true", help="train: the eager sides only; decode: leave out ours compiled"
    )
    p.add_argument(
        "--key-only",
        action="store_true",
        help="train: the sides the goals name (train's loop, ours fast and transformers, compiled and eager), then the "
        "eager rest (reference kernels, head not padded, no fused loss), ours fast compiled with no fused loss and the "
        "head matmul: no --no-overlap loop and no other compiled rest",
    )
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--new-tokens", type=int, default=128, help="decode: new tokens per row")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--batches", default="8,32,64", help="decode: sampled batch sizes")
    p.add_argument("--rounds", type=int, default=3, help="decode: interleaved timed rounds")
    p.add_argument(
        "--dtypes",
        default="bfloat16,float32,float16",
        help="decode: the batch-1 dtypes, in order (comma-separated: bfloat16, float32, float16)",
    )
    p.add_argument(
        "--no-hf-compile",
        action="store_true",
        help="decode: leave out transformers' compiled static-cache generate (its compile is most of a dtype's time)",
    )
    p.add_argument(
        "--xl-all-dtypes", action="store_true", help="decode: the larger sizes in every --dtypes (else bfloat16 only)"
    )
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--markdown", default=None, help="append the tables to this Markdown file (- for stdout)")
    p.add_argument("--plot", default=None, help="a PNG of tokens/s per side")
    p.add_argument(
        "--render-from",
        metavar="JSON",
        default=None,
        help="run nothing: the Markdown and the plot of the results in JSON (a run's --out, also one cut short)",
    )
    return p


def read_results(path: str, kind: str) -> dict:
    """A run's --out JSON, as far as it got (UsageError naming the file when it is not one)."""
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--render-from {path}: not a readable JSON file ({e})") from None
    if not isinstance(res, dict) or res.get("kind") != kind or not isinstance(res.get("sizes"), dict):
        raise UsageError(f"--render-from {path}: expected the JSON of a `benchmarks.gpu {kind}` run")
    return res


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    command = "python -m benchmarks.gpu " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        if a.render_from and a.out:
            raise UsageError("--render-from reads a run's results: --out would have nothing to write (drop it)")
        for path, what in ((a.out, "--out"), (a.markdown, "--markdown"), (a.plot, "--plot")):
            if path:
                check_writable(path, what)
        names = a.dtypes.split(",")
        if not a.render_from and (not set(names) <= DECODE_DTYPES or len(set(names)) != len(names)):
            raise UsageError(f"--dtypes {a.dtypes}: expected distinct names of {', '.join(sorted(DECODE_DTYPES))}")
        dev = parse_device(a.device) if not a.render_from else torch.device("cpu")

        def save(res: dict) -> None:  # the JSON so far, rewritten whole after each side
            res.setdefault("command", command)
            if a.out:
                write_output(a.out, json.dumps(res, indent=1, default=str) + "\n", "--out")

        if a.render_from:
            res = read_results(a.render_from, a.kind)
        else:
            run = run_train if a.kind == "train" else run_decode
            res = run(a, dev, save)
            save(res)
        md = render(res)
        print(md)
        if a.markdown:
            old = Path(a.markdown).read_text() if a.markdown != "-" and Path(a.markdown).is_file() else ""
            write_output(a.markdown, old + ("\n" if old else "") + md, "--markdown")
        if a.plot:
            plot(res, a.plot)
    except GPT2PortError as e:
        print(f"python -m benchmarks.gpu: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
