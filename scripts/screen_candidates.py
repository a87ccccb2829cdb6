"""How many tokens the screened greedy head leaves to its exact dot products, on a checkpoint's own hidden states.

    python scripts/screen_candidates.py MODEL_DIR [--dtypes float32,float16] [--prompts 4] [--prompt-len 16]

Runs random prompts (seeded) through the model in each dtype, takes every position's final hidden state, and
reports for `ScreenedHead` (generate/greedy_head.py) the median, 90th percentile and largest number of candidates
the screen leaves, and how many states it declines (no candidate set, too many, or a lead it cannot prove). Needs
oneDNN's packed bf16 kernel (AVX512-BF16 or AMX). A tool of the checkout: the package never imports it.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from gpt2_port.generate.greedy_head import ScreenedHead
from gpt2_port.model import from_pretrained


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="checkpoint directory (e.g. one written by `gpt2-port demo-checkpoint`)")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    args = ap.parse_args()
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not names or any(d not in ("float32", "float16") for d in names) or args.prompts < 1 or args.prompt_len < 1:
        print(f"expected --dtypes of float32/float16 and positive counts, got {args.dtypes!r}", file=sys.stderr)
        return 2
    if not ScreenedHead.available():
        print("ScreenedHead needs oneDNN's packed bf16 kernel (AVX512-BF16 or AMX); this CPU has none", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50257, (1, args.prompt_len), generator=g) for _ in range(args.prompts)]
    for name in names:
        model, _ = from_pretrained(args.model, dtype=getattr(torch, name))
        head = ScreenedHead(model.head_weight)
        with torch.no_grad():
            states = torch.cat([model(ids, hidden_only=True)[0] for ids in prompts])  # (prompts x T, C)
        counts, declined = [], 0
        for row in states:
            s, bounds, hns = head.screen(row[None])
            idx = head.candidates(s[0], bounds[0], hns[0])
            counts.append(-1 if idx is None else idx.numel())
            declined += head.argmax(row[None]) is None
        counts.sort()
        p90 = counts[min(len(counts) - 1, int(0.9 * len(counts)))]
        print(
            f"{name}: {len(counts)} states, candidates median {statistics.median(counts):g}, 90th percentile {p90}, "
            f"max {counts[-1]}; declined {declined}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
