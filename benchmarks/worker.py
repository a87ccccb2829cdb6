"""One measurement process: one load of one implementation, then (optionally) prefill and decode timings.

Run by benchmarks.bench as `python -m benchmarks.worker '<json spec>'`, in a fresh process each time, so that the
peak RSS it reports (VmHWM) belongs to this one load. Prints one JSON object on the last line of stdout.

spec: impl ("ours" | "hf" | "duel": both in one process, prefill and decode timed interleaved), ckpt (directory),
dtype ("float32" | "bfloat16" | "float16" | "int8"; int8 is ours
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


def membw(spec: dict) -> dict:
    """Read bandwidth (sum over a large float32 tensor) and copy bandwidth (read + write), best of several runs, of
    the memory the weights live in: the host's, or the GPU's on a CUDA device (where a decode step reads them)."""
    import torch

    from gpt2_port.devices import parse_device

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    dev = parse_device(spec.get("device", "cpu"))
    n = int(spec.get("membw_bytes", 1 << 30)) // 4
    a = torch.ones(n, device=dev)
    b = torch.empty_like(a)
    read, copy = [], []
    for _ in range(5):
        sync(dev)
        t0 = time.perf_counter()
        a.sum()
        sync(dev)
        read.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(dev)
        copy.append(time.perf_counter() - t0)
    nbytes = n * 4
    return {
        "impl": "membw",
        "device": str(dev),
        "bytes": nbytes,
        "read_GBps": nbytes / min(read) / 1e9,
        "copy_GBps": 2 * nbytes / min(copy) / 1e9,
        "threads": torch.get_num_threads(),
    }


def load(impl: str, spec: dict, dev, dtype_name: str):  # noqa: ANN001, ANN201
    """Load one implementation; time to a ready model = the load call through a first one-token forward."""
    import torch

    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype_name, torch.float32)  # int8*: from float32
    one = torch.zeros(1, 1, dtype=torch.long, device=dev)
    t0 = time.perf_counter()
    if impl == "ours":
        from gpt2_port.model import from_pretrained

        model, _report = from_pretrained(spec["ckpt"], dtype=dt, device=dev)
        if dtype_name.startswith("int8"):  # int8: exact activations (weight-only accuracy); int8-fast: one pass
            from gpt2_port.generate.int8 import quantize_int8

            quantize_int8(model, exact_activations=dtype_name == "int8")
        with torch.inference_mode():
            model(one)
    elif impl == "hf":
        from transformers import GPT2LMHeadModel

        if dtype_name.startswith("int8"):
            raise SystemExit("int8 is measured for gpt2_port only")
        model = GPT2LMHeadModel.from_pretrained(spec["ckpt"], dtype=dt).to(dev).eval()
        model.generation_config.eos_token_id = None  # run exactly new_tokens
        with torch.inference_mode():
            model(input_ids=one)
    else:
        raise SystemExit(f"unknown impl {impl!r}")
    sync(dev)
    load_s = time.perf_counter() - t0
    if impl == "ours" and dtype_name.startswith("int8"):
        from gpt2_port.generate.int8 import Int8Linear

        q = [m for m in model.modules() if isinstance(m, Int8Linear)]
        rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "wte.weight")
        param_bytes = sum(m.nbytes for m in q) + rest  # what one decode step reads (wte: one row)
    else:
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, load_s, param_bytes


def prefill_fn(impl: str, model, ids, dev):  # noqa: ANN001, ANN201
    """One prefill of ids (B, T): the prompt's forward pass with a KV cache, logits of the last position only."""
    import torch

    B, T = ids.shape
    if impl == "ours":
        from gpt2_port.generate.cache import KVCache

        def fn():  # noqa: ANN202
            with torch.inference_mode():
                return model(ids, cache=KVCache(model.config, B, T, model.dtype, dev), last_only=True)
    else:

        def fn():  # noqa: ANN202
            with torch.inference_mode():
                return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits

    return fn


def decode_fn(impl: str, model, ids, variant: str):  # noqa: ANN001, ANN201
    """fn(n) -> (1, n) greedy tokens after the prompt ids. variant: "" (the product path: on CUDA the captured
    static step), "nograph" (ours, the static step run eagerly), "static" (transformers with its static cache)."""
    from benchmarks.decode import greedy_hf, greedy_ours

    if impl == "ours":
        return lambda n: greedy_ours(model, ids, n, cuda_graph=variant != "nograph")
    return lambda n: greedy_hf(model, ids, n, static=variant == "static")


