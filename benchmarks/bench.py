"""The benchmark: gpt2_port against transformers on the same random-weight checkpoints, in one run.

For every size: load time and peak RSS (one fresh process per load, ours and transformers alternating, several
rounds, cold then warm page cache; the median load stands), prefill latency (B x T tokens filling a KV cache,
last-position logits) and greedy decode tok/s (batch 1), both timed in one process holding both models with their
runs interleaved (so machine noise hits both alike), and the low-precision
options (int8, bfloat16, float16: decode speed, and parity against the float32 transformers reference).
Results go to JSON and to a Markdown section of BENCHMARKS.md (between `<!-- bench:begin -->` and `<!-- bench:end -->`).

    ./dev bench --sizes gpt2,gpt2-medium,gpt2-large,gpt2-xl --out benchmarks/results.json --markdown BENCHMARKS.md
    python -m benchmarks ...   (the same, from the checkout's root; benchmarks/ is not part of the installed package)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.decode import same_prefix
from gpt2_port.config import PRESETS
from gpt2_port.errors import UsageError
from gpt2_port.files import STDOUT, check_writable, write_output

REPO = Path(__file__).resolve().parents[1]
SIZES = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        default="gpt2",
        help="comma-separated presets (default gpt2; all four: "
        "gpt2,gpt2-medium,gpt2-large,gpt2-xl) or paths of checkpoint directories",
    )
    p.add_argument(
        "--weights-dir",
        default="weights/bench",
        help="where the random checkpoints are written and reused (default weights/bench/<size>)",
    )
    p.add_argument("--new-tokens", type=int, default=128, help="greedy decode length, batch 1 (default 128)")
    p.add_argument("--prompt-len", type=int, default=16, help="decode prompt length in tokens (default 16)")
    p.add_argument("--prefill", default="1x128,8x128", help="prefill shapes BxT, comma-separated (default 1x128,8x128)")
    p.add_argument(
        "--lowp",
        default="int8,int8-fast,bfloat16,float16",
        help="low-precision options to time and check (default int8,int8-fast,bfloat16,float16; '' for "
        "none). int8: quantize_int8 (weight-only accuracy); int8-fast: exact_activations=False",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=0, help="torch threads in every worker (default: torch's default)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=30.0,
        help="time budget of one timed measurement; runs repeat (up to 3 decode / 5 prefill) within it",
    )
    p.add_argument(
        "--speed-rounds",
        type=int,
        default=0,
        help="interleaved rounds of prefill and of decode, within --max-seconds (default 5 prefill, 3 decode)",
    )
    p.add_argument("--membw-mb", type=int, default=1024, help="size of the bandwidth test tensor (default 1024 MiB)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-page-cache loads")
    p.add_argument(
        "--load-rounds",
        type=int,
        default=3,
        help="fresh-process loads per implementation and cache state, alternating ours/transformers; the median "
        "stands (default 3)",
    )
    p.add_argument("--no-parity", action="store_true", help="skip the low-precision parity reports")
    p.add_argument("--out", default="benchmarks/results.json", help="JSON results (default benchmarks/results.json)")
    p.add_argument("--markdown", default=None, help="write/refresh the results section of this Markdown file")


def drop_page_cache(files: list[Path]) -> str:
    """Evict the checkpoint from the page cache: drop_caches when allowed (root), else posix_fadvise DONTNEED."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    if not hasattr(os, "posix_fadvise"):
        return "none (no drop_caches permission, no posix_fadvise)"
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"


def warm_page_cache(files: list[Path]) -> None:
    for p in files:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def run_worker(spec: dict, log: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)]
    env = dict(
        os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false"
    )
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0 or not p.stdout.strip():
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"worker {spec['impl']}/{spec.get('dtype', 'float32')} failed (exit {p.returncode}): " + " | ".join(tail)
        )
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = wall
    log.append(f"{spec['impl']:>5} {spec.get('dtype', 'float32'):>8} {spec.get('cache', ''):>5}  {wall:6.1f}s")
    return res


