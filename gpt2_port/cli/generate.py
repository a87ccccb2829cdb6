"""`gpt2-port generate MODEL PROMPT`: stream text from a GPT-2 checkpoint (greedy or sampled)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ..generate.sampling import SamplingSettings
from .common import (
    add_device_arg,
    add_model_arg,
    add_progress_arg,
    add_revision_arg,
    add_tokenizer_arg,
    check_seed,
    checkpoint_inputs,
    count,
    report_written,
    tokenizer_inputs,
)

DEFAULT_TEMPERATURE = SamplingSettings.temperature  # transformers' defaults, as the Python API's
DEFAULT_TOP_K = SamplingSettings.top_k

EPILOG = """\
decoding: sampling by default (temperature 1.0, top-k 50, top-p 1.0); --greedy picks the most likely token each step
and cannot be combined with --temperature/--top-k/--top-p. The same --seed gives the same text.

context: GPT-2 sees at most 1024 tokens (n_positions). A longer prompt is an error. When prompt + --max-new-tokens would
pass the context, generation stops there, exactly, with a message on stderr (the window never slides).

output: the prompt and the new text stream to stdout as tokens arrive (with --num-samples N, sample 1 streams and the
others print when the batch is done); generation ends at <|endoftext|>, at a --stop string (kept in the text), or after
--max-new-tokens. Load time, prefill time, decode tokens/s and peak memory go to stderr.
"""


OOM_HINT = "fewer rows (--num-samples, fewer prompts), a smaller --max-new-tokens or --dtype bfloat16"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a GPT-2 checkpoint, streamed as it comes",
        description="Load MODEL into the scratch GPT-2 and continue PROMPT, streaming the text. Greedy "
        "decoding gives the same tokens as transformers' generate(do_sample=False).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(p)
    p.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=50, metavar="N", help="new tokens per sample (default 50)")
    p.add_argument(
        "--min-new-tokens",
        type=int,
        default=0,
        metavar="N",
        help="no <|endoftext|> before N new tokens (transformers' min_new_tokens; default 0)",
    )
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (deterministic)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help=f"sampling temperature > 0 (default {DEFAULT_TEMPERATURE})",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help=f"sample among the K most likely tokens; 0 turns it off (default {DEFAULT_TOP_K})",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="nucleus sampling: the fewest tokens whose probability reaches P, in (0, 1] (default 1: off)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="> 1 makes tokens already in the text less likely (default 1.0: off)",
    )
    p.add_argument("--seed", type=int, default=None, metavar="S", help="random seed: the same seed, the same output")
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="samples of the prompt, as one batch")
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STR",
        help="stop a sample when its new text contains STR (repeatable)",
    )
    add_device_arg(p)
    p.add_argument(
        "--no-cuda-graph",
        action="store_true",
        help="on CUDA, run the fixed-shape decode step eagerly instead of replaying it as a captured CUDA graph",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the fixed-shape decode step (inductor: each block's elementwise work fused into a few "
        "kernels) before it is recorded as a CUDA graph; the compile takes tens of seconds once per batch and length, "
        "not counted in decode tok/s; the same tokens, other roundings",
    )
    p.add_argument(
        "--op-for-op",
        action="store_true",
        help="on CUDA, the fixed-shape decode step with the forward's (and transformers') ops: the GELU's eight ops, "
        "each residual add apart from the layer norm after it, and the cache write apart from SDPA, instead of "
        "torch's one tanh-GELU kernel (in bf16/fp16 in c_fc's matmul), one Triton kernel for each add and its norm "
        "and one for each block's cache write and attention (the same function, rounded otherwise; 11 fewer "
        "kernels a block at batch 1)",
    )
    p.add_argument(
        "--dtype", default="float32", help="float32 (default), float16, bfloat16, or int8 (same as --quantize int8)"
    )
    p.add_argument(
        "--quantize",
        choices=["int8"],
        default=None,
        help="int8: int8 decode on CPU (per-row int8 weights of every block Linear and the head, activations "
        "quantized per call with a second pass over their residual, so as accurate as weight-only int8; "
        "LayerNorm, attention and the KV cache stay float32); loads float32, then quantizes",
    )
    add_revision_arg(p)
    add_tokenizer_arg(p)
    add_progress_arg(p, "new tokens (shown when the text does not stream to this terminal)")
    p.add_argument("--no-memory-check", action="store_true", help="start even if the memory estimate says it won't fit")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (slow; for checks)")
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="write prompt_ids, generated_ids, texts and the timings as JSON (- for stdout, after the text)",
    )
    p.set_defaults(func=run, oom_hint=OOM_HINT)


def sampling_from_args(args: argparse.Namespace) -> dict:
    """The generate() keyword arguments the flags ask for; UsageError on contradictions or values out of range."""
    from ..errors import UsageError
    from ..generate import SamplingSettings

    if args.greedy:
        given = [
            f
            for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k), ("--top-p", args.top_p))
            if v is not None
        ]
        if given:
            raise UsageError(f"--greedy cannot be combined with {', '.join(given)} (those are sampling options)")
    for flag, v in (("--temperature", args.temperature), ("--repetition-penalty", args.repetition_penalty)):
        if v is not None and not math.isfinite(v):  # inf would pass a "> 0" check and flatten every distribution
            raise UsageError(f"{flag} must be a finite number > 0, got {v}")
    s = SamplingSettings(
        do_sample=not args.greedy,
        temperature=DEFAULT_TEMPERATURE if args.temperature is None else args.temperature,
        top_k=DEFAULT_TOP_K if args.top_k is None else args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
    )
    try:
        s.validate()
    except UsageError as e:  # name the flag rather than the keyword argument
        msg = str(e)
        for kw, flag in (
            ("temperature", "--temperature"),
            ("top_k", "--top-k"),
            ("top_p", "--top-p"),
            ("repetition_penalty", "--repetition-penalty"),
        ):
            if msg.startswith(kw + " "):
                msg = flag + msg[len(kw) :]
                break
        raise UsageError(msg) from None
    if args.greedy:
        return {"do_sample": False, "repetition_penalty": s.repetition_penalty}
    return {
        "do_sample": True,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "repetition_penalty": s.repetition_penalty,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from ..devices import parse_device, parse_dtype, peak_rss_mb
    from ..errors import UsageError
    from ..files import check_writable, write_output
    from ..generate import generate_full
    from ..generate.memory import check_decode_memory
    from ..io.tokenizer import load_tokenizer, tokenizer_for
    from ..model import from_pretrained
    from .progress import Progress

    # every argument is checked before the (slow) load
    if not args.prompt:
        raise UsageError("PROMPT is empty: expected some text to continue")
    if args.max_new_tokens <= 0:
        raise UsageError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    if args.min_new_tokens < 0:
        raise UsageError(f"--min-new-tokens must be >= 0, got {args.min_new_tokens}")
    if args.num_samples <= 0:
        raise UsageError(f"--num-samples must be a positive integer, got {args.num_samples}")
    if args.stop is not None and any(not s for s in args.stop):
        raise UsageError("--stop needs a non-empty string")
    check_seed(args.seed)
    sampling = sampling_from_args(args)
    quantize, given = args.quantize, args.dtype  # as typed, for the message
    if str(args.dtype).lower() == "int8":
        quantize, args.dtype = "int8", "float32"
    try:
        dtype = parse_dtype(args.dtype)
    except UsageError:
        raise UsageError(f"--dtype {given!r}: expected float32, float16, bfloat16 or int8") from None
    auto = str(args.device).lower() == "auto"
    device = parse_device("cpu" if quantize and auto else args.device)  # int8 runs on the CPU
    if quantize and device.type != "cpu":
        raise UsageError(f"--device {args.device}: int8 runs on the CPU (--device cpu, or leave --device out)")
    if quantize and dtype != torch.float32:
        raise UsageError(f"--dtype {given}: --quantize int8 quantizes float32 weights (leave --dtype out)")
    if args.json:
        check_writable(args.json, "--json", checkpoint_inputs(args.model) + tokenizer_inputs(args.tokenizer))
    tok = load_tokenizer(args.tokenizer, strict=True) if args.tokenizer is not None else None

    model, report = from_pretrained(args.model, dtype=dtype, device=device, revision=args.revision)
    if quantize:
        from ..generate.int8 import quantize_int8

        quantize_int8(model)
    if tok is None:
        tok = tokenizer_for(report.checkpoint.root)
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        raise UsageError("PROMPT encodes to no tokens: expected some text to continue")
    n_ctx = model.config.n_positions
    if len(prompt_ids) >= n_ctx:
        raise UsageError(
            f"PROMPT is {len(prompt_ids)} tokens; the model's context is {n_ctx} tokens, so it must be at "
            f"most {n_ctx - 1} tokens"
        )
    if not args.no_memory_check:
        check_decode_memory(model, args.num_samples, len(prompt_ids), args.max_new_tokens, sampling, not args.no_cache)

    n = args.num_samples
    out = sys.stdout
    shown = False

    def show_prompt() -> None:  # with the first new text: a run that fails before it (NaN weights) prints nothing
        nonlocal shown
        if not shown:
            shown = True
            out.write((f"=== sample 1/{n} ===\n" if n > 1 else "") + args.prompt)

    def on_text(row: int, text: str) -> None:
        if row == 0:
            show_prompt()
            out.write(text)
            out.flush()

    # the streamed text is the progress on a terminal; redirected (or into a log), a bar of new tokens on stderr
    streams_here = sys.stdout.isatty() and sys.stderr.isatty()
    bar = Progress("generate", args.max_new_tokens * n, "tokens") if args.progress and not streams_here else None
    try:
        g = generate_full(
            model,
            torch.tensor([prompt_ids]),
            args.max_new_tokens,
            seed=args.seed,
            num_return_sequences=n,
            min_new_tokens=args.min_new_tokens,
            stop_strings=args.stop,
            tokenizer=tok,
            on_text=on_text,
            use_cache=not args.no_cache,
            cuda_graph=not args.no_cuda_graph,
            compile_step=args.compile,
            fused_kernels=False if args.op_for_op else None,
            progress=bar.update if bar is not None else None,
            **sampling,
        )
    except BaseException:
        if bar is not None:
            bar.abandon()
        raise
    if bar is not None:
        bar.close()
    texts = g.texts or []
    show_prompt()
    out.write("\n")
    for i in range(1, n):
        out.write(f"=== sample {i + 1}/{n} ===\n{args.prompt}{texts[i]}\n")
    out.flush()

    rss = peak_rss_mb()
    made = sum(len(r) for r in g.new_ids)
    err = sys.stderr
    if g.context_limited:
        err.write(
            f"stopped at the context limit: the prompt is {count(len(prompt_ids), 'token')} and the model sees at "
            f"most {n_ctx}, so {n_ctx - len(prompt_ids)} of the {count(args.max_new_tokens, 'new token')} asked for "
            "were made\n"
        )
    peak_dev = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    memory = f"peak RSS {rss:.0f} MB" + (f", peak {device} {peak_dev:.0f} MB" if peak_dev is not None else "")
    samples = f" in {n} samples" if n > 1 else ""
    if g.capture_s > 0:
        graph, compiled = g.extra["step"].startswith("cuda graph"), g.extra["step"].endswith("(compiled)")
        what = "step compiled" if compiled else "CUDA graph recorded"
        what += " and recorded as a CUDA graph" if compiled and graph else ""
        samples += f"; {what} in {g.capture_s * 1000:.0f} ms, not counted"
    err.write(
        f"load {report.load_s:.2f}s | prefill {g.prefill_s * 1000:.0f} ms ({count(len(prompt_ids), 'token')}) | "
        f"decode {g.decode_tok_per_s:.1f} tok/s ({count(made, 'new token')}{samples}, step: {g.extra['step']}) | "
        f"{memory} | {device} {quantize or str(dtype).removeprefix('torch.')}\n"
    )
    if args.json:
        data = {
            "prompt_ids": prompt_ids,
            "generated_ids": g.new_ids,
            "texts": texts,
            "load_s": report.load_s,
            "prefill_s": g.prefill_s,
            "decode_tok_per_s": g.decode_tok_per_s,
            "cuda_graph_capture_s": g.capture_s,
            "peak_rss_mb": rss,
            "peak_device_mb": peak_dev,
            "decode_step": g.extra["step"],
            "fused_kernels": g.extra["fused_kernels"],
            "stop_reasons": g.stop_reasons,
            "model": args.model,
            "device": str(device),
            "dtype": quantize or str(dtype).removeprefix("torch."),
            "seed": args.seed,
            "max_new_tokens": args.max_new_tokens,
            **sampling,
        }
        report_written([write_output(args.json, json.dumps(data, indent=2) + "\n", "--json")], stderr=True)
    return 0
