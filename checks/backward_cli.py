"""`gpt2-port parity MODEL --backward [--train-steps N]`: options checked, the run, its outputs (checks/backward.py)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from gpt2_port.errors import UsageError
from gpt2_port.util import atomic_write_text, check_writable

from .backward import TrainConfig, run_backward
from .parity import read_prompts


def train_config(args: argparse.Namespace) -> TrainConfig:
    steps = getattr(args, "train_steps", None)
    if steps is not None and steps <= 0:
        raise UsageError(f"--train-steps must be a positive number of AdamW steps, got {steps}")
    for opt, v, ok in (
        ("--lr", args.lr, args.lr > 0),
        ("--weight-decay", args.weight_decay, args.weight_decay >= 0),
        ("--clip", args.clip, args.clip > 0),
    ):
        if not (math.isfinite(v) and ok):
            raise UsageError(f"{opt} must be a finite number {'>= 0' if opt == '--weight-decay' else '> 0'}, got {v}")
    return TrainConfig(steps=steps or 0, lr=args.lr, weight_decay=args.weight_decay, clip=args.clip)


def main(args: argparse.Namespace) -> int:
    for opt, on in (
        ("--detail sublayer", getattr(args, "detail", "block") != "block"),
        ("--per-head", getattr(args, "per_head", False)),
        ("--logit-lens", getattr(args, "logit_lens", False)),
    ):
        if on:
            raise UsageError(f"{opt} is a forward-report option: not with --backward/--train-steps")
    tc = train_config(args)
    markdown, plot = getattr(args, "markdown", None), getattr(args, "plot", None)
    for path, what in ((args.json, "--json"), (markdown, "--markdown"), (plot, "--plot")):
        if path:
            check_writable(path, what)
    if plot:
        from .plots import require_matplotlib

        require_matplotlib("--plot")
    prompts = read_prompts(args)
    floor = getattr(args, "noise_floor", None)
    t_start = time.perf_counter()

    def log(msg: str) -> None:  # phases on stderr, only on a terminal
        if sys.stderr.isatty():
            print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr)

    sweep = run_backward(
        args.model,
        prompts,
        dtypes=args.dtype,
        devices=args.device,
        reference_attn=args.reference_attn,
        attn=args.attn,
        noise_floor=True if floor is None else floor,
        train=tc,
        revision=args.revision,
        tokenizer=args.tokenizer,
        log=log,
    )
    from . import backward_report as render

    render.print_terminal(sweep)
    t = sweep.reports[0].timings
    print(
        f"transformers load {t['reference_load_s']:.2f}s backward {t['reference_backward_s']:.2f}s "
        f"floor {t['noise_floor_s']:.2f}s train {t['reference_train_s']:.2f}s; "
        + ", ".join(
            f"{r.label} load {r.timings['scratch_load_s']:.2f}s backward {r.timings['scratch_backward_s']:.2f}s "
            f"train {r.timings['scratch_train_s']:.2f}s"
            for r in sweep.reports
        ),
        file=sys.stderr,
    )
    if args.json:
        atomic_write_text(args.json, json.dumps(sweep.to_json(), indent=2) + "\n")
    if markdown:
        atomic_write_text(markdown, render.render_markdown(sweep))
    if plot:
        render.plot_gradients(sweep, plot)
    return 0 if sweep.passed else 1
