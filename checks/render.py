"""The one renderer for every parity table: the block-level report, the sub-layer and per-head ones, the logit lens
and a sweep's summary are all `Table`s, written out the same way:

- on a terminal: rich tables with colour (rich is part of the `check` extra; plain text without it);
- anywhere else (a pipe, a file, a log): plain text, columns aligned with spaces, one line per row, never wrapped,
  no box-drawing characters;
- Markdown for `--markdown`.

`only_failures` keeps only the failing rows of each table and says how many passing rows it hid.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

from .noise import NOISE_MARGIN, Verdict, closeness
from .results import Report, Sweep, label

# What the `batch.` rows ran, after the batch's shape in the header
BATCH_NOTE = "the prompts left-padded, with a long row; attention_mask given (transformers: position_ids from it)"
DECODE_NOTE = (
    "generate's cached paths, tokens fed (decode.logits: its default step; decode.forward_steps.logits: the forward "
    "with the cache); transformers with its cache (for decode.logits: sdpa, the plan's kernel)"
)


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    bad: set[int] = field(default_factory=set)  # row indices that are failures
    notes: list[str] = field(default_factory=list)
    hidden: int = 0  # passing rows left out by only_failures

    def only_failures(self) -> Table:
        keep = sorted(self.bad)
        return Table(
            self.title,
            self.columns,
            [self.rows[i] for i in keep],
            set(range(len(keep))),
            self.notes,
            len(self.rows) - len(keep),
        )


def num(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.3e}"


def tol(x: float) -> str:
    """A tolerance as written in the table: 1e-06, or 2.50e-01 where one digit would round it."""
    short = f"{x:.0e}"
    return short if float(short) == x else f"{x:.2e}"


def ok(passed: bool) -> str:
    return "OK" if passed else "FAIL"


def _floor_text(r: Report) -> str:
    if r.reference_dtype == r.dtype and r.reference_device == r.device:
        alt = "sdpa" if "(eager)" in r.reference else "eager"
        return f"transformers' own {alt} kernel"
    return f"transformers itself in {r.dtype} on {r.device}"


def noise_summary(r: Report) -> str | None:
    """One sentence: is the port as close to the reference as transformers' own alternative is?"""
    if r.as_close_as_reference is None:
        return None
    ref = f"{r.reference.split('(')[-1].rstrip(')')} transformers ({r.reference_dtype}, {r.reference_device})"
    judged = [(p.name, p.norm_rel, Verdict(bool(p.within_noise), p.noise_ratio)) for p in r.points]
    return closeness(f"{label(r)}: as close to {ref} as {_floor_text(r)} is", judged, "point")


def _why(r: Report) -> str:
    ff = r.first_failure
    p = next((p for p in r.points if p.name == ff), None)
    if p is not None:
        return f"norm_rel {num(p.norm_rel)} > {tol(p.tolerance)}"
    if ff == "weights":
        return f"NaN/Inf in {len(r.nonfinite_weights)} weight tensor(s)"
    if ff == "top1_agreement":
        return f"top-1 agreement {100 * r.top1_agreement:.1f}% < {100 * r.top1_tolerance:.0f}%"
    return f"log-prob max abs diff {num(r.logprob_max_abs)} > {tol(r.logprob_tolerance)}"


def result_line(r: Report) -> str:
    if r.passed:
        worst = max(r.points, key=lambda p: p.norm_rel)
        return (
            f"{label(r)}: PASS, all {len(r.points)} points within {r.dtype} tolerances "
            f"(worst norm_rel {num(worst.norm_rel)} at {worst.name})"
        )
    return f"{label(r)}: FAIL, first diverging point {r.first_failure} ({_why(r)})"


def point_table(r: Report) -> Table:
    floor = r.noise_floor is not None
    cols = ["point", "max_abs", "norm_rel", "cosine", "elem_rel"]
    cols += ["noise floor", "vs floor"] if floor else []
    cols += ["tol", "result"]
    t = Table(
        f"{label(r)}: scratch ({r.scratch_attn} attention) vs {r.reference}, {r.reference_dtype}, {r.reference_device}",
        cols,
    )
    for i, p in enumerate(r.points):
        row = [p.name, num(p.max_abs), num(p.norm_rel), f"{p.cosine:.10f}", num(p.elementwise_rel)]
        if floor:
            row += [num(p.noise_norm_rel), p.noise_verdict or "-"]
        row += [f"{tol(p.tolerance)}", ok(p.passed)]
        t.rows.append(row)
        if not p.passed:
            t.bad.add(i)
    nonfinite = (
        f"; {r.nonfinite_logit_positions} of {r.n_tokens} positions have NaN/Inf logits"
        if r.nonfinite_logit_positions
        else ""
    )
    t.notes.append(
        f"top-1 next-token agreement {100 * r.top1_agreement:.1f}% (min {100 * r.top1_tolerance:.0f}%)  "
        f"{ok(r.top1_passed)}{nonfinite}"
    )
    t.notes.append(
        f"log-prob max abs diff {num(r.logprob_max_abs)} (tol {tol(r.logprob_tolerance)})  {ok(r.logprob_passed)}"
    )
    if floor:
        t.notes.append(f"noise floor: {r.noise_floor}; norm_rel within {NOISE_MARGIN:g}x of it counts as within")
    if r.nonfinite_weights:
        more = len(r.nonfinite_weights) - 8
        t.notes.append(
            f"NaN/Inf in weights: {', '.join(r.nonfinite_weights[:8])}" + (f" and {more} more" if more > 0 else "")
        )
    return t


