"""Greedy decode speed of one checkpoint in several dtypes, in one process, runs interleaved.

    python scripts/decode_dtypes.py MODEL_DIR [--dtypes float32,float16,bfloat16] [--new-tokens 128]
        [--prompt-len 16] [--rounds 9]

Loads the checkpoint once per dtype (`from_pretrained(..., dtype=D)`, on the CPU) and times, round after round, in
alternating order, `generate_full` greedy for each dtype with the fast greedy head where that dtype has one, and
without it (`fast_head=False`: the head's exact logits every step). Reports the median decode tok/s of each (the
first round is a warm-up), its ratio to the first dtype's with the fast head, the head each used, and whether the
fast and exact runs of a dtype gave the same tokens. Ratios between dtypes measured this way share the machine's
state; the benchmark's low-precision rows run after its float32 rows. A tool of the checkout: the package never
imports it.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from gpt2_port.generate.loop import generate_full
from gpt2_port.model import from_pretrained


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="checkpoint directory (e.g. one written by `gpt2-port demo-checkpoint`)")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in names if d not in ("float32", "float16", "bfloat16")]
    if bad or not names or args.rounds < 2:
        msg = f"--dtypes: expected float32, float16 or bfloat16 and --rounds >= 2, got {args.dtypes!r}, {args.rounds}"
        print(msg, file=sys.stderr)
        return 2
    models = {d: from_pretrained(args.model, dtype=getattr(torch, d))[0] for d in names}
    prompt = torch.randint(0, 50257, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    tasks = [(d, fast) for d in names for fast in (True, False)]
    rates: dict[tuple[str, bool], list[float]] = {}
    tokens: dict[tuple[str, bool], list] = {}
    heads: dict[tuple[str, bool], str | None] = {}
    for r in range(args.rounds):
        for d, fast in tasks if r % 2 == 0 else reversed(tasks):
            g = generate_full(models[d], prompt, args.new_tokens, eos_token_id=None, fast_head=fast)
            rates.setdefault((d, fast), []).append(g.decode_tok_per_s)
            tokens[(d, fast)], heads[(d, fast)] = g.sequences.tolist(), g.extra["fast_head_kind"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds (first a warm-up)")
    ref = statistics.median(rates[(names[0], True)][1:])
    print(f"{'dtype':<9} {'head':<15} {'tok/s':>7} {'min-max':>13} {'vs ' + names[0]:>11}  same tokens as exact")
    for d, fast in tasks:
        v = rates[(d, fast)][1:]
        m = statistics.median(v)
        same = "" if not fast else str(tokens[(d, True)] == tokens[(d, False)])
        head = heads[(d, fast)] or "exact logits"
        print(f"{d:<9} {head:<15} {m:7.1f} {min(v):6.1f}-{max(v):<6.1f} {m / ref:10.3f}x  {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
