"""`gpt2-port`: one console command with subcommands. The only place that prints (the library logs).

Exit codes: 0 success, 1 a check failed (parity), 2 bad input (usage, arguments, files), 3 internal error.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from ..errors import DeviceMemoryError, GPT2PortError

# Each module defines register(subparsers) and sets `func` on its parser; kept in the order `--help` shows them.
COMMAND_MODULES = [
    "gpt2_port.cli.generate",
    "gpt2_port.cli.parity",
    "gpt2_port.cli.attention",
    "gpt2_port.cli.inspect",
    "gpt2_port.cli.demo",
    "gpt2_port.cli.prepare",
    "gpt2_port.cli.train",
    "gpt2_port.cli.eval",
]


class StderrHandler(logging.StreamHandler):
    """A log handler that writes to whatever sys.stderr is when a record comes (a caller that calls `main` more than
    once may have swapped it in between), not the stream of the first call."""

    @property
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


class ArgParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line ("gpt2-port parity: error: ...") and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def build_parser() -> ArgParser:
    from .. import __version__

    p = ArgParser(
        prog="gpt2-port",
        description="A from-scratch GPT-2 that loads the official weights, proves "
        "layer by layer that it matches Hugging Face transformers, and generates text.",
    )
    p.add_argument("--version", action="version", version=f"gpt2-port {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the library does (to stderr)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgParser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        handlers=[StderrHandler()],
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:
        from ..devices import memory_error

        bad_input = isinstance(e, GPT2PortError) and not isinstance(e, DeviceMemoryError)
        if os.environ.get("GPT2_PORT_DEBUG") and not bad_input:  # the traceback asked for (bad input: its one line)
            raise
        if isinstance(e, GPT2PortError):
            return _error(args, e)
        mem = memory_error(e)  # the device ran out of memory: what to change, not a bug
        if mem is not None:
            return _error(args, mem)
        distributed = sys.modules.get("gpt2_port.train.distributed")  # imported by a command that may join a group
        if distributed is not None and distributed.peer_failed(e):  # another process stopped: its line says why
            return _error(args, GPT2PortError(distributed.PEER_FAILED))
        sys.stderr.write(
            f"gpt2-port {args.command}: internal error: {e.__class__.__name__}: {e} -- this is a bug; "
            f"please report it (rerun with GPT2_PORT_DEBUG=1 for the traceback)\n"
        )
        return 3


def _error(args: argparse.Namespace, e: GPT2PortError) -> int:
    """One line on stderr, exit 2; running out of device memory adds the command's hint (`oom_hint`) on what to
    change."""
    msg = " ".join(str(e).split("\n"))
    if isinstance(e, DeviceMemoryError) and getattr(args, "oom_hint", None):
        msg += f": {args.oom_hint}"
    sys.stderr.write(f"gpt2-port {args.command}: error: {msg}\n")
    return 2


def run() -> None:
    code = main()
    distributed = sys.modules.get("gpt2_port.train.distributed")  # imported by a command that may join a group
    if distributed is not None and distributed.joined():
        # A torchrun worker leaves without the interpreter's and C++'s exit-time teardown once its work is written
        # and its process group destroyed: there gloo's threads aborted the process now and then after a finished
        # run ("terminate called without an active exception", SIGABRT: about 1 run in 150 on 2 CPU processes),
        # and torchrun then reports the whole run failed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