def _token(text: str | None, tid: int) -> str:
    return repr(text) if text is not None else f"#{tid}"


def lens_table(r: Report) -> Table:
    t = Table(
        f"{label(r)}: logit lens, top-1 of ln_f(h) @ wte.T after each block (last token of the first prompt; "
        "agreement over all positions)",
        ["layer", "scratch top-1", "reference top-1", "same", "agree"],
    )
    for i, e in enumerate(r.logit_lens):
        same = e["scratch_id"] == e["reference_id"]
        t.rows.append(
            [
                str(e["layer"]),
                _token(e["scratch_top1"], e["scratch_id"]),
                _token(e["reference_top1"], e["reference_id"]),
                "yes" if same else "NO",
                f"{100 * e['agreement']:.1f}%",
            ]
        )
        if not same:
            t.bad.add(i)
    if r.logit_lens and r.logit_lens[0]["scratch_top1"] is None:
        t.notes.append("tokens shown as #id: no tokenizer files at hand (give --tokenizer DIR to see the text)")
    return t


def sweep_table(s: Sweep) -> Table:
    floor = s.reports[0].noise_floor is not None
    cols = ["config", "tolerance", "worst norm_rel", "first diverging", "top-1"]
    cols += ["first above noise", "as close as ref"] if floor else []
    cols += ["result"]
    t = Table(f"sweep: every configuration against {s.baseline}", cols)
    for i, r in enumerate(s.reports):
        worst = max(r.points, key=lambda p: p.norm_rel)
        gate = max(p.tolerance for p in r.points if p.name != "embed")
        row = [
            label(r),
            tol(gate),
            f"{num(worst.norm_rel)} ({worst.name})",
            r.first_failure or "none",
            f"{100 * r.top1_agreement:.1f}%",
        ]
        if floor:
            row += [r.first_above_noise or "none", "yes" if r.as_close_as_reference else "no"]
        row += ["PASS" if r.passed else "FAIL"]
        t.rows.append(row)
        if not r.passed:
            t.bad.add(i)
    return t


def tables(s: Sweep, only_failures: bool = False) -> list[Table]:
    out = []
    for r in s.reports:
        out.append(point_table(r))
        if r.logit_lens:
            out.append(lens_table(r))
    if s.is_sweep:
        out.append(sweep_table(s))
    return [t.only_failures() for t in out] if only_failures else out


def summary(s: Sweep) -> list[str]:
    """A result line per configuration, the noise verdicts, then the overall verdict (the last line)."""
    lines = [result_line(r) for r in s.reports]
    lines += [x for x in (noise_summary(r) for r in s.reports) if x]
    bad = s.first_failing
    if bad is None:
        n = sum(len(r.points) for r in s.reports)
        lines.append(f"PASS: all {n} points of {len(s.reports)} configuration(s) within tolerance")
    else:
        where = f" in {label(bad)}" if s.is_sweep else ""
        lines.append(f"FAIL: first failure{where} at {bad.first_failure} ({_why(bad)})")
    return lines


def header(s: Sweep) -> list[str]:
    r = s.reports[0]
    return (
        [
            f"parity  {s.model}  ({r.detail} detail)",
            f"  configurations  {', '.join(label(x) for x in s.reports)}",
            f"  reference       {s.baseline}" + (" (one float32 reference for all)" if s.is_sweep else ""),
            f"  inputs          {len(r.prompts)} prompt(s), {r.n_tokens} tokens",
        ]
        + ([f"  batch.* rows    {r.batch_shape}: {BATCH_NOTE}"] if r.batch_ids else [])
        + ([f"  decode.logits   {r.decode_shape}: {DECODE_NOTE}"] if r.decode_ids else [])
    )


