"""`gpt2-port parity MODEL`: the per-layer parity report against transformers (the checker is gpt2_port_checks,
the checkout's checks/ directory)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys

from ..errors import UsageError
from . import parity_backward
from .common import add_device_arg, add_model_arg, add_revision_arg, add_tokenizer_arg, human_stream
from .parity_io import (
    checked_outputs,
    gate_line,
    read_inputs,
    scratch_errors,
    scratch_header,
    scratch_transform,
    with_scratch,
    write_outputs,
)

OOM_HINT = "fewer or shorter prompts (--prompt, --prompt-file), --no-noise-floor, another --device or a smaller model"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "parity",
        help="per-layer parity report against Hugging Face transformers",
        description="Load MODEL into the scratch model and into transformers' GPT2LMHeadModel, run both "
        "on the same tokens (each prompt alone, then all of them as one left-padded batch with a long row: the "
        "batch. rows), and compare the embeddings, every block's output, ln_f and the logits; then generate's cached "
        "decoding, tokens fed, against transformers' with its cache (decode.logits). "
        "The default prompts are stored as token ids: no tokenizer files and no network needed. "
        "Exit 0 on pass, 1 on a parity failure (with --fail-above-noise also a figure above the noise), 2 on a "
        "usage or input error, 3 on an internal error. Needs "
        "transformers "
        "(pip install 'gpt2-port[check]').",
    )
    add_model_arg(p)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable); replaces the defaults")
    p.add_argument("--prompt-file", default=None, help="a UTF-8 file with one prompt per non-empty line")
    p.add_argument(
        "--ids",
        action="append",
        default=None,
        metavar="IDS",
        help='one prompt as token ids, e.g. --ids "464 2444 4721" (repeatable; spaces or commas); needs no '
        "tokenizer; replaces the defaults",
    )
    p.add_argument(
        "--ids-file", default=None, metavar="PATH", help="a file with one prompt per non-empty line, as token ids"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="float32 (default), float16 or bfloat16; a comma-separated list (float32,bfloat16,float16) "
        "sweeps them, each compared with one float32 transformers reference",
    )
    add_device_arg(p, sweep=True)
    p.add_argument(
        "--reference-attn",
        default="eager",
        choices=["eager", "sdpa"],
        help="transformers' attention implementation (default eager)",
    )
    p.add_argument(
        "--attn",
        default="auto",
        choices=["auto", "sdpa", "manual"],
        help="the scratch model's attention path: auto (default) runs the same kind of kernel as the "
        "reference (manual against eager, sdpa against sdpa); sdpa or manual force one",
    )
    p.add_argument(
        "--scratch",
        default=None,
        metavar="MODULE:FUNCTION",
        help="your change to check: a function given each configuration's GPT2 right after the load that changes it "
        "in place or returns another GPT2 (the checker's settings then apply); MODULE importable, or a FILE.py",
    )
    add_revision_arg(p)
    add_tokenizer_arg(p)
    p.add_argument(
        "--detail",
        default="block",
        choices=["block", "sublayer"],
        help="block (default): embeddings, block outputs, ln_f, logits; sublayer: also ln_1, q/k/v, the "
        "attention output before and after c_proj, the residual after attention, ln_2, the MLP hidden "
        "after GELU and the MLP output in every block",
    )
    p.add_argument("--per-head", action="store_true", help="also compare q, k and v head by head (implies sublayer)")
    p.add_argument(
        "--noise-floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure transformers against itself (eager vs sdpa; in a sweep, itself in each dtype) "
        "and mark every figure within or above that floor (default: on; one more transformers forward on the "
        "reference already loaded, and in a sweep a copy of it per other dtype or device)",
    )
    p.add_argument(
        "--fail-above-noise",
        action="store_true",
        help="exit 1 also when a figure passes its tolerance but lies above the reference's own noise (for CI: "
        "the port adds error of its own); needs the noise floor",
    )
    p.add_argument(
        "--logit-lens",
        action="store_true",
        help="per layer, the top-1 token of ln_f(h) @ wte.T for both models, and whether they agree",
    )
    p.add_argument(
        "--only-failures",
        action="store_true",
        help="show only the failing rows of each table (terminal and Markdown; the JSON keeps every point)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON ('-': stdout)")
    p.add_argument("--markdown", metavar="PATH", default=None, help="write the report as Markdown ('-': stdout)")
    p.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="write a PNG of error per layer (log scale, noise floor as a band, the tolerances used as dashed "
        "lines); needs matplotlib: pip install 'gpt2-port[plot]'",
    )
    g = p.add_argument_group("backward parity (gradients and optimizer steps)")
    g.add_argument(
        "--backward",
        action="store_true",
        help="compare the loss, every parameter's gradient (transformers' layout) and the gradients at embed, "
        "each block, ln_f and the logits, grouped by layer, beside transformers' own eager-vs-sdpa gradient noise "
        "(dropout off on both sides; a float32 reference)",
    )
    g.add_argument(
        "--train-steps",
        type=int,
        default=None,
        metavar="N",
        help="also take N AdamW steps on both models (the prompts as the batch each step; implies --backward) "
        "and report each step's two losses and the weights after the last step",
    )
    g.add_argument(
        "--kernels",
        choices=["reference", "fast"],
        default=None,
        help="the scratch model's training kernels: reference (default: transformers' arithmetic op for op) or fast "
        "(what `gpt2-port train --kernels fast` runs: one-kernel GELU, the head fused with the loss)",
    )
    g.add_argument("--lr", type=float, default=None, help="AdamW learning rate for --train-steps (default 1e-4)")
    g.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="AdamW weight decay on the 2+-dim weights for --train-steps (default 0.1; biases and LayerNorm none)",
    )
    g.add_argument(
        "--clip",
        type=float,
        default=None,
        help="gradient clipping (clip_grad_norm_) for --train-steps (default 1.0)",
    )
    p.set_defaults(func=run, oom_hint=OOM_HINT)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("transformers") is None:  # checked here; imported in gpt2_port_checks only
        raise UsageError(
            "the parity checker needs transformers, which is not installed: pip install 'gpt2-port[check]'"
        )
    from gpt2_port_checks import render
    from gpt2_port_checks.forward import run_detailed

    outs = checked_outputs(args)
    if args.plot:
        from ..plots import require_matplotlib

        require_matplotlib("--plot")
    if args.kernels is not None and not (args.backward or args.train_steps is not None):
        raise UsageError("--kernels chooses the training kernels: it needs --backward or --train-steps")
    optimizer_flags = (("--lr", args.lr), ("--weight-decay", args.weight_decay), ("--clip", args.clip))
    given = [f for f, v in optimizer_flags if v is not None]
    if given and args.train_steps is None:
        raise UsageError(f"{', '.join(given)} set the AdamW steps: it needs --train-steps N (no step is taken without)")
    if args.fail_above_noise and not args.noise_floor:
        raise UsageError("--fail-above-noise judges figures against the noise floor: not with --no-noise-floor")
    transform = scratch_transform(args.scratch)
    if args.backward or args.train_steps is not None:
        return parity_backward.run(args, outs, transform)
    inputs = read_inputs(args)
    detail = "sublayer" if args.per_head else args.detail
    with scratch_errors(args.scratch):
        sweep = run_detailed(
            args.model,
            inputs,
            dtypes=args.dtype,
            devices=args.device,
            detail=detail,
            per_head=args.per_head,
            noise_floor=args.noise_floor,
            logit_lens=args.logit_lens,
            reference_attn=args.reference_attn,
            attn=args.attn,
            revision=args.revision,
            tokenizer=args.tokenizer,
            transform=transform,
        )
    human = human_stream(*(p for _, p in outs))  # stderr when stdout carries the JSON or Markdown
    width = shutil.get_terminal_size().columns if human.isatty() else None
    human.write(scratch_header(args.scratch) + render.render_text(sweep, args.only_failures, width))
    human.write(gate_line(sweep, args.fail_above_noise))
    timing = ", ".join(
        f"{r.dtype}/{r.device} load {r.timings['scratch_load_s']:.2f}s forward "
        f"{r.timings['forward_s']:.2f}s floor {r.timings['noise_floor_s']:.2f}s"
        for r in sweep.reports
    )
    print(f"transformers load {sweep.reports[0].timings['reference_load_s']:.2f}s; {timing}", file=sys.stderr)
    from gpt2_port_checks.plots import plot_errors

    write_outputs(
        outs,
        human,
        json_text=lambda: json.dumps(with_scratch(sweep.to_json(), args.scratch), indent=2) + "\n",
        markdown_text=lambda: render.render_markdown(sweep, args.only_failures),
        plot=lambda path: plot_errors(sweep, path),
    )
    return sweep.exit_code(args.fail_above_noise)
