"""Named activation taps: a recorder that the model writes intermediates into while `model.record()` is active.

Every name the model can tap is listed by `tap_names(n_layer)`; asking for a name that does not exist raises (a typo
would otherwise record nothing, silently). With `keep_graph=True` the recorder keeps the tensors attached to the
autograd graph (and retains their gradients), so activation gradients can be read after `backward()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..errors import UsageError

# Per-block points, in the order the block computes them; `block.{i}` itself is the block's output.
BLOCK_POINTS = (
    "ln_1",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.probs",
    "attn.merged",
    "attn.c_proj",
    "resid_attn",
    "ln_2",
    "mlp.act",
    "mlp.c_proj",
)


def tap_names(n_layer: int) -> list[str]:
    """Every name the model taps, in forward order."""
    names = ["embed"]
    for i in range(n_layer):
        names += [f"block.{i}.{p}" for p in BLOCK_POINTS] + [f"block.{i}"]
    return names + ["ln_f", "logits"]


class Recorder:
    """Collects named activations. `names`: exact names, or prefixes ending in '.', or a predicate, or None (all)."""

    def __init__(
        self,
        names: Iterable[str] | Callable[[str], bool] | None = None,
        n_layer: int | None = None,
        keep_graph: bool = False,
    ) -> None:
        self.acts: dict[str, torch.Tensor] = {}
        self.keep_graph = keep_graph
        if names is None or callable(names):
            self._pred = names
            return
        wanted = set(names)
        if n_layer is not None:
            valid = tap_names(n_layer)
            unknown = sorted(
                w for w in wanted if not any(v == w or (w.endswith(".") and v.startswith(w)) for v in valid)
            )
            if unknown:
                raise UsageError(
                    f"record: unknown activation name(s) {', '.join(map(repr, unknown))}: expected embed, "
                    f"block.{{0..{n_layer - 1}}}, block.{{i}}.{{{','.join(BLOCK_POINTS)}}}, ln_f, logits, "
                    f"or a prefix ending in '.' (e.g. 'block.3.')"
                )
        self._pred = lambda n: n in wanted or any(w.endswith(".") and n.startswith(w) for w in wanted)

    def wants(self, name: str) -> bool:
        return self._pred is None or self._pred(name)

    def __call__(self, name: str, t: torch.Tensor) -> None:
        if not self.wants(name):
            return
        if self.keep_graph:
            if t.requires_grad:
                t.retain_grad()
            self.acts[name] = t
        else:
            self.acts[name] = t.detach()


class Taps:
    """The model's one tap point: modules call `taps(name, t)`; it records only while a Recorder is attached."""

    def __init__(self) -> None:
        self.rec: Recorder | None = None

    def __call__(self, name: str, t: torch.Tensor) -> None:
        if self.rec is not None:
            self.rec(name, t)

    def wants(self, name: str) -> bool:
        return self.rec is not None and self.rec.wants(name)
