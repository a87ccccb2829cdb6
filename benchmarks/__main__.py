"""`python -m benchmarks` (what `./dev bench` runs): the benchmark beside transformers, from a source checkout.

The options are benchmarks/bench.py's; errors of the project's own types end in one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpt2_port.errors import GPT2PortError

from .bench import add_arguments
from .bench import main as bench_main


def build_parser() -> argparse.ArgumentParser:
    from .bench import __doc__ as doc

    p = argparse.ArgumentParser(prog="python -m benchmarks", description=(doc or "").split("\n\n")[0])
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return bench_main(args)
    except GPT2PortError as e:
        print(f"python -m benchmarks: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