def ensure_checkpoint(size: str, weights_dir: Path) -> Path:
    if size not in PRESETS:
        d = Path(size)
        if not (d / "config.json").is_file():
            raise UsageError(f"--sizes {size}: not a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
        return d
    d = weights_dir / size
    if (d / "model.safetensors").is_file() and (d / "config.json").is_file():
        return d
    from gpt2_port.io.demo import write_demo_checkpoint

    tok = REPO.parent / "shared" / "gpt2-tokenizer"
    print(f"writing random {size} checkpoint to {d} ...", file=sys.stderr)
    return write_demo_checkpoint(d, size=size, seed=0, tokenizer_dir=tok if (tok / "encoder.json").is_file() else None)


def machine_info() -> dict:
    import torch

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                info["cpu"] = ln.split(":", 1)[1].strip()
                break
        mem = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
        info["mem_total_GB"] = int(mem.split()[1]) * 1024 / 1e9
        info["loadavg_start"] = os.getloadavg()
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def bench_size(size: str, a: argparse.Namespace, log: list[str]) -> dict:
    d = ensure_checkpoint(size, Path(a.weights_dir))
    files = sorted(d.glob("*.safetensors"))
    file_bytes = sum(p.stat().st_size for p in files)
    prefill = [[int(x) for x in s.lower().split("x")] for s in a.prefill.split(",") if s]
    base = {
        "ckpt": str(d.resolve()),
        "device": a.device,
        "threads": a.threads,
        "max_seconds": a.max_seconds,
        "new_tokens": a.new_tokens,
        "prompt_len": a.prompt_len,
        "prefill_shapes": prefill,
        **({"prefill_runs": a.speed_rounds, "decode_runs": a.speed_rounds} if a.speed_rounds > 0 else {}),
    }
    out: dict = {"size": size, "ckpt": str(d), "file_bytes": file_bytes, "loads": {}, "runs": {}}
    log.append(f"[{size}] {d} ({file_bytes / 1e9:.2f} GB)")
    # Loads: one fresh process per load; ours and transformers alternate, `--load-rounds` times per cache state, and
    # the run with the median load time stands for each (all runs are kept in "load_runs").
    for cache in ([] if a.no_cold else ["cold"]) + ["warm"]:
        runs: dict[str, list[dict]] = {"ours": [], "hf": []}
        for r in range(a.load_rounds):
            for impl in ("ours", "hf") if r % 2 == 0 else ("hf", "ours"):
                if cache == "cold":
                    out["cache_method"] = drop_page_cache(files)
                else:
                    warm_page_cache(files)
                runs[impl].append(run_worker({**base, "impl": impl, "tasks": [], "cache": cache}, log))
        for impl, rs in runs.items():
            med = sorted(rs, key=lambda x: x["load_s"])[len(rs) // 2]
            out["loads"][f"{impl}_{cache}"] = {**med, "load_runs": [x["load_s"] for x in rs]}
    # Speed: both implementations in one process, prefill and decode runs interleaved (benchmarks.worker.interleaved)
    warm_page_cache(files)
    duel = run_worker({**base, "impl": "duel", "tasks": ["prefill", "decode"], "cache": "warm"}, log)
    out["runs"]["ours_float32"], out["runs"]["hf_float32"] = duel["ours"], duel["hf"]
    lowp = [o for o in a.lowp.split(",") if o]
    for opt in lowp:
        if opt.startswith("int8") and a.device != "cpu":
            continue
        if opt.startswith("int8"):  # ours only: compared with transformers in float32
            r = run_worker({**base, "impl": "ours", "dtype": opt, "tasks": ["decode"], "cache": "warm"}, log)
            out["runs"][f"ours_{opt}"] = r
        else:  # both in that dtype, in one process: its tokens compare with transformers' in the same dtype, and its
            # prefills with transformers' (a prefill's matmuls are where a CPU's low-precision kernels decide)
            d = run_worker({**base, "impl": "duel", "dtype": opt, "tasks": ["prefill", "decode"], "cache": "warm"}, log)
            out["runs"][f"ours_{opt}"], out["runs"][f"hf_{opt}"] = d["ours"], d["hf"]
    if lowp and not a.no_parity:
        t0 = time.perf_counter()
        # in a child process: it loads the reference and every option, which should not count in anyone's RSS
        cmd = [sys.executable, "-m", "benchmarks.quant_parity", str(d), "--options", ",".join(lowp)]
        p = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")),
        )
        if p.returncode != 0:
            raise RuntimeError(f"quant_parity failed: {p.stderr.strip().splitlines()[-1:]}")
        out["parity"] = json.loads(p.stdout)
        log.append(f"parity {time.perf_counter() - t0:6.1f}s")
    return out


def summarize(size_res: dict, bw: dict) -> dict:
    """The ratios the issue asks for (ours / transformers unless said otherwise)."""
    runs, loads = size_res["runs"], size_res["loads"]
    ours, hf = runs["ours_float32"], runs["hf_float32"]
    s: dict = {}
    for cache in ("cold", "warm"):
        o, h = loads.get(f"ours_{cache}"), loads.get(f"hf_{cache}")
        if o and h:
            s[f"load_s_{cache}"] = (o["load_s"], h["load_s"], o["load_s"] / h["load_s"])
            s[f"peak_rss_MB_{cache}"] = (o["peak_rss_MB"], h["peak_rss_MB"], o["peak_rss_MB"] / h["peak_rss_MB"])
            s[f"rss_over_file_{cache}"] = o["peak_rss_MB"] * 1e6 / size_res["file_bytes"]
            s[f"rss_over_params_{cache}"] = o["peak_rss_MB"] * 1e6 / ours["param_bytes"]
            s[f"load_delta_over_params_{cache}"] = (
                (o["peak_rss_MB"] - o["rss_before_load_MB"]) * 1e6 / ours["param_bytes"]
            )
            s[f"hf_rss_over_params_{cache}"] = h["peak_rss_MB"] * 1e6 / ours["param_bytes"]
    for shape in ours.get("prefill", {}):
        po, ph = ours["prefill"][shape]["best_s"], hf["prefill"][shape]["best_s"]
        s[f"prefill_{shape}_s"] = (po, ph, po / ph)
    do, dh = ours["decode"]["tok_s"], hf["decode"]["tok_s"]
    s["decode_tok_s"] = (do, dh, do / dh)
    s["decode_tokens_match"] = same_prefix(ours["decode"]["tokens"], hf["decode"]["tokens"])
    # the cap: the weights read once per token at the measured bandwidth of the memory they are in (the GPU's on CUDA)
    cap = bw["read_GBps"] * 1e9 / ours["param_bytes"]
    s["decode_cap_tok_s"] = cap
    s["decode_share_of_cap"] = do / cap
    s["hf_decode_share_of_cap"] = dh / cap
    for run in (ours, hf):
        for name, v in run.get("decode_variants", {}).items():
            s[f"{name}_tok_s"] = (v["tok_s"], dh, v["tok_s"] / dh)
            s[f"{name}_tokens_match"] = same_prefix(v["tokens"], hf["decode"]["tokens"])
    for k, r in runs.items():
        if k.startswith("ours_") and k != "ours_float32" and "decode" in r:
            opt = k.removeprefix("ours_")
            ref = runs.get(f"hf_{opt}", hf)  # transformers in the same dtype where it ran, else float32
            s[f"{k}_tok_s"] = (r["decode"]["tok_s"], dh, r["decode"]["tok_s"] / dh)
            s[f"{k}_vs_same_dtype"] = r["decode"]["tok_s"] / ref["decode"]["tok_s"]
            s[f"{k}_weight_GBps"] = r["decode"]["weight_GBps"]
            s[f"{k}_tokens_match_hf"] = same_prefix(r["decode"]["tokens"], ref["decode"]["tokens"])
            s[f"{k}_tokens_against"] = ref["dtype"]
            for shape, p in r.get("prefill", {}).items():  # (ours, transformers in that dtype, ratio; vs our float32)
                ph = ref["prefill"][shape]["best_s"]
                s[f"{k}_prefill_{shape}_s"] = (p["best_s"], ph, p["best_s"] / ph)
                s[f"{k}_prefill_{shape}_vs_float32"] = p["best_s"] / ours["prefill"][shape]["best_s"]
    return s


def main(a: argparse.Namespace) -> int:
    check_writable(a.out, "--out")
    if a.markdown:
        check_writable(a.markdown, "--markdown")
    sizes = [s for s in a.sizes.split(",") if s]
    if not sizes:
        raise UsageError("--sizes: give at least one size")
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available on this machine")
    log: list[str] = []
    t0 = time.perf_counter()
    argv = " ".join(shlex.quote(x) for x in sys.argv[1:])
    cmd = f"python -m benchmarks {argv}"
    results: dict = {
        "command": cmd,
        "machine": machine_info(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "settings": {k: v for k, v in vars(a).items() if k != "func"},
        "sizes": {},
    }
    from benchmarks.worker import membw  # in this process: it needs no isolation

    results["membw"] = membw({"threads": a.threads, "membw_bytes": a.membw_mb << 20, "device": a.device})
    for size in sizes:
        res = bench_size(size, a, log)
        res["summary"] = summarize(res, results["membw"])
        results["sizes"][size] = res
        print("\n".join(log), file=sys.stderr)
        log.clear()
    results["total_s"] = time.perf_counter() - t0
    results["machine"]["loadavg_end"] = os.getloadavg()
    written = [write_output(a.out, json.dumps(results, indent=1) + "\n", "--out")]
    from benchmarks.report import render, update_markdown

    md = render(results)
    print(md, file=sys.stderr if "-" in (a.out, a.markdown) else sys.stdout)  # keep a JSON/Markdown stdout clean
    if a.markdown:
        written.append(update_markdown(a.markdown, md))
    for w in written:
        if w != STDOUT:
            print(f"wrote {w}", file=sys.stderr)
    return 0
