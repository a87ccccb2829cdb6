"""One measurement process: one load of one implementation, then (optionally) prefill and decode timings.

Run by benchmarks.bench as `python -m benchmarks.worker '<json spec>'`, in a fresh process each time, so that the
peak RSS it reports (VmHWM) belongs to this one load. Prints one JSON object on the last line of stdout.

spec: impl ("ours" | "hf"), ckpt (directory), dtype ("float32" | "bfloat16" | "float16" | "int8"; int8 is ours
only), device, tasks (subset of "prefill", "decode"), prefill_shapes ([[B, T], ...]), prompt_len, new_tokens,
max_seconds (time budget per timed measurement), threads, static (ours: decode through the static step; CUDA graph
on CUDA), seed. Or impl "membw": the machine's memory bandwidth.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

T_START = time.perf_counter()


def rss_mb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MB (1e6 bytes), from /proc/self/status; getrusage as fallback."""
    try:
        with open("/proc/self/status") as f:
            d = {ln.split(":")[0]: ln.split(":")[1] for ln in f if ":" in ln}
        return int(d["VmRSS"].split()[0]) * 1024 / 1e6, int(d["VmHWM"].split()[0]) * 1024 / 1e6
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_b = peak if sys.platform == "darwin" else peak * 1024
        return float("nan"), peak_b / 1e6


def sync(device) -> None:  # noqa: ANN001
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, max_seconds: float, max_runs: int, warmup: int = 1) -> list[float]:  # noqa: ANN001
    """Wall times of fn() after `warmup` untimed calls: at least one run, more while within max_seconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    t_all = time.perf_counter()
    while len(times) < max_runs:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_all + times[-1] > max_seconds:
            break
    return times


def membw(spec: dict) -> dict:
    """Read bandwidth (sum over a large float32 tensor) and copy bandwidth (read + write), best of several runs."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    n = int(spec.get("membw_bytes", 1 << 30)) // 4
    a = torch.ones(n)
    b = torch.empty_like(a)
    read, copy = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        read.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b.copy_(a)
        copy.append(time.perf_counter() - t0)
    nbytes = n * 4
    return {
        "impl": "membw",
        "bytes": nbytes,
        "read_GBps": nbytes / min(read) / 1e9,
        "copy_GBps": 2 * nbytes / min(copy) / 1e9,
        "threads": torch.get_num_threads(),
    }


def main(spec: dict) -> dict:
    if spec["impl"] == "membw":
        return membw(spec)
    import torch

    t_imp = time.perf_counter()
    from gpt2_port.load import parse_device

    if spec["impl"] == "hf":
        import transformers
        from transformers import GPT2LMHeadModel

        transformers.logging.set_verbosity_error()
    from benchmarks.decode import greedy_hf, greedy_ours, greedy_static

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    dev = parse_device(spec.get("device", "cpu"))
    import_s = time.perf_counter() - T_START
    rss0, _ = rss_mb()
    dtype_name = spec.get("dtype", "float32")
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype_name, torch.float32)  # int8*: from float32
    one = torch.zeros(1, 1, dtype=torch.long, device=dev)

    # Time to a ready model: from the load call to the end of a first one-token forward (weights resident).
    t0 = time.perf_counter()
    if spec["impl"] == "ours":
        from gpt2_port.load import from_pretrained

        model, _report = from_pretrained(spec["ckpt"], dtype=dt, device=dev)
        if dtype_name.startswith("int8"):  # int8: exact activations (weight-only accuracy); int8-fast: one pass
            from gpt2_port.quantize import quantize_int8

            quantize_int8(model, exact_activations=dtype_name == "int8")
        with torch.inference_mode():
            model(one)
    elif spec["impl"] == "hf":
        if dtype_name.startswith("int8"):
            raise SystemExit("int8 is measured for gpt2_port only")
        model = GPT2LMHeadModel.from_pretrained(spec["ckpt"], dtype=dt).to(dev).eval()
        model.generation_config.eos_token_id = None  # run exactly new_tokens
        with torch.inference_mode():
            model(input_ids=one)
    else:
        raise SystemExit(f"unknown impl {spec['impl']!r}")
    sync(dev)
    load_s = time.perf_counter() - t0
    rss1, peak = rss_mb()
    res: dict = {
        "impl": spec["impl"],
        "dtype": dtype_name,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "import_s": import_s,
        "load_s": load_s,
        "rss_before_load_MB": rss0,
        "rss_ready_MB": rss1,
        "peak_rss_MB": peak,
        "import_to_load_s": t0 - t_imp,
    }
    if spec["impl"] == "ours":
        res["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        if dtype_name.startswith("int8"):
            from gpt2_port.quantize import Int8Linear

            q = [m for m in model.modules() if isinstance(m, Int8Linear)]
            rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "wte.weight")
            res["param_bytes"] = sum(m.nbytes for m in q) + rest  # what one decode step reads (wte: one row)
    else:
        res["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())

    g = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    vocab = 50257
    max_s = float(spec.get("max_seconds", 20))
    tasks = spec.get("tasks", [])
    if "prefill" in tasks:
        res["prefill"] = {}
        for B, T in spec.get("prefill_shapes", [[1, 128], [8, 128]]):
            ids = torch.randint(0, vocab, (B, T), generator=g).to(dev)
            if spec["impl"] == "ours":
                from gpt2_port.model import KVCache

                def fn(ids=ids, B=B, T=T):  # noqa: ANN001, ANN202
                    with torch.inference_mode():
                        return model(ids, cache=KVCache(model.config, B, T, model.dtype, dev), last_only=True)
            else:

                def fn(ids=ids):  # noqa: ANN001, ANN202
                    with torch.inference_mode():
                        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits

            times = timed(fn, dev, max_s, max_runs=int(spec.get("prefill_runs", 5)))
            res["prefill"][f"{B}x{T}"] = {
                "best_s": min(times),
                "median_s": sorted(times)[len(times) // 2],
                "runs": times,
            }
    if "decode" in tasks:
        P, N = int(spec.get("prompt_len", 16)), int(spec["new_tokens"])
        ids = torch.randint(0, vocab, (1, P), generator=g).to(dev)
        static = bool(spec.get("static"))
        if spec["impl"] == "ours":
            if static:

                def fn(n):  # noqa: ANN001, ANN202
                    return greedy_static(model, ids, n, cuda_graph=dev.type == "cuda")
            else:

                def fn(n):  # noqa: ANN001, ANN202
                    return greedy_ours(model, ids, n)
        else:

            def fn(n):  # noqa: ANN001, ANN202
                return greedy_hf(model, ids, n)

        fn(min(4, N))  # warm-up: allocator, kernels, page faults
        toks: list = []

        def run() -> None:
            toks.append(fn(N))

        times = timed(run, dev, max_s, max_runs=int(spec.get("decode_runs", 3)), warmup=0)
        best = min(times)
        res["decode"] = {
            "prompt_len": P,
            "new_tokens": N,
            "best_s": best,
            "median_s": sorted(times)[len(times) // 2],
            "tok_s": N / best,
            "runs": times,
            "static": static,
            "cuda_graph": static and dev.type == "cuda",
            "tokens": toks[-1][0].tolist(),
        }
        res["decode"]["weight_GBps"] = res["param_bytes"] * N / best / 1e9
    _, res["peak_rss_end_MB"] = rss_mb()
    return res


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (unmapping several GB) so the parent's timing stays tight
