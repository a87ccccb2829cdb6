"""The parity command's inputs (prompts as text or token ids) and outputs (JSON, Markdown, PNG), shared by its
forward (parity.py) and backward (parity_backward.py) runs."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from ..errors import GPT2PortError, UsageError
from ..files import STDOUT, write_output
from .common import check_outputs, checkpoint_inputs, file_input, tokenizer_inputs


def _read_text(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else f"not UTF-8 text: {e}"
        raise UsageError(f"{what} {path}: cannot read ({why})") from None


def read_inputs(args: argparse.Namespace):  # -> gpt2_port_checks.prompts.Inputs (imported lazily)
    """The prompts in the order given: --prompt, --prompt-file, --ids, --ids-file; the defaults when none."""
    from gpt2_port_checks.prompts import Inputs, default_inputs, parse_ids

    inputs = Inputs([], [])
    for p in args.prompt or []:
        if not p:
            raise UsageError("--prompt: empty prompt (give at least one character)")
        inputs.add_text(p)
    if args.prompt_file:
        lines = [ln for ln in _read_text(args.prompt_file, "--prompt-file").splitlines() if ln.strip()]
        if not lines:
            raise UsageError(f"--prompt-file {args.prompt_file}: no non-empty lines")
        for ln in lines:
            inputs.add_text(ln)
    for s in args.ids or []:
        inputs.add_ids(parse_ids(s, f"--ids {s!r}"))
    if args.ids_file:
        lines = _read_text(args.ids_file, "--ids-file").splitlines()
        n = 0
        for k, ln in enumerate(lines, 1):
            if ln.strip():
                inputs.add_ids(parse_ids(ln, f"--ids-file {args.ids_file} line {k}"))
                n += 1
        if not n:
            raise UsageError(f"--ids-file {args.ids_file}: no non-empty lines")
    return inputs if inputs.texts else default_inputs()


def _inputs(args: argparse.Namespace) -> list:
    """Every file the run reads (files.Inputs), to keep the outputs off them."""
    return (
        checkpoint_inputs(args.model)
        + tokenizer_inputs(args.tokenizer)
        + file_input(args.prompt_file, "--prompt-file")
        + file_input(args.ids_file, "--ids-file")
    )


def checked_outputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(option, path) of every output asked for, checked before any work (a --tokenizer DIR's files too): '-'
    (stdout) for at most one of --json/--markdown, never for the PNG; no two outputs in one file; none on an input;
    every file path writable."""
    if args.tokenizer is not None:
        from ..io.tokenizer import check_tokenizer_dir

        check_tokenizer_dir(args.tokenizer)
    outs = [(o, p) for o, p in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)) if p]
    check_outputs(outs, _inputs(args), images=("--plot",))
    return outs


def write_outputs(
    outs: list[tuple[str, str]],
    human: TextIO,
    json_text: Callable[[], str],
    markdown_text: Callable[[], str],
    plot: Callable[[str], None],
) -> None:
    """Write each asked-for output ('-': stdout; files atomically), then one `wrote PATH (kind)` line per file."""
    wrote = []
    for opt, path in outs:
        if opt == "--plot":
            try:
                plot(path)
            except OSError as e:  # the early check passed, yet the write failed (a full disk, /dev/full)
                raise UsageError(f"--plot {path}: cannot write ({e.strerror or e})") from None
        else:
            text = json_text() if opt == "--json" else markdown_text()
            if write_output(path, text, opt) == STDOUT:
                continue
        wrote.append(f"wrote {path} ({opt.removeprefix('--')})")
    if wrote:
        human.write("\n".join(wrote) + "\n")


def scratch_transform(spec: str | None) -> Callable | None:
    """--scratch MODULE:FUNCTION (an importable module: installed, on PYTHONPATH, or the current directory under
    `python -m gpt2_port`) or FILE.py:FUNCTION (the file run as a module of its own) -> the function, imported now,
    before any work; None without the option."""
    if spec is None:
        return None
    import importlib
    import importlib.util
    import sys

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise UsageError(f"--scratch {spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION (e.g. my_change.py:patch)")
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise UsageError(f"--scratch {spec}: no file {where}")
            unique = f"gpt2_port_scratch_{Path(where).stem}"  # registered first: dataclasses and pickling look it up
            found = importlib.util.spec_from_file_location(unique, where)
            module = importlib.util.module_from_spec(found)  # type: ignore[arg-type]
            sys.modules[unique] = module
            found.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(where)
    except UsageError:
        raise
    except ModuleNotFoundError as e:
        if e.name is not None and (where == e.name or where.startswith(e.name + ".")):
            raise UsageError(
                f"--scratch {spec}: no module {where!r} installed or on PYTHONPATH (or give its FILE.py)"
            ) from None
        raise UsageError(f"--scratch {spec}: importing {where} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 (the user's code: any error it raises is theirs to read)
        raise UsageError(f"--scratch {spec}: importing {where} failed: {e.__class__.__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"--scratch {spec}: {where} has no function {name!r}")
    return fn


@contextlib.contextmanager
def scratch_errors(spec: str | None) -> Iterator[None]:
    """An error the run raises with a --scratch change in place names the change (it may be the change's code, or
    gpt2_port's meeting it), not gpt2_port alone as a bug; out of memory and gpt2_port's own errors stay as they are."""
    try:
        yield
    except GPT2PortError:
        raise
    except Exception as e:
        from ..devices import out_of_memory

        if spec is None or out_of_memory(e):
            raise
        raise UsageError(
            f"with --scratch {spec}: {e.__class__.__name__}: {e} (in the change's code, or in gpt2_port's meeting it: "
            "the same run without --scratch tells which)"
        ) from e


def scratch_header(spec: str | None) -> str:
    """The line that says a report is of a --scratch change (the terminal; the JSON carries `scratch`)."""
    return (
        f"scratch change: {spec} (applied to gpt2_port's model; transformers runs the checkpoint as it is)\n"
        if spec
        else ""
    )


def with_scratch(report: dict, spec: str | None) -> dict:
    return {**report, "scratch": spec} if spec else report


def gate_line(sweep, fail_above_noise: bool) -> str:  # noqa: ANN001 (a forward or backward sweep)
    """The verdict --fail-above-noise adds where every figure passed but one lies above the reference's noise."""
    where = sweep.noise_failure() if fail_above_noise and sweep.passed else None
    return f"FAIL (--fail-above-noise): in {where} lies above the reference's own noise\n" if where else ""
