"""bf16/fp16 inference matmuls on this CPU: the low-precision kernel against the product from float32 copies and
against oneDNN's packed weight.

How gpt2_port.model.lowp's rules were chosen. For each row count, the three 124M shapes (768 -> 2304, the fused
c_attn; 768 -> 3072, c_fc; 3072 -> 768, mlp.c_proj) are timed (best of --repeats, summed) in float32, with the
low-precision kernel, from float32 copies rounded once (what lowp.linear does from its threshold), and on the weight
packed by oneDNN (what lowp does for a marked weight where `lowp.packs`); the head (768 -> 50257) with the kernel and
packed. lowp's choices on this CPU are printed beside. oneDNN's kernels heed ONEDNN_MAX_CPU_ISA, so one CPU approximates
older ones (AVX512_CORE_BF16: AVX512-BF16 without AMX); only approximates: on a real AVX512-BF16 CPU without AMX the
bf16 kernel won at every row count where the capped Xeon had it lose from 128 rows (BENCHMARKS.md).

    python -m benchmarks.lowp_gemm [--dtypes bfloat16,float16] [--rows 1,8,16,32,64,128,256,512] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.arguments import positive_ints
from benchmarks.timing import best_ms
from gpt2_port.model import lowp

SHAPES = ((768, 2304), (768, 3072), (3072, 768))  # (in, out)
HEAD = (768, 50257)


def _packed_ms(x: torch.Tensor, w: torch.Tensor, repeats: int) -> float | None:
    """x @ w^T on oneDNN's packed copy of w, in ms; None where this torch or CPU has no packed kernel."""
    try:
        p = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    except (AttributeError, RuntimeError):
        return None
    return best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), repeats)


def _ratio(a: float | None, b: float) -> str:
    return "   -" if a is None else f"{a / b:4.2f}"


def _dtypes(s: str) -> list[str]:
    out = [v for v in s.split(",") if v]
    if not out or any(v not in ("bfloat16", "float16") for v in out):
        raise argparse.ArgumentTypeError(f"expected bfloat16 and/or float16 separated by commas, got {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lowp_gemm")
    p.add_argument("--dtypes", type=_dtypes, default=["bfloat16", "float16"])
    p.add_argument("--rows", type=positive_ints, default=[1, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--out", type=Path, help="JSON with every timing")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    torch.manual_seed(0)
    machine = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "features": sorted(lowp.cpu_features()),
        "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA"),
    }
    print(" ".join(f"{k} {v}" for k, v in machine.items()))
    results = []
    for name in a.dtypes:
        dt = getattr(torch, name)
        threshold = lowp.upcast_min_rows(dt)
        pack = lowp.packs(dt)
        print(
            f"{name}: lowp computes from float32 copies from {threshold or 'no'} rows on this CPU; "
            f"packs the weights: {'yes' if pack else 'no'}"
        )
        for rows in a.rows:
            t: dict[str, float | None] = {"float32": 0.0, "kernel": 0.0, "float32_copies": 0.0, "packed": 0.0}
            for k, n in SHAPES:
                x, w = torch.randn(rows, k), torch.randn(n, k) * 0.02
                xl, wl = x.to(dt), w.to(dt)
                t["float32"] += best_ms(lambda x=x, w=w: F.linear(x, w), a.repeats)
                t["kernel"] += best_ms(lambda xl=xl, wl=wl: F.linear(xl, wl), a.repeats)
                t["float32_copies"] += best_ms(
                    lambda xl=xl, wl=wl: F.linear(xl.float(), wl.float()).to(xl.dtype), a.repeats
                )
                packed = _packed_ms(xl, wl, a.repeats)
                t["packed"] = None if packed is None or t["packed"] is None else t["packed"] + packed
            xh, wh = torch.randn(rows, HEAD[0]).to(dt), (torch.randn(HEAD[1], HEAD[0]) * 0.02).to(dt)
            t["head_kernel"] = best_ms(lambda xh=xh, wh=wh: F.linear(xh, wh), a.repeats)
            t["head_packed"] = _packed_ms(xh, wh, a.repeats)
            chosen = "float32 copies" if threshold is not None and rows >= threshold else "kernel"
            if chosen == "kernel" and pack and t["packed"] is not None:
                chosen = "packed"
            head = "packed" if pack and t["head_packed"] is not None else "kernel"
            head = "float32 copies" if threshold is not None and rows >= threshold else head
            print(
                f"  rows {rows:4d}  float32 {t['float32']:7.2f} ms  {name} kernel {t['kernel']:7.2f} ms  "
                f"float32 copies {t['float32_copies']:7.2f} ms  "
                f"kernel/copies {_ratio(t['kernel'], t['float32_copies'])}  "
                f"packed/kernel {_ratio(t['packed'], t['kernel'])}  lowp: {chosen}  |  head: kernel "
                f"{t['head_kernel']:6.2f} ms  packed/kernel {_ratio(t['head_packed'], t['head_kernel'])}  "
                f"lowp: {head}"
            )
            results.append({"dtype": name, "rows": rows, **t, "lowp": chosen, "lowp_head": head})
    if a.out:
        a.out.write_text(json.dumps({"kind": "lowp_gemm", "machine": machine, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
