"""The fused head-and-loss (gpt2_port.model.fused.linear_cross_entropy, the fast kernels' training loss) forward and
backward over GPT-2's vocabulary: unpadded (50257 rows) and padded to multiples of 64 and 128 (50304 both), runs
interleaved in one process so the machine's noise hits each alike; the median of each and its speed against the
unpadded head. 64 and 128 pad GPT-2's vocabulary to the same 50304 rows: the spread between those two is the noise.
What `gpt2-port train --pad-vocab`'s default rests on. With --chunk-rows, the head padded to 64 again at each of
those rows per chunk (fused.chunk_rows picks the device's default: what GPU_CHUNK_BYTES rests on). With --compile,
the head padded to 64 under torch.compile too (fullgraph, inductor: the loss as `train --compile` runs it).

    python -m benchmarks.head_padding [--device cpu] [--dtype float32|bf16] [--rows 512] [--width 768] [--rounds 8]
                                      [--chunk-rows 256,1024,...] [--compile] [--json PATH]

Not a test: the numbers depend on the machine and its load (say so when quoting them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from benchmarks.arguments import positive_ints
from benchmarks.gpu import machine, sync
from gpt2_port.devices import parse_device
from gpt2_port.files import check_writable, write_output
from gpt2_port.model.fused import chunk_rows, linear_cross_entropy, padded_vocab

MULTIPLES = (1, 64, 128)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.head_padding", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", choices=("float32", "bf16"), default="float32", help="bf16: under bf16 autocast")
    p.add_argument("--rows", type=int, default=512, help="tokens per call (default 512)")
    p.add_argument("--width", type=int, default=768, help="n_embd (default 768, 124M's)")
    p.add_argument("--vocab", type=int, default=50257, help="the vocabulary (default GPT-2's 50257)")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds after one warm-up round (default 8)")
    p.add_argument(
        "--chunk-rows", type=positive_ints, default=[], metavar="N,N,...", help="also time these chunk sizes"
    )
    p.add_argument("--compile", action="store_true", help="also time the head padded to 64 under torch.compile")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p


def run(a: argparse.Namespace) -> dict:
    dev = parse_device(a.device)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.rows, a.width, generator=g).to(dev).requires_grad_(True)
    w = (torch.randn(a.vocab, a.width, generator=g) * 0.02).to(dev).requires_grad_(True)
    t = torch.randint(0, a.vocab, (a.rows,), generator=g).to(dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if a.dtype == "bf16" else contextlib.nullcontext()
    # (multiple, rows per chunk or None for the device's default, compiled), timed in turn each round
    configs = [(m, None, False) for m in MULTIPLES] + [(64, c, False) for c in a.chunk_rows]
    configs += [(64, None, True)] if a.compile else []
    fns = {False: linear_cross_entropy, True: torch.compile(linear_cross_entropy, fullgraph=True)}
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    losses: dict[tuple, float] = {}
    for r in range(a.rounds + 1):  # round 0 warms up (and compiles)
        for m, c, compiled in configs if r % 2 == 0 else configs[::-1]:
            sync(dev)
            t0 = time.perf_counter()
            with amp:
                loss = fns[compiled](h, w, None, t, pad_multiple=m, chunk=c)
            loss.backward()
            sync(dev)
            if r:
                times[m, c, compiled].append(time.perf_counter() - t0)
            h.grad = w.grad = None
            losses[m, c, compiled] = float(loss.detach())  # after the timing: its one sync is not timed
        print(f"round {r}/{a.rounds}", file=sys.stderr)

    def row(m: int, c: int | None, base: float, speed: str, compiled: bool = False) -> dict:
        med = statistics.median(times[m, c, compiled])
        vocab = padded_vocab(a.vocab, m)
        return {
            "vocab": vocab,
            "chunk_rows": c or chunk_rows(dev.type, vocab),
            "median_s": med,
            "runs_s": times[m, c, compiled],
            speed: base / med,
            "loss": losses[m, c, compiled],
        }

    unpadded, default64 = statistics.median(times[1, None, False]), statistics.median(times[64, None, False])
    rows = {str(m): row(m, None, unpadded, "speed_vs_unpadded") for m in MULTIPLES}
    chunks = {str(c): row(64, c, default64, "speed_vs_default_chunks") for c in a.chunk_rows}
    compiled = row(64, None, default64, "speed_vs_eager", True) if a.compile else None
    settings = {k: getattr(a, k) for k in ("dtype", "rows", "width", "vocab", "rounds", "chunk_rows", "compile")}
    return {
        "kind": "head_padding",
        "machine": machine(dev),
        "settings": settings,
        "multiples": rows,
        "chunks": chunks,
        "compiled": compiled,
    }


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.json:
        check_writable(a.json, "--json")
    res = run(a)
    print(f"fused head-and-loss, {a.rows} x {a.width} -> {a.vocab}, {a.dtype}, on {res['machine']['device_name']}:")
    for m, x in res["multiples"].items():
        print(
            f"  pad to a multiple of {m:>3}: {x['vocab']} rows, {1e3 * x['median_s']:9.2f} ms "
            f"({x['speed_vs_unpadded']:.3f}x the unpadded head; {x['chunk_rows']} rows per chunk), "
            f"loss {x['loss']:.6f}"
        )
    for c, x in res["chunks"].items():
        print(
            f"  padded to 64, {c:>5} rows per chunk: {1e3 * x['median_s']:9.2f} ms "
            f"({x['speed_vs_default_chunks']:.3f}x the default chunks), loss {x['loss']:.6f}"
        )
    if (x := res["compiled"]) is not None:
        print(
            f"  padded to 64, torch.compile:    {1e3 * x['median_s']:9.2f} ms "
            f"({x['speed_vs_eager']:.3f}x eager), loss {x['loss']:.6f}"
        )
    if a.json:
        write_output(a.json, json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
