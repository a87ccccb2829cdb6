"""`gpt2-port bench`: speed and memory against transformers (the benchmark lives in benchmarks/, beside the package)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def _benchmarks():  # noqa: ANN202
    """Import benchmarks.bench lazily: it needs transformers and lives in the source checkout, not in the wheel."""
    from ..errors import UsageError

    if importlib.util.find_spec("transformers") is None:  # checked, never imported here: the library stays free of it
        raise UsageError("the benchmark needs transformers, which is not installed: pip install 'gpt2-port[check]'")
    repo = Path(__file__).resolve().parents[2]
    if (repo / "benchmarks" / "bench.py").is_file() and str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    try:
        from benchmarks import bench
    except ImportError as e:
        raise UsageError(
            f"the benchmark lives in benchmarks/ of a source checkout, which was not found ({e})"
        ) from None
    return bench


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark load, prefill and decode against transformers",
        description="On random-weight checkpoints in the official layout (written once under "
        "--weights-dir): time to a ready model and peak RSS (one fresh process per load, cold and warm "
        "page cache), prefill latency and greedy decode tok/s, side by side with transformers, plus "
        "the int8/bfloat16/float16 options with their parity. Writes JSON (--out) and a Markdown section "
        "(--markdown). Needs transformers (pip install 'gpt2-port[check]').",
    )
    # the options are defined beside the benchmark itself; register them without importing transformers
    repo = Path(__file__).resolve().parents[2]
    if str(repo) not in sys.path and (repo / "benchmarks").is_dir():
        sys.path.insert(0, str(repo))
    try:
        from benchmarks.bench import add_arguments
    except ImportError:
        p.set_defaults(func=lambda args: _benchmarks().main(args))
        return
    add_arguments(p)
    p.set_defaults(func=lambda args: _benchmarks().main(args))
