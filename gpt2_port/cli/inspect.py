"""`gpt2-port inspect MODEL`: config, tensors, parameters, bytes, the key mapping and dropped buffers.

No forward pass."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

from .common import add_model_arg, add_revision_arg, checkpoint_inputs, human_stream, report_written


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a checkpoint's config, tensors, key mapping and dropped buffers",
        description="Read a checkpoint (directory, .safetensors file, or Hub id) and show its config, "
        "tensor count, parameters and bytes, how each tensor maps onto the scratch model, and the "
        "buffers dropped, without running the model.",
    )
    add_model_arg(p)
    add_revision_arg(p)
    p.add_argument(
        "--check-finite",
        action="store_true",
        help="scan every tensor and name any holding NaN or Inf (then exit 2, writing no --json)",
    )
    p.add_argument("--all-keys", action="store_true", help="list the mapping of every layer, not just layer 0")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON (- for stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..files import check_writable, write_output
    from ..io.load import listed, nonfinite_tensors, read_checkpoint

    if args.json:
        check_writable(args.json, "--json", checkpoint_inputs(args.model))
    sd, rep = read_checkpoint(args.model, args.revision)
    say = functools.partial(print, file=human_stream(args.json))  # `--json -`: the JSON alone on stdout, for a pipe
    cfg, conv = rep.config, rep.conversion
    n_params = sum(t.numel() for t in conv.state.values())
    dtypes = sorted({str(sd[k].dtype).removeprefix("torch.") for k in sd})
    say(f"checkpoint  {rep.checkpoint.source}")
    say(f"  root      {rep.checkpoint.root}")
    say(f"  files     {', '.join(f.name for f in rep.checkpoint.weight_files)} ({rep.checkpoint.fmt})")
    say(
        "  config    "
        + (rep.checkpoint.config_file.name if rep.checkpoint.config_file else "inferred from tensor shapes")
    )
    tok_files = rep.checkpoint.tokenizer_files()
    say(
        f"  tokenizer {' + '.join(f.name for f in tok_files)}"
        if tok_files
        else "  tokenizer none in the checkpoint (commands use the GPT-2 BPE shipped with gpt2-port)"
    )
    say("config")
    for f in dataclasses.fields(cfg):
        say(f"  {f.name:<20}{getattr(cfg, f.name)}")
    say(f"tensors     {len(sd)} in the file(s), {len(conv.state)} in the scratch model, {len(conv.dropped)} dropped")
    say(f"parameters  {n_params:,} ({'head tied to wte' if cfg.tie_word_embeddings else 'separate lm_head'})")
    say(f"bytes       {rep.file_bytes:,} of tensor data ({', '.join(dtypes)})")
    say("key mapping (HF layout -> scratch)" + ("" if args.all_keys else ": top level and layer 0; every layer alike"))
    for src, op, dst in conv.mapping:
        parts = src.removeprefix("transformer.").split(".")
        if not args.all_keys and parts[0] == "h" and parts[1] != "0":
            continue
        say(f"  {src:<36} {op:<17} -> {', '.join(dst)}")
    if conv.dropped:
        names = (
            conv.dropped if args.all_keys or len(conv.dropped) <= 4 else conv.dropped[:2] + ["..."] + conv.dropped[-1:]
        )
        say(f"dropped     {len(conv.dropped)} buffer(s), checked: {', '.join(names)}")
    for n in conv.notes:
        say(f"note        {n}")
    bad: list[str] | None = None
    if args.check_finite:
        bad = nonfinite_tensors(dict(sd))
        say(f"finite      {'all tensors finite' if not bad else 'NaN/Inf in: ' + ', '.join(bad)}")
    if bad:  # bad weights are bad input: exit 2 and write no report file, like every other input error
        from ..errors import CheckpointError

        raise CheckpointError(
            f"{rep.checkpoint.source}: NaN/Inf in {len(bad)} tensor(s): {listed(bad)} (expected finite "
            "weights; the file is corrupt or the fine-tune diverged)"
        )
    if args.json:
        out = {
            "model": rep.checkpoint.source,
            "root": str(rep.checkpoint.root),
            "files": [str(f) for f in rep.checkpoint.weight_files],
            "format": rep.checkpoint.fmt,
            "tokenizer_files": [str(f) for f in tok_files] if tok_files else None,
            "config": dataclasses.asdict(cfg),
            "tensors": len(sd),
            "parameters": n_params,
            "bytes": rep.file_bytes,
            "mapping": [{"source": s, "op": o, "targets": list(d)} for s, o, d in conv.mapping],
            "dropped": conv.dropped,
            "nonfinite": bad,
        }
        report_written([write_output(args.json, json.dumps(out, indent=2) + "\n", "--json")])
    return 0
