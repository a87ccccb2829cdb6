"""A PNG of parity error per layer: norm_rel on a log scale, one line per configuration, the noise floor as a band.

matplotlib is an optional extra; gpt2_port.plots finds it (or says so in one line) and writes the file.
"""

from __future__ import annotations

import math
import os

from gpt2_port.plots import pyplot, save_png

from .noise import NOISE_MARGIN
from .points import is_head_point
from .results import Sweep, label


def tolerance_marks(s: Sweep, names: list[str]) -> list[tuple[list[str], list[float]]]:
    """The gates the pass/fail check used, point by point: (configurations, tolerance at each of `names`) for each
    distinct profile (configurations judged by the same tolerances share one line; `embed` is often tighter)."""
    marks: dict[tuple[float, ...], list[str]] = {}
    for r in s.reports:
        pts = {p.name: p.tolerance for p in r.points}
        marks.setdefault(tuple(pts[n] for n in names), []).append(label(r))
    return [(labels, list(tols)) for tols, labels in marks.items()]


def plot_errors(s: Sweep, path: str | os.PathLike[str]) -> None:
    plt = pyplot()
    r0 = s.reports[0]
    names = [p.name for p in r0.points if not is_head_point(p.name) and not p.name.startswith(("batch.", "decode."))]
    x = list(range(len(names)))
    values = [p.norm_rel for r in s.reports for p in r.points] + [
        p.noise_norm_rel or 0.0 for r in s.reports for p in r.points
    ]
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    bottom = 10 ** math.floor(math.log10(min(pos))) / 10 if pos else 1e-12
    top = 10 ** math.ceil(math.log10(max(pos + [p.tolerance for r in s.reports for p in r.points]))) * 3

    fig, ax = plt.subplots(figsize=(max(8.0, min(13.0, 0.08 * len(names) + 6)), 5.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    any_zero = False
    for k, r in enumerate(s.reports):
        c = colors[k % len(colors)]
        pts = {p.name: p for p in r.points}
        err = [pts[n].norm_rel for n in names]
        y = [max(v, bottom) for v in err]
        ax.plot(
            x,
            y,
            "-",
            color=c,
            lw=1.6,
            marker="o" if len(names) <= 60 else None,
            ms=3.5,
            label=f"{label(r)} scratch ({r.scratch_attn})",
        )
        zx = [i for i, v in zip(x, err) if v == 0]
        if zx:
            any_zero = True
            ax.plot(zx, [bottom] * len(zx), "o", mfc="white", mec=c, ms=5)
        if r.noise_floor is not None:
            fl = [max(pts[n].noise_norm_rel or 0.0, bottom) for n in names]
            # The band runs from the floor to NOISE_MARGIN x the floor: a line at or below its top edge is within
            # the reference's own noise. Bands of different dtypes sit orders of magnitude apart and do not mix.
            ax.fill_between(
                x,
                fl,
                [v * NOISE_MARGIN for v in fl],
                color=c,
                alpha=0.25,
                lw=0,
                label=f"{label(r)} noise floor: transformers vs itself, to x{NOISE_MARGIN:g}",
            )
            ax.plot(x, fl, ":", color=c, lw=1.0)
    # Each tolerance profile as a dashed step line at the value each point was judged by.
    for labels, tols in tolerance_marks(s, names):
        ax.step(x, tols, where="mid", color="0.35", ls="--", lw=0.9)
        ax.text(x[-1], tols[-1], f" tolerance {', '.join(labels)}", va="bottom", ha="right", fontsize=8, color="0.3")
    ax.set_yscale("log")
    ax.set_ylim(bottom / 2, top)
    if r0.detail == "sublayer" or len(names) > 30:
        ticks = [i for i, n in enumerate(names) if n.count(".") == 1 or n in ("embed", "ln_f", "logits")]
        step = max(1, len(ticks) // 26)
        ticks = [t for j, t in enumerate(ticks) if j % step == 0 or names[t] in ("ln_f", "logits")]
    else:
        ticks = x
    ax.set_xticks(ticks)
    tick_labels = [names[t].replace("block.", "block ") for t in ticks]
    if len(names) > 30 and tick_labels[-2:] == ["ln_f", "logits"]:  # adjacent: one label for both
        tick_labels[-2:] = ["", "ln_f, logits"]
    ax.set_xticklabels(tick_labels, rotation=45, ha="right", fontsize=8)
    ax.set_xlabel(
        "layer (block output)" + ("; dots between are the sub-layer points" if r0.detail == "sublayer" else "")
    )
    ax.set_ylabel("norm-relative error  ||scratch - ref|| / ||ref||")
    ref = s.baseline if s.is_sweep else f"{r0.reference}, same dtype"
    ax.set_title(
        f"parity error per layer: {os.path.basename(str(s.model).rstrip('/')) or s.model}\nagainst {ref}", fontsize=10
    )
    finish(fig, ax, path, any_zero, bottom)


def finish(fig, ax, path: str | os.PathLike[str], any_zero: bool, bottom: float) -> None:  # noqa: ANN001
    """The common end of every error plot: the exact-zero note, grid, legend outside, written as PNG."""
    if any_zero:
        note = " hollow markers: exactly 0 (bit-exact), drawn at the bottom"
        ax.text(0, bottom, note, fontsize=8, va="bottom", color="0.3")
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    save_png(fig, path)
