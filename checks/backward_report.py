"""Rendering a backward parity run (checks/backward.py): terminal table (rich when installed), Markdown, and the
per-layer gradient plot. The tables are checks/render.py's Table; the layout follows the forward report."""

from __future__ import annotations

import math
import os

from .backward_results import BackwardReport, BackwardSweep
from .grads import layer_of, layer_order
from .noise import NOISE_MARGIN, verdict
from .render import Table, markdown_tables, num, text_document


def layer_table(r: BackwardReport) -> Table:
    floor = r.noise_floor is not None
    cols = ["layer", "worst point", "norm_rel"] + (["noise floor"] if floor else []) + [""]
    t = Table(f"{r.label}: gradients and forward activations grouped by layer (worst of each)", cols)
    for i, g in enumerate(r.layers):
        row = [g.layer, g.worst_point, num(g.worst_norm_rel)]
        if floor:
            row.append(num(g.worst_noise_norm_rel))
        t.rows.append(row + ["OK" if g.passed else "FAIL"])
        if not g.passed:
            t.bad.add(i)
    t.notes.append(f"first diverging layer: {r.first_diverging_layer or 'none'}")
    return t


def point_table(r: BackwardReport) -> Table:
    floor = r.noise_floor is not None
    cols = ["gradient", "max_abs", "norm_rel", "cosine"] + (["noise floor", "vs floor"] if floor else []) + ["tol", ""]
    t = Table(
        f"{r.label}: scratch ({r.scratch_attn} attention, {r.kernels} kernels) gradients vs {r.reference}, "
        f"{r.reference_dtype}, {r.reference_device}",
        cols,
    )
    ok = r.loss_rel <= r.loss_tolerance
    t.rows.append(
        ["loss", num(abs(r.loss_scratch - r.loss_reference)), num(r.loss_rel), "-"]
        + ([num(r.loss_noise_rel), r.loss_noise_verdict or "-"] if floor else [])
        + [f"{r.loss_tolerance:.0e}", "OK" if ok else "FAIL"]
    )
    if not ok:
        t.bad.add(0)
    for p in r.points:
        row = [p.name, num(p.max_abs), num(p.norm_rel), f"{p.cosine:.10f}"]
        if floor:
            row += [num(p.noise_norm_rel), p.noise_verdict or "-"]
        t.rows.append(row + [f"{p.tolerance:.0e}", "OK" if p.passed else "FAIL"])
        if not p.passed:
            t.bad.add(len(t.rows) - 1)
    t.notes.append(
        f"loss: scratch {r.loss_scratch:.9g}, reference {r.loss_reference:.9g} (the loss row's norm_rel is "
        "|difference| / |reference|"
        + ("; its floor: the floor run's distance at each prompt's loss, summed, over |reference|)" if floor else ")")
    )
    if floor:
        t.notes.append(f"noise floor: {r.noise_floor}; norm_rel within {NOISE_MARGIN:g}x of it counts as within")
    return t