def _hidden_note(t: Table) -> list[str]:
    if not t.hidden:
        return []
    return [f"({t.hidden} passing row(s) hidden by --only-failures)"]


def plain_document(head: list[str], tables_: list[Table], tail: list[str]) -> str:
    """Plain text for pipes and logs: aligned columns, no wrapping, no box-drawing characters."""
    out = list(head)
    for t in tables_:
        widths = [max([len(c)] + [len(row[j]) for row in t.rows]) for j, c in enumerate(t.columns)]
        out += ["", t.title]
        if t.rows:
            out.append(("  " + "  ".join(c.ljust(w) for c, w in zip(t.columns, widths))).rstrip())
        out += [("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths))).rstrip() for row in t.rows]
        out += [f"  {n}" for n in t.notes + _hidden_note(t)]
    return "\n".join(out + [""] + tail) + "\n"


def rich_document(head: list[str], tables_: list[Table], tail: list[str], width: int = 120) -> str:
    """The same tables through rich, with colour (ANSI escapes), for a terminal `width` columns wide."""
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable

    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=width, highlight=False, soft_wrap=True)
    for line in head:
        con.print(line, markup=False)
    for t in tables_:
        con.print()
        con.print(t.title, style="bold", markup=False)
        rt = RichTable(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for j, c in enumerate(t.columns):
            rt.add_column(c, justify="left" if j == 0 else "right", overflow="fold")
        for i, row in enumerate(t.rows):
            rt.add_row(*row, style="bold red" if i in t.bad else None)
        if t.rows:
            con.print(rt)
        for n in t.notes + _hidden_note(t):
            con.print(f"  {n}", style="red" if "FAIL" in n or "NaN" in n else None, markup=False)
    con.print()
    for line in tail:
        style = "green" if line.startswith("PASS") or ": PASS" in line or ": YES" in line else None
        style = "bold red" if "FAIL" in line or ": NO (" in line else style
        con.print(line, style=style, markup=False)
    return buf.getvalue()


def text_document(head: list[str], tables_: list[Table], tail: list[str], terminal_width: int | None = None) -> str:
    """rich when writing to a terminal (`terminal_width` given) and rich is installed; plain text otherwise."""
    if terminal_width is not None:
        try:
            return rich_document(head, tables_, tail, terminal_width)
        except ImportError:
            pass
    return plain_document(head, tables_, tail)


def render_plain(s: Sweep, only_failures: bool = False) -> str:
    return plain_document(header(s), tables(s, only_failures), summary(s))


def render_rich(s: Sweep, only_failures: bool = False, width: int = 120) -> str:
    return rich_document(header(s), tables(s, only_failures), summary(s), width)


def render_text(s: Sweep, only_failures: bool = False, terminal_width: int | None = None) -> str:
    return text_document(header(s), tables(s, only_failures), summary(s), terminal_width)


def _md_cell(v: str) -> str:
    return v.replace("|", "\\|").replace("\n", " ")


def render_markdown(s: Sweep, only_failures: bool = False) -> str:
    r0 = s.reports[0]
    out = [f"# Parity report: `{s.model}`", ""]
    out += [
        f"- detail: {r0.detail}",
        f"- configurations: {', '.join(label(x) for x in s.reports)}",
        f"- reference: {s.baseline}",
        f"- inputs: {len(r0.prompts)} prompt(s), {r0.n_tokens} tokens",
        *([f"- batch.* rows: {r0.batch_shape}: {BATCH_NOTE}"] if r0.batch_ids else []),
        *([f"- decode.logits: {r0.decode_shape}: {DECODE_NOTE}"] if r0.decode_ids else []),
        f"- versions: {', '.join(f'{k} {v}' for k, v in r0.versions.items())}",
        "",
        "## Summary",
        "",
    ]
    out += [f"- {line}" for line in summary(s)]
    return "\n".join(out + markdown_tables(tables(s, only_failures))) + "\n"


def markdown_tables(tables_: list[Table]) -> list[str]:
    """Each table as a Markdown section (failing rows in bold), its notes after it."""
    out: list[str] = []
    for t in tables_:
        out += ["", f"## {t.title}", ""]
        if t.rows:
            out += ["| " + " | ".join(t.columns) + " |", "|" + "---|" * len(t.columns)]
        for i, row in enumerate(t.rows):
            cells = [_md_cell(v) for v in row]
            if i in t.bad:
                cells = [f"**{c}**" if c else c for c in cells]
            out.append("| " + " | ".join(cells) + " |")
        notes = t.notes + _hidden_note(t)
        if notes:
            out += [""] + [f"{n}  " for n in notes]
    return out
