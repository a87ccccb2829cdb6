"""Arguments several subcommands share, defined once so their spelling and help stay the same everywhere."""

from __future__ import annotations

import argparse


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="checkpoint directory, .safetensors file, or Hub id (gpt2, ...)")


def add_revision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")


def add_tokenizer_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="directory with vocab.json + merges.txt, or encoder.json + vocab.bpe (default: the checkpoint's, "
        "else the GPT-2 BPE shipped with gpt2-port; never the network)",
    )


def count(n: int, noun: str) -> str:
    """'1 token', '2 tokens': a count with its noun in the right number."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def add_device_arg(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    more = "; a comma-separated list (cpu,cuda) sweeps them" if sweep else ""
    p.add_argument(
        "--device", default="auto", help=f"auto (default: cuda, else mps, else cpu), cpu, cuda, cuda:N or mps{more}"
    )


def add_progress_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"{what} on stderr: redrawn on a terminal, a plain line every 10 s otherwise (on)",
    )


def report_written(written: list[str], stderr: bool = False) -> None:
    """Say which files a command wrote ("wrote PATH"), at its end. On stderr when asked, or when an output went to
    stdout (`-`), so that a JSON or Markdown stream on stdout stays clean."""
    import sys

    stream = sys.stderr if stderr or "stdout" in written else sys.stdout
    for w in written:
        if w != "stdout":
            print(f"wrote {w}", file=stream)