def steps_table(r: BackwardReport) -> Table:
    floor = any(s.noise_rel is not None for s in r.steps)
    cols = ["step", "scratch", "reference", "rel"] + (["noise floor", "vs floor"] if floor else []) + [""]
    t = Table(f"{r.label}: AdamW steps, each step's loss before its update", cols)
    for i, s in enumerate(r.steps):
        row = [str(s.step), f"{s.loss_scratch:.9g}", f"{s.loss_reference:.9g}", num(s.rel)]
        if floor:
            row += [num(s.noise_rel), verdict(s.rel, s.noise_rel).text if s.noise_rel is not None else ""]
        t.rows.append(row + ["OK" if s.passed else "FAIL"])
        if not s.passed:
            t.bad.add(i)
    if r.train:
        hp = r.train
        t.notes.append(
            f"{hp.get('optimizer', 'torch.optim.AdamW')}: lr {hp['lr']:g}, betas {tuple(hp['betas'])}, "
            f"eps {hp['eps']:g}, weight decay {hp['weight_decay']:g} "
            f"(2+-dim weights only), clip_grad_norm {hp['clip']:g} (the total norm summed over transformers' "
            f"tensors on both sides); batch: {hp['batch']}; tolerance {r.steps[0].tolerance:.0e} relative"
        )
    if r.weights:
        worst = max(r.weights, key=lambda p: -1.0 if math.isnan(p.norm_rel) else p.norm_rel)
        bad = [p.name for p in r.weights if not p.passed]
        over = [p for p in r.weights if p.passed and not p.norm_rel <= p.tolerance]  # passed within the noise
        said = f"{len(bad)} above it, first {bad[0]}" if bad else "all within"
        if over:
            said += f" ({len(over)} past it but within transformers' own drift, which passes)"
        t.notes.append(
            f"weights after the last step: worst norm_rel {num(worst.norm_rel)} at {worst.name} "
            f"(tolerance {worst.tolerance:.0e}); {said}"
        )
    if floor:
        ratios = sorted(p.noise_ratio for p in r.weights if p.noise_ratio is not None and not math.isnan(p.noise_ratio))
        within = sum(1 for p in r.weights if p.within_noise)
        t.notes.append(
            "noise floor of the steps: transformers with its other attention taking the same steps, against the "
            "reference (a step's floor: the prompts' loss drifts summed, over the reference's loss; the largest "
            "such sum up to that step); the weights after them: "
            f"{within} of {len(r.weights)} within {NOISE_MARGIN:g}x their floor"
            + (f", median ratio {ratios[len(ratios) // 2]:.3g}" if ratios else "")
        )
    return t


def tables(s: BackwardSweep, full: bool = True) -> list[Table]:
    out = []
    for r in s.reports:
        out.append(layer_table(r))
        if full:
            out.append(point_table(r))
        if r.steps:
            out.append(steps_table(r))
    return out


def summary(s: BackwardSweep) -> list[str]:
    lines = []
    for r in s.reports:
        if r.passed:
            worst = max(r.points, key=lambda p: p.norm_rel)
            lines.append(
                f"{r.label}: PASS, loss rel {num(r.loss_rel)}, all {len(r.points)} points (gradients and the "
                f"forward's activations) within {r.dtype} "
                f"tolerances (worst norm_rel {num(worst.norm_rel)} at {worst.name})"
                + (f", {len(r.steps)} steps' losses and the weights after them within theirs" if r.steps else "")
            )
        else:
            lines.append(
                f"{r.label}: FAIL, first failure {r.first_failure}; first diverging layer "
                f"{r.first_diverging_layer or 'none'}"
            )
        loss = "the loss and " if r.loss_within_noise is not None else ""  # judged under autocast (BackwardReport)
        for what, within, close in (
            (
                f"{loss}every gradient within the reference's own noise",
                [w for _, w in r.judged],
                r.as_close_as_reference,
            ),
            (
                "every step's loss within the reference's own drift",
                [s.within_noise for s in r.steps],
                r.steps_as_close_as_reference,
            ),
        ):
            if close is not None:
                above = sum(1 for w in within if w is False)
                lines.append(f"{r.label}: {what}: " + ("YES" if close else f"NO ({above} of {len(within)} above it)"))
    bad = s.first_failing
    lines.append("PASS" if s.passed else f"FAIL: first failure in {bad.label} at {bad.first_failure}")
    return lines


def header(s: BackwardSweep) -> list[str]:
    r = s.reports[0]
    return [
        f"backward parity  {s.model}",
        f"  configurations  {', '.join(x.label for x in s.reports)}",
        f"  reference       {s.baseline} (one float32 reference for all), dropout off on both sides",
        f"  inputs          {len(r.prompts)} prompt(s), {r.n_tokens} tokens; loss = the mean of the prompts' losses",
    ]


def render_text(s: BackwardSweep, full: bool = False, terminal_width: int | None = None) -> str:
    """The per-layer table (all gradients with full=True), the steps, the verdicts: through checks/render.py."""
    return text_document(header(s), tables(s, full), summary(s), terminal_width)


