"""`gpt2-port demo-checkpoint`: write a random-weight checkpoint in the exact official layout."""

from __future__ import annotations

import argparse
import sys
import time

from ..config import PRESETS
from .common import WEIGHT_FILES, check_holds_no_checkpoint, check_seed

# Files that say a directory holds a checkpoint or a training run: random weights must not replace them
CHECKPOINT_MARKERS = (*WEIGHT_FILES, "config.json", "trainer_state.json")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo-checkpoint",
        help="write a random-weight GPT-2 checkpoint in the official layout",
        description="Write config.json + model.safetensors (un-prefixed keys, causal-mask buffers, no "
        "lm_head, metadata format=pt) with random weights of any official size. Uses torch and "
        "safetensors only, so the whole tool runs with no network.",
    )
    p.add_argument("--size", default="gpt2", choices=list(PRESETS), help="which official size (default: gpt2, 124M)")
    p.add_argument("--out", default=None, help="output directory (default: weights/<size>-random)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--tokenizer-from",
        metavar="DIR",
        default=None,
        help="copy GPT-2's vocab.json + merges.txt (or encoder.json + vocab.bpe) from DIR, sha256-checked",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..files import check_dir_writable
    from ..io.demo import write_demo_checkpoint

    out = args.out if args.out is not None else f"weights/{args.size}-random"
    check_seed(args.seed)
    check_dir_writable(out, "--out")
    check_holds_no_checkpoint(out, CHECKPOINT_MARKERS, "random weights")
    t0 = time.perf_counter()
    try:
        d = write_demo_checkpoint(out, size=args.size, seed=args.seed, tokenizer_dir=args.tokenizer_from)
    except OSError as e:  # the early check passed, yet a write failed (a full disk): no partial file is left
        raise UsageError(f"--out {out}: cannot write the checkpoint ({e.strerror or e})") from None
    size = (d / "model.safetensors").stat().st_size
    print(
        f"wrote {d}/config.json and model.safetensors ({size / 1e6:.1f} MB, random weights, official layout) "
        f"in {time.perf_counter() - t0:.1f}s",
        file=sys.stdout,
    )
    if args.tokenizer_from:
        print(f"wrote {d}/vocab.json and merges.txt (GPT-2's tokenizer, sha256-checked)", file=sys.stdout)
    return 0
