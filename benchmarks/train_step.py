"""One training step (forward, backward, AdamW) of 124M float32, ours against transformers' GPT2LMHeadModel.

    PYTHONPATH=. python -m benchmarks.train_step [--ckpt DIR] [--batch 4] [--seq 256] [--rounds 3] [--json PATH]
        [--dtype bf16]

- time: the three sides in one process -- ours with the reference kernels (bit-identical to transformers), ours with
  the fast kernels (`set_kernels("fast")`: one-kernel GELU, the head fused with the loss) and transformers -- the
  same batch and the same torch.optim.AdamW (decay groups by dimension), clip_grad_norm_ 1.0, dropout off, sdpa
  attention; steps interleaved in rotating order after one warm-up step each, so machine noise hits every side;
  the median of each and the ratios to transformers (also per round).
- memory: peak RSS (VmHWM) of each in a fresh process (load + 2 steps), so no allocation is shared; beside it the
  RSS after loading, and ours with gradient checkpointing. The activation memory checkpointing saves is also counted
  exactly: the bytes of the tensors autograd saves for backward during one forward (saved_tensors_hooks), with and
  without checkpointing.
- throughput: 6 x parameters x tokens per step / time, beside this machine's float32 GEMM rate (a timed torch.mm).
- --profile PATH: torch.profiler (CPU) over 2 more steps of each side, the op tables (by self CPU time) written to
  PATH as text, to see where the two differ.
- --dtype bf16: every side's forward and backward under bf16 autocast (what `train --dtype bf16` runs), weights and
  AdamW in float32; two more sides: ours with the fast kernels on autocast's own bf16 kernels (`ours-fast-kernels`:
  lowp.set_autocast_upcast(False); on a CPU without bf16 units ours otherwise runs float32 products of the bf16
  operands) and ours with the fast kernels in float32 (`ours-fast-float32`), so the ratios say what bf16 costs here.

Not a test: the numbers depend on the machine and its load (say so when quoting them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SIDES = ["ours", "ours-fast", "hf"]  # ours: reference kernels (bit-identical); ours-fast: GPT2.set_kernels("fast")
BF16_SIDES = ["ours", "ours-fast", "ours-fast-kernels", "hf", "ours-fast-float32"]  # --dtype bf16 (see above)


def rss_mb() -> tuple[float, float]:
    from benchmarks.worker import rss_mb as f

    return f()


def load(impl: str, ckpt: str):
    if impl == "hf":
        import transformers

        transformers.logging.set_verbosity_error()
        m = transformers.GPT2LMHeadModel.from_pretrained(ckpt, attn_implementation="sdpa")
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
        return m.train().requires_grad_(True)
    from gpt2_port.model import from_pretrained

    m, _ = from_pretrained(ckpt)
    m.set_attn_impl("sdpa")
    m.gradient_checkpointing = impl == "ours-gc"
    m.set_kernels("fast" if impl.startswith("ours-fast") else "reference")
    return m.set_dropout(0.0).train().requires_grad_(True)


def make_step(model, impl: str, dtype: str = "float32"):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-4
    )
    params = list(model.parameters())

    amp = dtype == "bf16" and not impl.endswith("-float32")

    def step(ids: torch.Tensor) -> float:
        from gpt2_port.model import lowp

        opt.zero_grad(set_to_none=True)
        lowp.set_autocast_upcast(impl != "ours-fast-kernels")
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                if impl == "hf":
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                else:
                    loss = model(ids, labels=ids).loss
            loss.backward()
        finally:
            lowp.set_autocast_upcast(True)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()

    return step


def batch(B: int, T: int) -> torch.Tensor:
    return torch.randint(0, 50257, (B, T), generator=torch.Generator().manual_seed(0))


def saved_bytes(model, impl: str, ids: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward (distinct storages counted once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss if impl == "hf" else model(ids, labels=ids).loss
    del loss
    return sum(n for ptr, n in seen.items() if ptr not in params)  # weights are not activations


def gemm_gflops(n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def worker(impl: str, ckpt: str, B: int, T: int) -> dict:
    """A fresh process: load, 2 steps (the first allocates AdamW's moments); RSS after load and peak."""
    torch.manual_seed(0)
    m = load(impl, ckpt)
    after_load = rss_mb()[0]
    step = make_step(m, impl)
    ids = batch(B, T)
    for _ in range(2):
        step(ids)
    cur, peak = rss_mb()
    return {"impl": impl, "rss_after_load_mb": after_load, "rss_after_steps_mb": cur, "peak_rss_mb": peak}


def run_worker(impl: str, ckpt: str, B: int, T: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    spec = json.dumps({"impl": impl, "ckpt": ckpt, "B": B, "T": T})
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.train_step", "--worker", spec],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def profile_tables(steps: dict, ids: torch.Tensor, n: int = 2, rows: int = 30) -> str:
    """Each side's torch.profiler op table (self CPU time) over n steps, one after the other."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for impl, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                step(ids)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40)
        out.append(f"== {impl}: {n} steps\n{table}")
    return "\n".join(out)


def duel(ckpt: str, B: int, T: int, rounds: int, profile_path: str | None = None, dtype: str = "float32") -> dict:
    sides = BF16_SIDES if dtype == "bf16" else SIDES
    models = {impl: load(impl, ckpt) for impl in sides}
    ours = models["ours"]
    n_params = sum(p.numel() for p in ours.parameters())
    ids = batch(B, T)
    steps = {impl: make_step(m, impl, dtype) for impl, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in sides}
    losses: dict[str, list[float]] = {k: [] for k in sides}
    for k in range(rounds + 1):  # round 0 warms up (and allocates AdamW's moments)
        for impl in sides[k % len(sides) :] + sides[: k % len(sides)]:  # each side first in turn
            t0 = time.perf_counter()
            losses[impl].append(steps[impl](ids))
            if k:
                times[impl].append(time.perf_counter() - t0)
            print(f"  round {k} {impl}: {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    if profile_path:
        Path(profile_path).write_text(profile_tables(steps, ids) + "\n")
    flops = 6 * n_params * B * T
    act = {}
    if dtype == "float32":
        act = {impl: saved_bytes(m, impl, ids) for impl, m in models.items()}
        ours.gradient_checkpointing = True
        act["ours_checkpointed"] = saved_bytes(ours, "ours", ids)
    return {
        "dtype": dtype,
        "params": n_params,
        "step_s": times,
        "median_s": med,
        "ratio_ours_over_hf": med["ours"] / med["hf"],
        "ratio_ours_fast_over_hf": med["ours-fast"] / med["hf"],
        "ratios_over_hf": {impl: med[impl] / med["hf"] for impl in sides},
        "per_round_ratios": {impl: [a / b for a, b in zip(times[impl], times["hf"])] for impl in sides if impl != "hf"},
        "spread": {impl: (min(v) / med[impl], max(v) / med[impl]) for impl, v in times.items()},
        "losses_first_step": {k: v[0] for k, v in losses.items()},
        "gflops": {k: flops / v / 1e9 for k, v in med.items()},
        "saved_activation_mb": {k: v / 1e6 for k, v in act.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", default=None, help="a 124M checkpoint directory (default: a random one, written once)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="timed steps per side, interleaved (after one warm-up)")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None, help="write each side's torch.profiler op table to this text file")
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process peak RSS measurements")
    p.add_argument(
        "--dtype", choices=["float32", "bf16"], default="float32", help="bf16: under bf16 autocast (see above)"
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        s = json.loads(a.worker)
        print(json.dumps(worker(s["impl"], s["ckpt"], s["B"], s["T"])))
        return 0
    ckpt = a.ckpt
    if ckpt is None:
        from gpt2_port.io.demo import write_demo_checkpoint

        ckpt = str(Path(tempfile.gettempdir()) / "gpt2port-bench-124m")
        if not (Path(ckpt) / "model.safetensors").is_file():
            write_demo_checkpoint(ckpt, size="gpt2", seed=0)
    res: dict = {
        "batch": a.batch,
        "seq": a.seq,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
    }
    res["gemm_gflops"] = gemm_gflops()
    res.update(duel(ckpt, a.batch, a.seq, a.rounds, a.profile, a.dtype))
    res["gemm_gflops_after"] = gemm_gflops()
    if not a.no_rss and a.dtype == "float32":
        res["rss"] = {impl: run_worker(impl, ckpt, a.batch, a.seq) for impl in (*SIDES, "ours-gc")}
    res["loadavg_after"] = os.getloadavg()
    text = json.dumps(res, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
