"""Arguments several subcommands share, defined once so their spelling and help stay the same everywhere."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TextIO

# The files a checkpoint directory holds besides its weights (shard indexes, config, tokenizer): what a load reads
CHECKPOINT_SIDE_FILES = (
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "config.json",
    "vocab.json",
    "merges.txt",
    "encoder.json",
    "vocab.bpe",
)
# Files that say a directory holds a checkpoint's weights already, which a command writing one there would replace
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


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


def human_stream(*outputs: str | None) -> TextIO:
    """Where a command's lines for people go: stdout, unless one of its outputs (a path, `-` for stdout) streams its
    JSON, Markdown or PNG there; then stderr, so that the stream on stdout stays clean."""
    import sys

    from ..files import STDOUT

    return sys.stderr if STDOUT in outputs else sys.stdout


def report_written(written: list[str], stderr: bool = False) -> None:
    """Say which files a command wrote ("wrote PATH"), at its end: on stderr when asked, else on `human_stream`."""
    import sys

    from ..files import STDOUT

    stream = sys.stderr if stderr else human_stream(*written)
    for w in written:
        if w != STDOUT:
            print(f"wrote {w}", file=stream)


def checkpoint_inputs(model: str | None, option: str = "MODEL") -> list[tuple[str, Path]]:
    """The files a local checkpoint MODEL is read from (weights, shard index, config.json, tokenizer files), each with
    a phrase naming it (files.Inputs), so that no output lands on them. None for a Hub id (its files live in the
    Hugging Face cache), and none for a path the load will reject: the load's own error says why."""
    from ..errors import GPT2PortError
    from ..io.checkpoint import locate

    if model is None or not os.path.lexists(model):
        return []
    try:
        ck = locate(model)
    except GPT2PortError:
        return []
    side = [ck.root / name for name in CHECKPOINT_SIDE_FILES]
    return [(f"a file of {option} {model} (an input)", f) for f in [*ck.weight_files, *side] if f.is_file()]


def tokenizer_inputs(directory: str | None, option: str = "--tokenizer") -> list[tuple[str, Path]]:
    """The tokenizer files a --tokenizer DIR is read from, each with a phrase naming it (files.Inputs)."""
    from ..io.tokenizer import find_files

    if directory is None:
        return []
    return [(f"a file of {option} {directory} (an input)", f) for f in find_files(directory) or ()]


def file_input(path: str | None, option: str) -> list[tuple[str, Path]]:
    """One input file named by an option (--text FILE, ...), with a phrase naming it (files.Inputs)."""
    return [] if path is None else [(f"the {option} input {path}", Path(path))]


SPLIT_FILES = ("train.bin", "val.bin", "meta.json")  # what `gpt2-port prepare` writes into its --out


def data_inputs(directory: str | None, option: str = "--data") -> list[tuple[str, Path]]:
    """The files of a prepared --data DIR, each with a phrase naming it (files.Inputs)."""
    if directory is None:
        return []
    return [(f"a file of {option} {directory} (an input)", Path(directory) / name) for name in SPLIT_FILES]


def check_input_file(path: str, option: str, expected: str) -> None:
    """UsageError unless `path` is a regular file: missing, a directory, or a device or pipe (read more than once,
    or nothing to read) each named as such."""
    from ..errors import UsageError

    p = Path(path)
    if p.is_file():
        return
    if p.is_dir():
        why = "is a directory"
    elif p.exists():
        why = "is not a regular file (a device or a pipe?)"
    else:
        why = "no such file"
    raise UsageError(f"{option} {path}: {why}; expected {expected}")


def check_holds_no_checkpoint(out: str | os.PathLike[str], names: tuple[str, ...], what: str) -> None:
    """UsageError when directory `out` holds one of `names` (files that say it holds a checkpoint or a run), which
    the command writing there would replace; `what`: what would replace it."""
    from ..errors import UsageError

    held = [name for name in names if (Path(out) / name).exists()]
    if held:
        raise UsageError(
            f"--out {out}: holds a checkpoint already ({held[0]}), which {what} would replace; choose another --out, "
            "or delete it first"
        )


def check_seed(seed: int | None, what: str = "--seed") -> None:
    """A seed in the range every command takes (train's: 0 <= seed < 2**63), or UsageError."""
    from ..errors import UsageError
    from ..train.args import SEED_LIMIT

    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise UsageError(f"{what} must be an integer in 0..{SEED_LIMIT - 1} (2**63 - 1), got {seed}")


def check_outputs(outs: list[tuple[str, str]], inputs: list, images: tuple[str, ...] = ()) -> None:
    """Every (option, path) output of a command, checked before any work: '-' (stdout) for at most one of them and
    never for an image option; no two in one file; none on one of `inputs` (files.Inputs); every file path
    writable."""
    from ..errors import UsageError
    from ..files import STDOUT, check_writable, same_file

    to_stdout = [o for o, p in outs if p == STDOUT]
    for o in to_stdout:
        if o in images:
            raise UsageError(f"{o} -: a PNG does not go to stdout; give a file path")
    if len(to_stdout) > 1:
        raise UsageError(f"{' and '.join(to_stdout)} both ask for stdout ('-'); give one of them a file path")
    files = [(o, p) for o, p in outs if p != STDOUT]
    for i, (o, p) in enumerate(files):
        for o2, p2 in files[:i]:
            if same_file(p, p2):
                raise UsageError(f"{o2} {p2} and {o} {p} are the same file; give each its own")
    for o, p in files:
        check_writable(p, o, inputs)
