"""`gpt2-port inspect MODEL`: config, tensors, parameters, bytes, the key mapping and dropped buffers. No forward pass."""

from __future__ import annotations

import argparse
import dataclasses
import json

from .common import add_model_arg, add_revision_arg


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
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..load import convert_checkpoint, nonfinite_tensors
    from ..util import atomic_write_text, check_writable

    if args.json:
        check_writable(args.json)
    sd, rep = convert_checkpoint(args.model, args.revision)
    cfg, conv = rep.config, rep.conversion
    n_params = sum(t.numel() for t in conv.state.values())
    dtypes = sorted({str(sd[k].dtype).removeprefix("torch.") for k in sd})
    print(f"checkpoint  {rep.checkpoint.source}")
    print(f"  root      {rep.checkpoint.root}")
    print(f"  files     {', '.join(f.name for f in rep.checkpoint.weight_files)} ({rep.checkpoint.fmt})")
    print(
        f"  config    {rep.checkpoint.config_file.name if rep.checkpoint.config_file else 'inferred from tensor shapes'}"
    )
    print("config")
    for f in dataclasses.fields(cfg):
        print(f"  {f.name:<20}{getattr(cfg, f.name)}")
    print(f"tensors     {len(sd)} in the file(s), {len(conv.state)} in the scratch model, {len(conv.dropped)} dropped")
    print(f"parameters  {n_params:,} ({'head tied to wte' if cfg.tie_word_embeddings else 'separate lm_head'})")
    print(f"bytes       {rep.file_bytes:,} of tensor data ({', '.join(dtypes)})")
    print(
        "key mapping (HF layout -> scratch)" + ("" if args.all_keys else ": top level and layer 0; every layer alike")
    )
    for src, op, dst in conv.mapping:
        parts = src.removeprefix("transformer.").split(".")
        if not args.all_keys and parts[0] == "h" and parts[1] != "0":
            continue
        print(f"  {src:<36} {op:<17} -> {', '.join(dst)}")
    if conv.dropped:
        names = (
            conv.dropped if args.all_keys or len(conv.dropped) <= 4 else conv.dropped[:2] + ["..."] + conv.dropped[-1:]
        )
        print(f"dropped     {len(conv.dropped)} buffer(s), checked: {', '.join(names)}")
    for n in conv.notes:
        print(f"note        {n}")
    bad: list[str] | None = None
    if args.check_finite:
        bad = nonfinite_tensors(dict(sd))
        print(f"finite      {'all tensors finite' if not bad else 'NaN/Inf in: ' + ', '.join(bad)}")
    if bad:  # bad weights are bad input: exit 2 and write no report file, like every other input error
        from ..errors import CheckpointError

        names = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise CheckpointError(
            f"{rep.checkpoint.source}: NaN/Inf in {len(bad)} tensor(s): {names} (expected finite "
            "weights; the file is corrupt or the fine-tune diverged)"
        )
    if args.json:
        out = {
            "model": rep.checkpoint.source,
            "root": str(rep.checkpoint.root),
            "files": [str(f) for f in rep.checkpoint.weight_files],
            "format": rep.checkpoint.fmt,
            "config": dataclasses.asdict(cfg),
            "tensors": len(sd),
            "parameters": n_params,
            "bytes": rep.file_bytes,
            "mapping": [{"source": s, "op": o, "targets": list(d)} for s, o, d in conv.mapping],
            "dropped": conv.dropped,
            "nonfinite": bad,
        }
        atomic_write_text(args.json, json.dumps(out, indent=2) + "\n")
    return 0
