"""Attention heatmaps of the scratch model (matplotlib), and transformers' attention probabilities for `--compare`.

Nothing here imports transformers at import time: `gpt2-port attention` draws the scratch model's attention with
matplotlib alone; only `reference_probs` (for --compare) loads transformers, lazily.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from gpt2_port.io.checkpoint import locate

from .plots import pyplot, save_png
from .reference import load_reference


def token_labels(pieces: Sequence[str]) -> list[str]:
    """Readable tick labels: spaces shown as a visible mark, control characters escaped, position appended."""
    out = []
    for i, s in enumerate(pieces):
        s = s.replace(" ", "\u2423").replace("\n", "\\n").replace("\t", "\\t")
        s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
        out.append(f"{s[:14]} ({i})")
    return out


def reference_probs(
    model: str, revision: str | None, cfg, ids: torch.Tensor, layer: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """transformers' (eager) attention probabilities at `layer`: (nh, T, T). A forward hook on GPT2Attention sees
    its (attn_output, attn_weights) return value."""
    ref = load_reference(locate(model, revision), cfg, dtype, device, "eager")
    got: dict[str, torch.Tensor] = {}

    def hook(_m: torch.nn.Module, _inp: tuple, out: tuple) -> None:
        got["probs"] = out[1].detach()

    h = ref.transformer.h[layer].attn.register_forward_hook(hook)
    try:
        with torch.inference_mode():
            ref(input_ids=ids, use_cache=False)
    finally:
        h.remove()
    return got["probs"][0]  # (nh, T, T)


MAX_CELL_INCHES = 12.0  # one heatmap's side at most: 1,440 px at 120 dpi (a 1024-token map uncapped: 288 in, 35k px)
MAX_LABELS = 64  # tick labels per axis at most: every k-th token past that


def _heatmap(ax, m: torch.Tensor, labels: list[str], title: str, cmap: str, vmax: float | None, fig) -> None:
    T = m.shape[0]
    im = ax.imshow(m.float().cpu().numpy(), cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
    fs = 8 if T <= 16 else (6 if T <= 32 else 4)
    ticks = range(0, T, -(-T // MAX_LABELS))
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set_xticklabels([labels[i] for i in ticks], rotation=90, fontsize=fs)
    ax.set_yticklabels([labels[i] for i in ticks], fontsize=fs)
    ax.set_xlabel("key", fontsize=8)
    ax.set_ylabel("query", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03).ax.tick_params(labelsize=7)


def draw(
    probs: torch.Tensor,
    pieces: Sequence[str],
    layer: int,
    heads: Sequence[int],
    path: str | os.PathLike[str],
    title: str,
    diff: torch.Tensor | None = None,
) -> None:
    """probs (nh, T, T) of the scratch model; one heatmap per head in `heads`; with `diff`, |scratch - reference|
    drawn beside each head's map."""
    plt = pyplot()
    labels = token_labels(pieces)
    T = probs.shape[-1]
    n = len(heads)
    per = 2 if diff is not None else 1
    cols = per * (1 if n == 1 else min(4 if per == 1 else 2, n))
    rows = -(-n * per // cols)
    cell = min(max(3.2, 0.28 * T + 1.6), MAX_CELL_INCHES)
    fig, axes = plt.subplots(rows, cols, figsize=(cell * cols + 0.5, cell * rows + 0.8), squeeze=False)
    dmax = float(diff[list(heads)].max()) if diff is not None else None
    k = 0
    for h in heads:
        ax = axes[k // cols][k % cols]
        _heatmap(ax, probs[h], labels, f"layer {layer} head {h}: attention (scratch)", "viridis", 1.0, fig)
        k += 1
        if diff is not None:
            ax = axes[k // cols][k % cols]
            d = diff[h]
            _heatmap(
                ax,
                d,
                labels,
                f"layer {layer} head {h}: |scratch - transformers|\nmax {float(d.max()):.2e}",
                "magma",
                dmax if dmax and dmax > 0 else 1.0,
                fig,
            )
            if float(d.max()) == 0.0:
                ax.text(
                    (T - 1) / 2, (T - 1) / 2, "all 0\n(bit-exact)", ha="center", va="center", color="w", fontsize=10
                )
            k += 1
    for j in range(k, rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (cell * rows + 0.8)))
    save_png(fig, path)
