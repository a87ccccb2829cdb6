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
        help="directory with vocab.json + merges.txt (default: the checkpoint's, else tiktoken's gpt2)",
    )