def interleaved(fns: dict, device, max_seconds: float, max_runs: int, warmup: bool = True) -> dict[str, list[float]]:  # noqa: ANN001
    """Wall times of each fn, run in alternating order round after round (ours, hf; then hf, ours; ...), so both
    see the same machine: one warm-up each (if warmup), at least one timed round, more while the rounds fit in the
    budget."""
    names = list(fns)
    for n in names if warmup else []:
        fns[n]()
    sync(device)
    times: dict[str, list[float]] = {n: [] for n in names}
    t_all = time.perf_counter()
    for r in range(max_runs):
        t_round = time.perf_counter()
        for n in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[n]()
            sync(device)
            times[n].append(time.perf_counter() - t0)
        if time.perf_counter() - t_all + (time.perf_counter() - t_round) > max_seconds:
            break
    return times


def stats(times: list[float]) -> dict:
    return {"best_s": min(times), "median_s": sorted(times)[len(times) // 2], "runs": times}


def main(spec: dict) -> dict:
    """impl "ours" | "hf": one load (and the tasks, timed alone); impl "duel": both loaded in this process, the
    prefill and decode tasks timed interleaved (see `interleaved`); returns {"ours": {...}, "hf": {...}}."""
    if spec["impl"] == "membw":
        return membw(spec)
    import torch

    t_imp = time.perf_counter()
    from gpt2_port.devices import parse_device

    impls = ["ours", "hf"] if spec["impl"] == "duel" else [spec["impl"]]
    if "hf" in impls:  # imported here, before any timing: the load time excludes every import (for both)
        import transformers
        from transformers import GPT2LMHeadModel  # noqa: F401  (the lazy module import of the modeling code)

        transformers.logging.set_verbosity_error()
    import benchmarks.decode  # noqa: F401

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    dev = parse_device(spec.get("device", "cpu"))
    import_s = time.perf_counter() - T_START
    rss0, _ = rss_mb()
    dtype_name = spec.get("dtype", "float32")
    res: dict = {}
    models = {}
    for impl in impls:
        model, load_s, param_bytes = load(impl, spec, dev, dtype_name)
        models[impl] = model
        rss1, peak = rss_mb()
        res[impl] = {
            "impl": impl,
            "dtype": dtype_name,
            "device": str(dev),
            "threads": torch.get_num_threads(),
            "import_s": import_s,
            "load_s": load_s,
            "rss_before_load_MB": rss0,
            "rss_ready_MB": rss1,
            "peak_rss_MB": peak,
            "import_to_load_s": time.perf_counter() - load_s - t_imp,
            "param_bytes": param_bytes,
            "interleaved": len(impls) > 1,
        }

    g = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    vocab = 50257
    max_s = float(spec.get("max_seconds", 20)) * len(impls)
    tasks = spec.get("tasks", [])
    if "prefill" in tasks:
        for impl in impls:
            res[impl]["prefill"] = {}
        for B, T in spec.get("prefill_shapes", [[1, 128], [8, 128]]):
            ids = torch.randint(0, vocab, (B, T), generator=g).to(dev)
            fns = {impl: prefill_fn(impl, models[impl], ids, dev) for impl in impls}
            times = interleaved(fns, dev, max_s, max_runs=int(spec.get("prefill_runs", 5)))
            for impl in impls:
                res[impl]["prefill"][f"{B}x{T}"] = stats(times[impl])
    if "decode" in tasks:
        P, N = int(spec.get("prompt_len", 16)), int(spec["new_tokens"])
        ids = torch.randint(0, vocab, (1, P), generator=g).to(dev)
        # the product paths, and on CUDA ours without the graph and transformers with its static cache
        variants = [(impl, "") for impl in impls]
        if dev.type == "cuda":
            variants += [(i, v) for i, v in (("ours", "nograph"), ("hf", "static")) if i in impls]
        toks: dict[str, list] = {}
        fns = {}
        for impl, variant in variants:
            name = f"{impl}_{variant}" if variant else impl
            toks[name] = []
            f = decode_fn(impl, models[impl], ids, variant)
            f(N)  # warm-up: allocator, kernels, page faults, the graph's capture for this length
            fns[name] = lambda f=f, name=name: toks[name].append(f(N))
        times = interleaved(fns, dev, max_s, max_runs=int(spec.get("decode_runs", 3)), warmup=False)
        for name in fns:
            impl = name.split("_")[0]
            best = min(times[name])
            entry = {
                "prompt_len": P,
                "new_tokens": N,
                **stats(times[name]),
                "tok_s": N / best,
                "variant": name,
                "tokens": toks[name][-1][0].tolist(),
                "weight_GBps": res[impl]["param_bytes"] * N / best / 1e9,
            }
            if name == impl:
                res[impl]["decode"] = entry
            else:
                res[impl].setdefault("decode_variants", {})[name] = entry
    _, peak_end = rss_mb()
    for impl in impls:
        res[impl]["peak_rss_end_MB"] = peak_end
    return res if len(impls) > 1 else res[impls[0]]


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (unmapping several GB) so the parent's timing stays tight
