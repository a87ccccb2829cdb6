"""`gpt2-port attention MODEL TEXT --layer L [--head H] --png PATH [--compare]`: the scratch model's attention
weights as heatmaps, queries and keys labelled by their tokens. --compare also draws |scratch - transformers|."""

from __future__ import annotations

import argparse
import functools
import importlib.util

from .common import (
    add_device_arg,
    add_model_arg,
    add_revision_arg,
    add_tokenizer_arg,
    checkpoint_inputs,
    count,
    human_stream,
    tokenizer_inputs,
)

OOM_HINT = "a shorter TEXT or --device cpu"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "attention",
        help="draw the scratch model's attention weights as heatmaps (PNG)",
        description="Run TEXT through the scratch model and draw the attention probabilities of one "
        "layer (all heads, or one with --head) as heatmaps with the tokens on both axes. --compare "
        "also draws the absolute difference from transformers' attention probabilities. Needs "
        "matplotlib (pip install 'gpt2-port[plot]'); --compare needs transformers "
        "(pip install 'gpt2-port[check]').",
    )
    add_model_arg(p)
    p.add_argument("text", metavar="TEXT", help="the text to run")
    p.add_argument("--layer", type=int, required=True, help="block index, 0-based (negative counts from the end)")
    p.add_argument(
        "--head", type=int, default=None, help="one head, 0-based, negative from the end (default: every head)"
    )
    p.add_argument("--png", metavar="PATH", required=True, help="where to write the PNG (- for stdout)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="also draw |scratch - transformers| of the attention probabilities (needs transformers)",
    )
    p.add_argument("--dtype", default="float32", help="float32 (default), float16 or bfloat16")
    add_device_arg(p)
    add_revision_arg(p)
    add_tokenizer_arg(p)
    p.set_defaults(func=run, oom_hint=OOM_HINT)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..devices import parse_device, parse_dtype
    from ..errors import UsageError
    from ..files import check_writable
    from ..io.load import read_checkpoint
    from ..io.tokenizer import load_tokenizer, tokenizer_for
    from ..model import from_pretrained
    from ..plots import require_matplotlib

    check_writable(args.png, "--png", checkpoint_inputs(args.model) + tokenizer_inputs(args.tokenizer))
    require_matplotlib("--png")
    if args.compare:
        if importlib.util.find_spec("transformers") is None:  # checked here, imported in checks/ only
            raise UsageError("--compare needs transformers: pip install 'gpt2-port[check]'")
    from gpt2_port_checks import attention_maps

    dt, dev = parse_dtype(args.dtype), parse_device(args.device)
    tok = load_tokenizer(args.tokenizer, strict=True) if args.tokenizer is not None else None
    cfg = read_checkpoint(args.model, args.revision)[1].config  # memory-mapped: --layer/--head before the load
    layer = args.layer + cfg.n_layer if args.layer < 0 else args.layer
    if not 0 <= layer < cfg.n_layer:
        raise UsageError(f"--layer {args.layer}: the model has {cfg.n_layer} layers (0..{cfg.n_layer - 1})")
    head = args.head + cfg.n_head if args.head is not None and args.head < 0 else args.head
    if head is not None and not 0 <= head < cfg.n_head:
        raise UsageError(f"--head {args.head}: the model has {cfg.n_head} heads (0..{cfg.n_head - 1})")
    args.head = head
    model, rep = from_pretrained(args.model, dtype=dt, device=dev, revision=args.revision)
    if tok is None:
        tok = tokenizer_for(rep.checkpoint.root)
    ids = tok.encode(args.text)
    if not ids:
        raise UsageError("TEXT encodes to no tokens")
    if len(ids) > cfg.n_positions:
        raise UsageError(f"TEXT is {len(ids)} tokens, more than the context of {cfg.n_positions}")
    top = max(ids)
    if top >= cfg.vocab_size:  # checked here, on the host: on a GPU the forward does not read the ids back
        raise UsageError(
            f"TEXT: token id {top} is out of range for the model's vocabulary of {cfg.vocab_size} "
            "(a tokenizer for another vocabulary? --tokenizer)"
        )
    x = torch.tensor([ids], device=dev)
    model.set_attn_impl("manual")  # transformers' eager arithmetic in every layer, so --compare is like for like
    name = f"block.{layer}.attn.probs"
    with torch.inference_mode(), model.record([name]) as acts:
        model(x)
    probs = acts[name][0].float().cpu()  # (nh, T, T)
    heads = list(range(cfg.n_head)) if args.head is None else [args.head]
    diff = None
    if args.compare:
        ref = attention_maps.reference_probs(args.model, args.revision, cfg, x, layer, dt, dev).float().cpu()
        diff = (probs - ref).abs()  # (nh, T, T)
    pieces = [tok.decode([i]) for i in ids]
    title = f"{args.model}: layer {layer}, {count(len(ids), 'token')}, {str(dt).removeprefix('torch.')}"
    if diff is not None:
        title += f"; max |scratch - transformers (eager)| {float(diff[heads].max()):.2e}"
    try:
        attention_maps.draw(probs, pieces, layer, heads, args.png, title, diff)
    except OSError as e:  # the early check passed, yet the write failed (a full disk, /dev/full)
        raise UsageError(f"--png {args.png}: cannot write ({e.strerror or e})") from None
    say = functools.partial(print, file=human_stream(args.png))
    say(
        f"wrote {'stdout' if args.png == '-' else args.png}: layer {layer}, "
        f"{'head ' + str(args.head) if args.head is not None else 'all heads'}, "
        f"{count(len(ids), 'token')}"
    )
    if diff is not None:
        for h in heads:
            say(f"  head {h:>2}: max |scratch - transformers| {float(diff[h].max()):.3e}")
    return 0
