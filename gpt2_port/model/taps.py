"""Named activation taps: the points where `model.record()` reads intermediates and `model.edit()` replaces them.

Every name the model can tap is listed by `tap_names(n_layer)`; asking for a name that does not exist (or a predicate
that matches none) raises, since a typo would otherwise record or edit nothing, silently. With `keep_graph=True` the
recorder keeps the tensors attached to the autograd graph (and retains their gradients), so activation gradients can
be read after `backward()`. Recorders and editors nest: while any is active the model's `taps.rec` is a `Hooks`
holding them all, edits applied first (outermost first), then every recorder given the tensor the model goes on with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from ..errors import UsageError

# Per-block points, in the order the block computes them; `block.{i}` itself is the block's output.
BLOCK_POINTS = (
    "ln_1",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.scores",
    "attn.probs",
    "attn.merged",
    "attn.c_proj",
    "resid_attn",
    "ln_2",
    "mlp.pre",
    "mlp.act",
    "mlp.c_proj",
)
# Points the sdpa kernel never forms: asking for one runs that layer's attention the manual way (the reference's
# eager arithmetic), whose output differs from sdpa's in the last bits.
MANUAL_ATTENTION_POINTS = ("attn.scores", "attn.probs")

Edit = Callable[[torch.Tensor], torch.Tensor | None]


def tap_names(n_layer: int) -> list[str]:
    """Every name the model taps, in forward order."""
    names = ["embed"]
    for i in range(n_layer):
        names += [f"block.{i}.{p}" for p in BLOCK_POINTS] + [f"block.{i}"]
    return names + ["ln_f", "logits"]


def _matcher(
    what: str, names: Iterable[str] | Callable[[str], bool] | None, n_layer: int | None
) -> Callable[[str], bool] | None:
    """The predicate `names` stands for (None: every name), after checking that it names taps that exist."""
    if names is None:
        return None
    if isinstance(names, str):
        names = [names]
    valid = tap_names(n_layer) if n_layer is not None else None
    if callable(names):
        if valid is not None and not any(names(v) for v in valid):
            raise UsageError(f"{what}: the predicate matches none of the {len(valid)} activation names (tap_names)")
        return names
    try:
        wanted = set(names)
    except TypeError:
        raise UsageError(
            f"{what}: expected activation names (a list of strings), a predicate or None, got {type(names).__name__}"
        ) from None
    if not wanted:
        raise UsageError(f"{what}: no activation names given (None means every one)")
    odd = [w for w in wanted if not isinstance(w, str)]
    if odd:
        raise UsageError(f"{what}: activation names are strings, got {odd[0]!r} ({type(odd[0]).__name__})")
    if valid is not None:
        unknown = sorted(w for w in wanted if not any(v == w or (w.endswith(".") and v.startswith(w)) for v in valid))
        if unknown:
            raise UsageError(
                f"{what}: unknown activation name(s) {', '.join(map(repr, unknown))}: expected embed, "
                f"block.{{0..{n_layer - 1}}}, block.{{i}}.{{{','.join(BLOCK_POINTS)}}}, ln_f, logits, "
                f"or a prefix ending in '.' (e.g. 'block.3.')"
            )
    return lambda n: n in wanted or any(w.endswith(".") and n.startswith(w) for w in wanted)


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
        self._pred = _matcher("record", names, n_layer)

    def wants(self, name: str) -> bool:
        return self._pred is None or self._pred(name)

    def __call__(self, name: str, t: torch.Tensor) -> None:
        if name == "embed":  # a forward begins: the last one's activations go (none is left from an earlier one)
            self.acts.clear()
        if not self.wants(name):
            return
        if self.keep_graph:
            if t.requires_grad:
                t.retain_grad()
            self.acts[name] = t
        else:
            self.acts[name] = t.detach()


class Editor:
    """Replaces named activations: `edits` maps exact names to functions of the tensor that return its replacement
    (same dtype and device, its shape or one that broadcasts to it) or None (they changed it in place: under no_grad
    only, as autograd refuses in-place changes to q/k/v's views and to the saved probabilities)."""

    def __init__(self, edits: Mapping[str, Edit], n_layer: int | None = None) -> None:
        if not isinstance(edits, Mapping) or not edits:
            raise UsageError("edit: expected a dict of activation name -> function(tensor) -> tensor or None")
        prefixes = [n for n in edits if isinstance(n, str) and n.endswith(".")]
        if prefixes:
            raise UsageError(f"edit: {prefixes[0]!r} is a prefix; an edit names one activation exactly")
        _matcher("edit", edits, n_layer)
        bad = next((n for n, f in edits.items() if not callable(f)), None)
        if bad is not None:
            raise UsageError(f"edit: {bad!r} maps to a {type(edits[bad]).__name__}, expected a function(tensor)")
        self.edits = dict(edits)

    def wants(self, name: str) -> bool:
        return name in self.edits

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        fn = self.edits.get(name)
        if fn is None:
            return t
        out = fn(t)
        if out is None:
            return t
        if not isinstance(out, torch.Tensor):
            raise UsageError(f"edit {name!r}: the function returned a {type(out).__name__}, expected a tensor or None")
        if out.shape != t.shape and _broadcasts(out.shape, t.shape):
            out = out.expand(t.shape)  # e.g. one clean run's (1, T, C) patched into a batch of B
        if out.shape != t.shape or out.dtype != t.dtype or out.device != t.device:
            raise UsageError(
                f"edit {name!r}: the function returned a {out.dtype} tensor of shape {tuple(out.shape)} on "
                f"{out.device}, expected {t.dtype} {tuple(t.shape)} (or a shape that broadcasts to it) on {t.device}"
            )
        return out


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, to) == to
    except RuntimeError:
        return False


class Hooks:
    """What the model's taps call while anything records or edits (immutable: nesting makes a new one)."""

    def __init__(self, recorders: tuple[Recorder, ...] = (), editors: tuple[Editor, ...] = ()) -> None:
        self.recorders, self.editors = recorders, editors
        self.keep_graph = any(r.keep_graph for r in recorders)

    def adding(self, hook: Recorder | Editor) -> Hooks:
        if isinstance(hook, Editor):
            return Hooks(self.recorders, (*self.editors, hook))
        return Hooks((*self.recorders, hook), self.editors)

    def removing(self, hook: Recorder | Editor) -> Hooks | None:
        """These hooks without `hook` (None when none is left)."""
        rest = Hooks(tuple(r for r in self.recorders if r is not hook), tuple(e for e in self.editors if e is not hook))
        return rest if rest.recorders or rest.editors else None

    def wants(self, name: str) -> bool:
        return any(h.wants(name) for h in self.editors) or any(h.wants(name) for h in self.recorders)

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The tensor the model goes on with at `name`: edited (outermost edit first), then recorded."""
        for e in self.editors:
            t = e(name, t)
        for r in self.recorders:
            r(name, t)
        return t


class Taps:
    """The model's one tap point: modules call `t = taps.rec(name, t)` while `taps.rec` (a Hooks) is not None."""

    def __init__(self) -> None:
        self.rec: Hooks | None = None

    def wants(self, name: str) -> bool:
        return self.rec is not None and self.rec.wants(name)
