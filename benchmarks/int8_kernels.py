"""Which int8 matmul is fastest for batch-1 decode on this CPU? (How gpt2_port.generate.int8's kernel was chosen.)

One pass over the 72 block Linears of gpt2 (124M) with one token, for each candidate: float32 F.linear, bfloat16
F.linear, torch's weight-only `_weight_int8pack_mm`, `torch._int_mm` (int8 x int8, per-token activation scale),
and fbgemm's dynamic int8 linear (`torch.ops.quantized.linear_dynamic`, one and two passes as in Int8Linear).
Also the relative error of each int8 path against float32.

    python -m benchmarks.int8_kernels [--layers 12] [--width 768] [--repeats 5]
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.timing import best_ms
from gpt2_port.generate.int8 import Int8Linear, quantize_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.int8_kernels")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    C = a.width
    shapes = [(C, C)] * 4 + [(4 * C, C), (C, 4 * C)]  # q, k, v, c_proj, c_fc, mlp c_proj: (out, in)
    ws = [torch.randn(n, k) * 0.02 for _ in range(a.layers) for n, k in shapes]
    xs = {k: torch.randn(1, k) for k in (C, 4 * C)}
    qs = [quantize_rows(w) for w in ws]
    q_t = [q.t().contiguous() for q, _ in qs]  # (in, out) for _int_mm
    lin2 = [Int8Linear(w, None) for w in ws]
    lin1 = [Int8Linear(w, None, exact_activations=False) for w in ws]
    wb = [w.bfloat16() for w in ws]
    xb = {k: v.bfloat16() for k, v in xs.items()}

    def int_mm(x: torch.Tensor, wt: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        sa = x.abs().amax(-1, keepdim=True) / 127
        xi = (x / sa).round().to(torch.int8)
        return torch._int_mm(xi, wt).float() * sa * s

    cands: dict[str, Callable[[], list[torch.Tensor]]] = {
        "float32 F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in ws],
        "bfloat16 F.linear": lambda: [F.linear(xb[w.shape[1]], w) for w in wb],
        "fbgemm dynamic, 1 pass (int8-fast)": lambda: [m(xs[m.in_features]) for m in lin1],
        "fbgemm dynamic, 2 passes (int8)": lambda: [m(xs[m.in_features]) for m in lin2],
        "_weight_int8pack_mm": lambda: [torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s) for q, s in qs],
        "torch._int_mm": lambda: [int_mm(xs[wt.shape[0]], wt, s) for wt, (_, s) in zip(q_t, qs)],
    }
    ref = cands["float32 F.linear"]()
    mb = sum(w.numel() for w in ws) * 4 / 1e6
    print(
        f"{a.layers} layers x 6 Linears, width {C}: {mb:.0f} MB of float32 weights; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}"
    )
    for name, fn in cands.items():
        try:
            ms = best_ms(fn, a.repeats)
            out = fn()
            err = max(float((o.float() - r).norm() / r.norm()) for o, r in zip(out, ref))
            print(f"  {name:<36} {ms:9.1f} ms/pass  {mb / ms:6.1f} GB/s of float32 weights  max rel err {err:.1e}")
        except (RuntimeError, NotImplementedError) as e:
            print(f"  {name:<36} unavailable: {str(e).splitlines()[0][:80]}")
    # The weight layout matters for batch-1 float32: (out, in) contiguous, like the tied head, against (in, out)
    # contiguous, like the Conv1D weights the adapter maps as transposed views.
    w_oi = [torch.randn(4 * C, C) for _ in range(a.layers * 4)]
    w_io = [w.t().contiguous() for w in w_oi]
    gb = sum(w.numel() for w in w_oi) * 4 / 1e9
    x = xs[C]
    for name, mats in (("(out, in) contiguous", w_oi), ("(in, out) contiguous, .T view", [w.T for w in w_io])):
        ms = best_ms(lambda mats=mats: [F.linear(x, w) for w in mats], a.repeats)
        print(f"  float32 F.linear, weights {name:<30} {gb * 1e3 / ms:6.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