def render_markdown(s: BackwardSweep) -> str:
    r0 = s.reports[0]
    out = [f"# Backward parity report: `{s.model}`", ""]
    out += [f"- {line.strip()}" for line in header(s)[1:]]
    out += [f"- versions: {', '.join(f'{k} {v}' for k, v in r0.versions.items())}", "", "## Summary", ""]
    out += [f"- {line}" for line in summary(s)]
    return "\n".join(out + markdown_tables(tables(s, full=True))) + "\n"


def plot_gradients(s: BackwardSweep, path: str | os.PathLike[str]) -> None:
    """Per layer, the worst parameter-gradient and activation-gradient norm_rel of each configuration (log scale),
    transformers' own noise at that layer as a band (floor to NOISE_MARGIN x floor), the tolerances dashed."""
    from .plots import finish, pyplot

    plt = pyplot()
    layers = layer_order(sum(1 for g in s.reports[0].layers if g.layer.startswith("h.")))
    x = list(range(len(layers)))

    def worst(r: BackwardReport, kind: str, attr: str) -> list[float]:
        out = []
        for layer in layers:
            vals = [getattr(p, attr) or 0.0 for p in r.points if p.name.startswith(kind) and layer_of(p.name) == layer]
            out.append(max(vals) if vals else math.nan)
        return out

    series = [
        (r, kind, worst(r, kind, "norm_rel"), worst(r, kind, "noise_norm_rel"))
        for r in s.reports
        for kind in ("grad.", "act_grad.")
    ]
    vals = [v for _, _, e, f in series for v in (*e, *f) if v > 0 and math.isfinite(v)]
    bottom = 10 ** math.floor(math.log10(min(vals))) / 10 if vals else 1e-12
    tols = sorted({p.tolerance for r in s.reports for p in r.points})
    top = 10 ** math.ceil(math.log10(max(vals + tols))) * 3

    fig, ax = plt.subplots(figsize=(max(8.0, min(13.0, 0.15 * len(layers) + 6)), 5.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    any_zero = False
    for k, (r, kind, err, _floor) in enumerate(series):
        c = colors[(k // 2) % len(colors)]
        style = "-" if kind == "grad." else "--"
        what = "parameter gradients" if kind == "grad." else "activation gradients"
        ax.plot(
            x,
            [max(v, bottom) if math.isfinite(v) else math.nan for v in err],
            style,
            color=c,
            lw=1.5,
            marker="o" if kind == "grad." else "s",
            ms=3.5,
            label=f"{r.label} {what}",
        )
        zx = [i for i, v in zip(x, err) if v == 0]
        if zx:
            any_zero = True
            ax.plot(zx, [bottom] * len(zx), "o", mfc="white", mec=c, ms=5)
        if r.noise_floor is not None and kind == "grad.":
            by_layer = {g.layer: g.worst_noise_norm_rel or 0.0 for g in r.layers}  # parameters and activations
            band = [max(by_layer.get(layer, 0.0), bottom) for layer in layers]
            ax.fill_between(
                x,
                band,
                [v * NOISE_MARGIN for v in band],
                color=c,
                alpha=0.2,
                lw=0,
                label=f"{r.label} noise: transformers vs itself, to x{NOISE_MARGIN:g}",
            )
    for tol in tols:
        ax.axhline(tol, color="0.35", ls=":", lw=0.9)
        dts = sorted({r.dtype for r in s.reports if any(p.tolerance == tol for p in r.points)})
        ax.text(x[-1], tol, f" tolerance {'/'.join(dts)} {tol:.0e}", va="bottom", ha="right", fontsize=8, color="0.3")
    ax.set_yscale("log")
    ax.set_ylim(bottom / 2, top)
    step = max(1, len(layers) // 26)
    ticks = [i for i in x if i % step == 0 or i >= len(layers) - 2]
    ax.set_xticks(ticks)
    ax.set_xticklabels([layers[i] for i in ticks], rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("layer (embed: wte, wpe, the embeddings' output; head: the logits, an untied lm_head)")
    ax.set_ylabel("worst norm-relative error in the layer")
    ax.set_title(
        f"gradient error per layer: {os.path.basename(str(s.model).rstrip('/')) or s.model}\nagainst {s.baseline}",
        fontsize=10,
    )
    finish(fig, ax, path, any_zero, bottom)
