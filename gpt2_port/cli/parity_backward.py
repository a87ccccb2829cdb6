"""`gpt2-port parity MODEL --backward [--train-steps N]`: options checked, the run (gpt2_port_checks.backward), its
outputs."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Callable

from ..errors import UsageError
from .common import human_stream
from .parity_io import gate_line, read_inputs, scratch_errors, scratch_header, with_scratch, write_outputs


def train_config(args: argparse.Namespace):  # -> gpt2_port_checks.steps.TrainConfig
    """The AdamW steps' settings: the flags given, TrainConfig's defaults for the others."""
    from gpt2_port_checks.steps import TrainConfig

    d = TrainConfig()
    steps = getattr(args, "train_steps", None)
    if steps is not None and steps <= 0:
        raise UsageError(f"--train-steps must be a positive number of AdamW steps, got {steps}")
    lr = d.lr if args.lr is None else args.lr
    wd = d.weight_decay if args.weight_decay is None else args.weight_decay
    clip = d.clip if args.clip is None else args.clip
    for opt, v, ok in (("--lr", lr, lr > 0), ("--weight-decay", wd, wd >= 0), ("--clip", clip, clip > 0)):
        if not (math.isfinite(v) and ok):
            raise UsageError(f"{opt} must be a finite number {'>= 0' if opt == '--weight-decay' else '> 0'}, got {v}")
    return TrainConfig(steps=steps or 0, lr=lr, weight_decay=wd, clip=clip)


def run(args: argparse.Namespace, outs: list[tuple[str, str]], transform: Callable | None = None) -> int:
    """`outs`: the (option, path) outputs, already checked by the parity command ('-' is stdout); `transform`: the
    --scratch function."""
    from gpt2_port_checks import backward_report as render
    from gpt2_port_checks.backward import run_backward

    for opt, on in (
        ("--detail sublayer", getattr(args, "detail", "block") != "block"),
        ("--per-head", getattr(args, "per_head", False)),
        ("--logit-lens", getattr(args, "logit_lens", False)),
    ):
        if on:
            raise UsageError(f"{opt} is a forward-report option: not with --backward/--train-steps")
    tc = train_config(args)
    inputs = read_inputs(args)
    t_start = time.perf_counter()

    def log(msg: str) -> None:  # phases on stderr, only on a terminal
        if sys.stderr.isatty():
            print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr)

    with scratch_errors(args.scratch):
        sweep = run_backward(
            args.model,
            inputs,
            dtypes=args.dtype,
            devices=args.device,
            reference_attn=args.reference_attn,
            attn=args.attn,
            kernels=args.kernels or "reference",
            noise_floor=args.noise_floor,
            train=tc,
            revision=args.revision,
            tokenizer=args.tokenizer,
            log=log,
            transform=transform,
        )
    human = human_stream(*(p for _, p in outs))
    width = shutil.get_terminal_size().columns if human.isatty() else None
    human.write(scratch_header(args.scratch) + render.render_text(sweep, terminal_width=width))
    human.write(gate_line(sweep, args.fail_above_noise))
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
    write_outputs(
        outs,
        human,
        json_text=lambda: json.dumps(with_scratch(sweep.to_json(), args.scratch), indent=2) + "\n",
        markdown_text=lambda: render.render_markdown(sweep),
        plot=lambda path: render.plot_gradients(sweep, path),
    )
    return sweep.exit_code(args.fail_above_noise)
