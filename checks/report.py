"""Rendering a detailed parity run (checks/sweep.py): a terminal table (rich when installed), Markdown, and JSON.

The same tables feed every output: per configuration the points (error, the noise floor, the verdict against it,
the tolerance), the logit lens, and for a sweep one summary row per configuration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .noise import NOISE_MARGIN
from .parity import Report
from .sweep import Sweep, label


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    bad: set[int] = field(default_factory=set)  # row indices to highlight (a failure)
    notes: list[str] = field(default_factory=list)


def num(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.3e}"


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
    what = _floor_text(r)
    worst = max(r.points, key=lambda p: -1.0 if p.noise_ratio is None else p.noise_ratio)
    if r.as_close_as_reference:
        if all(p.norm_rel == 0 for p in r.points):
            why = "bit-exact at every point"
        else:
            why = f"every point within {NOISE_MARGIN:g}x the floor; worst x{worst.noise_ratio:.2g} at {worst.name}"
        return f"{label(r)}: as close to {ref} as {what} is: YES ({why})"
    n_above = sum(1 for p in r.points if p.within_noise is False)
    first = next(p for p in r.points if p.within_noise is False)
    return (
        f"{label(r)}: as close to {ref} as {what} is: NO ({n_above} of {len(r.points)} points above the floor; "
        f"first at {first.name}, {first.noise_verdict})"
    )


def result_line(r: Report) -> str:
    if r.passed:
        worst = max(r.points, key=lambda p: p.norm_rel)
        return (
            f"{label(r)}: PASS, all {len(r.points)} points within {r.dtype} tolerances "
            f"(worst norm_rel {worst.norm_rel:.2e} at {worst.name})"
        )
    ff = r.first_failure
    p = next((p for p in r.points if p.name == ff), None)
    why = f"norm_rel {p.norm_rel:.2e} > {p.tolerance:.0e}" if p else ff
    return f"{label(r)}: FAIL, first diverging point {ff} ({why})"


def point_table(r: Report) -> Table:
    floor = r.noise_floor is not None
    cols = ["point", "max_abs", "norm_rel", "cosine"] + (["noise floor", "vs floor"] if floor else []) + ["tol", ""]
    t = Table(
        f"{label(r)}: scratch ({r.scratch_attn} attention) vs {r.reference}, {r.reference_dtype}, {r.reference_device}",
        cols,
    )
    for i, p in enumerate(r.points):
        row = [p.name, num(p.max_abs), num(p.norm_rel), f"{p.cosine:.10f}"]
        if floor:
            row += [num(p.noise_norm_rel), p.noise_verdict or "-"]
        row += [f"{p.tolerance:.0e}", "OK" if p.passed else "FAIL"]
        t.rows.append(row)
        if not p.passed:
            t.bad.add(i)
    t.notes.append(
        f"top-1 next-token agreement {100 * r.top1_agreement:.1f}% (min {100 * r.top1_tolerance:.0f}%), "
        f"log-prob max abs diff {r.logprob_max_abs:.3e} (tol {r.logprob_tolerance:.0e})"
    )
    if floor:
        t.notes.append(f"noise floor: {r.noise_floor}; norm_rel within {NOISE_MARGIN:g}x of it counts as within")
    if r.nonfinite_weights:
        t.notes.append(f"NaN/Inf in weights: {', '.join(r.nonfinite_weights[:8])}")
    return t


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
                repr(e["scratch_top1"]),
                repr(e["reference_top1"]),
                "yes" if same else "NO",
                f"{100 * e['agreement']:.1f}%",
            ]
        )
        if not same:
            t.bad.add(i)
    return t


def sweep_table(s: Sweep) -> Table:
    floor = s.reports[0].noise_floor is not None
    cols = ["config", "tolerance", "worst norm_rel", "first diverging", "top-1"]
    cols += ["first above noise", "as close as ref"] if floor else []
    cols += ["result"]
    t = Table(f"sweep: every configuration against {s.baseline}", cols)
    for i, r in enumerate(s.reports):
        worst = max(r.points, key=lambda p: p.norm_rel)
        tol = max(p.tolerance for p in r.points if p.name != "embed")
        row = [
            label(r),
            f"{tol:.0e}",
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


def tables(s: Sweep) -> list[Table]:
    out = []
    for r in s.reports:
        out.append(point_table(r))
        if r.logit_lens:
            out.append(lens_table(r))
    if s.is_sweep:
        out.append(sweep_table(s))
    return out


def summary(s: Sweep) -> list[str]:
    lines = [result_line(r) for r in s.reports]
    lines += [x for x in (noise_summary(r) for r in s.reports) if x]
    lines.append(
        "PASS" if s.passed else f"FAIL: first failure in {label(s.first_failing)} at {s.first_failing.first_failure}"
    )
    return lines


def header(s: Sweep) -> list[str]:
    r = s.reports[0]
    return [
        f"parity  {s.model}  ({r.detail} detail)",
        f"  configurations  {', '.join(label(x) for x in s.reports)}",
        f"  reference       {s.baseline}" + (" (one float32 reference for all)" if s.is_sweep else ""),
        f"  inputs          {len(r.prompts)} prompt(s), {r.n_tokens} tokens",
    ]


def render_plain(s: Sweep) -> str:
    out = header(s)
    for t in tables(s):
        widths = [max(len(c), *(len(row[j]) for row in t.rows)) if t.rows else len(c) for j, c in enumerate(t.columns)]
        out += ["", t.title, "  " + "  ".join(c.ljust(w) for c, w in zip(t.columns, widths))]
        out += ["  " + "  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in t.rows]
        out += [f"  {n}" for n in t.notes]
    return "\n".join(out + [""] + summary(s))


def print_terminal(s: Sweep) -> None:
    """A rich table when rich is installed (plain text otherwise); colours only on a terminal."""
    try:
        from rich.console import Console
        from rich.table import Table as RichTable
    except ImportError:
        print(render_plain(s))
        return
    import sys

    con = Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 240)
    for line in header(s):
        con.print(line, markup=False)
    for t in tables(s):
        rt = RichTable(title=t.title, title_justify="left", caption="\n".join(t.notes) or None, caption_justify="left")
        for j, c in enumerate(t.columns):
            rt.add_column(c, justify="left" if j == 0 else "right", overflow="fold")
        for i, row in enumerate(t.rows):
            rt.add_row(*row, style="bold red" if i in t.bad else None)
        con.print(rt)
    for line in summary(s):
        style = "green" if line.startswith("PASS") or ": PASS" in line or "YES" in line else None
        style = "bold red" if "FAIL" in line or ": as close" in line and "NO" in line else style
        con.print(line, style=style, markup=False)


def _md_cell(v: str) -> str:
    return v.replace("|", "\\|").replace("\n", " ")


def render_markdown(s: Sweep) -> str:
    r0 = s.reports[0]
    out = [f"# Parity report: `{s.model}`", ""]
    out += [
        f"- detail: {r0.detail}",
        f"- configurations: {', '.join(label(x) for x in s.reports)}",
        f"- reference: {s.baseline}",
        f"- inputs: {len(r0.prompts)} prompt(s), {r0.n_tokens} tokens",
        f"- versions: {', '.join(f'{k} {v}' for k, v in r0.versions.items())}",
        "",
        "## Summary",
        "",
    ]
    out += [f"- {line}" for line in summary(s)]
    for t in tables(s):
        out += ["", f"## {t.title}", "", "| " + " | ".join(t.columns) + " |", "|" + "---|" * len(t.columns)]
        for i, row in enumerate(t.rows):
            cells = [_md_cell(v) for v in row]
            if i in t.bad:
                cells = [f"**{c}**" if c else c for c in cells]
            out.append("| " + " | ".join(cells) + " |")
        if t.notes:
            out += [""] + [f"{n}  " for n in t.notes]
    return "\n".join(out) + "\n"
