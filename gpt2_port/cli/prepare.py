"""`gpt2-port prepare TEXT_FILE... --out DIR`: encode a text corpus into nanoGPT's train.bin/val.bin + meta.json."""

from __future__ import annotations

import argparse
import sys
import time

from ..config import GPT2Config
from .common import SPLIT_FILES, add_progress_arg, count, file_input, tokenizer_inputs

GPT2_CONTEXT = GPT2Config.n_positions  # every official size's: a split shorter than one window trains nothing

EPILOG = """\
output: DIR/train.bin and DIR/val.bin hold GPT-2 token ids as little-endian uint16 with no header (nanoGPT's format:
np.memmap(path, dtype=np.uint16, mode="r") reads them); DIR/meta.json holds the token counts, each source with its
sha256 and size, the split, and the tokenizer. Files are written to hidden temporary files and renamed into place at
the end: on an error or Ctrl-C nothing half-written is left.

split: one file is cut at int(n * (1 - val_fraction)) of its n characters and the two parts are encoded apart, as
nanoGPT's data/shakespeare/prepare.py does. Several files are documents: the last round(n * val_fraction) of them, in
the order given, go to val.bin, and documents are separated by <|endoftext|> (50256). A split that would be empty is
an error. Text is encoded with encode_ordinary: "<|endoftext|>" written in a file is ordinary text.

memory: the corpus is streamed (1 MiB reads, pieces of about 256k characters cut only where the BPE's pre-tokenizer
cannot join across the cut, so the ids equal encoding the whole text), so a multi-GB corpus needs no more memory than
a small one. A first pass hashes each file and checks that it is UTF-8 before anything is encoded.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="encode text files into nanoGPT's train.bin/val.bin (uint16 GPT-2 ids) + meta.json",
        description="Encode one or more UTF-8 text files with the GPT-2 BPE into train.bin and val.bin "
        "(little-endian uint16, no header) and meta.json, streamed, for `gpt2-port train`, nanoGPT or llm.c tools.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="+", metavar="TEXT_FILE", help="UTF-8 text file(s); several files are documents")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        metavar="F",
        help="share of the corpus for val.bin, in (0, 1) (default 0.1: nanoGPT's 90/10 split)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="directory with vocab.json + merges.txt (or encoder.json + vocab.bpe); default: gpt2_port's GPT-2 BPE",
    )
    add_progress_arg(p, "bytes scanned and encoded")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..files import check_dir_outputs
    from ..io.tokenizer import load_tokenizer
    from ..train.prepare import check_val_fraction, prepare, tokenizer_files
    from .progress import Phases, size_text

    check_val_fraction(args.val_fraction)
    inputs = [i for f in args.files for i in file_input(f, "TEXT_FILE")] + tokenizer_inputs(args.tokenizer)
    check_dir_outputs(args.out, "--out", inputs, SPLIT_FILES)
    if args.tokenizer is not None and not tokenizer_files(args.tokenizer):
        raise UsageError(
            f"--tokenizer {args.tokenizer}: no vocab.json + merges.txt (or encoder.json + vocab.bpe) there"
        )
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer)
    bar = Phases("B") if args.progress else None
    try:
        meta = prepare(
            args.files,
            args.out,
            tokenizer,
            val_fraction=args.val_fraction,
            tokenizer_dir=args.tokenizer,
            progress=bar.update if bar else None,
        )
    except BaseException:
        if bar and bar.current:
            bar.current.abandon()
        raise
    if bar:
        bar.close()
    seconds = time.perf_counter() - t0
    n_bytes = sum(s["bytes"] for s in meta["sources"])
    split = meta["split"]
    how = (
        f"split at character {split['train_chars']:,}"
        if split["rule"] == "characters"
        else f"{split['train_documents']} train / {split['val_documents']} val documents"
    )
    print(
        f"wrote {args.out}/train.bin ({meta['train_tokens']:,} tokens), val.bin ({meta['val_tokens']:,} tokens) "
        f"and meta.json from {count(len(meta['sources']), 'file')}, {size_text(n_bytes)} ({how}) in {seconds:.1f}s"
    )
    for split in ("train", "val"):  # train refuses a split shorter than one window: said now, not at its start
        n = meta[f"{split}_tokens"]
        if n <= GPT2_CONTEXT:
            fixes = [f"train with --block-size {n - 1} or less"] if n > 1 else []
            fixes += ["without validation (remove val.bin)"] if split == "val" else []
            fixes.append("or prepare more text")
            sys.stderr.write(
                f"note: {split}.bin holds {count(n, 'token')}, fewer than the {GPT2_CONTEXT + 1:,} train's default "
                f"window needs (GPT-2's {GPT2_CONTEXT}-token context + 1): {', '.join(fixes)}\n"
            )
    return 0
