"""Backward parity: the loss, every parameter's gradient and the activation gradients of the scratch model against
transformers' GPT2LMHeadModel, the reference's own eager-vs-sdpa gradient noise, and N AdamW steps taken side by side.

Both models load the same checkpoint, dropout off, and run every prompt as its own batch of one; the loss is the mean
of the prompts' losses (labels = the prompt's ids, transformers' shift inside), so one backward gives the gradients
(grads.py). The reference always runs in float32 on the first device listed; each configuration (dtype x device) of
the scratch model is compared with it. A reduced dtype runs as trainers run it: float32 weights, the forward and
backward under torch.autocast, AdamW on the float32 weights; its noise floor is transformers under the same autocast
against its own float32 run. float32 matmuls stay float32 throughout (no TF32). Our gradients are mapped to
transformers' layout by the adapter (Conv1D transposed, q/k/v fused into c_attn; a tied head's share is already in
wte on both sides) and compared per parameter.

Memory: the reference is handled first and what is kept of it is its gradients (one copy of the parameters' size),
plus its trained weights when steps are asked for; then each scratch configuration is loaded in turn. Peak is about
three times the parameters (five with --train-steps: weights, gradients and AdamW's two moments).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import math
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gpt2_port.config import GPT2Config
from gpt2_port.devices import available_cpu_memory, dtype_name, parse_device, parse_dtype
from gpt2_port.errors import UsageError
from gpt2_port.io import adapter
from gpt2_port.io.checkpoint import Checkpoint
from gpt2_port.io.load import read_checkpoint
from gpt2_port.io.tokenizer import tokenizer_for
from gpt2_port.model import GPT2, from_pretrained

from .backward_results import BackwardReport, BackwardSweep, LayerResult, StepResult
from .forward import _as_inputs, _unique, parse_list
from .grads import PREFIX, Grads, act_points, hf_name_of_scratch, layer_of, layer_order, reference_grads, scratch_grads
from .metrics import metrics, rel
from .noise import total_floor, verdict
from .points import transformed
from .prompts import Inputs, resolve
from .reference import amp, exact_matmuls, load_reference, versions
from .results import PointResult
from .steps import ADAMW_NAME, StepLoss, TrainConfig, _ref_loss, _scratch_loss, train_steps
from .storage import DISK_MOMENTS_SHARE, SPILL_BYTES, LazyTensors, SpilledTensors, spills
from .tolerances import BACKWARD_TOLERANCES, TOLERANCES

# -- the run --------------------------------------------------------------------------------------------------------


def _dropout_off(ref: torch.nn.Module) -> torch.nn.Module:
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):
        setattr(ref.config, k, 0.0)
    return ref.train().requires_grad_(True)


def _furthest(floors: Sequence[dict[str, tuple]]) -> dict[str, tuple]:
    return {k: max((f[k] for f in floors), key=lambda m: m[0] if k == "loss" else m[1]) for k in floors[0]}


def _under(ctx: Callable[[], contextlib.AbstractContextManager], fn: Callable) -> Callable:
    """`fn` run inside a fresh `ctx()` each call (a loss under autocast, for the training steps)."""

    def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
        with ctx():
            return fn(*a, **k)

    return run


@dataclass
class Setup:
    """What every phase of a run needs: the checkpoint, the prompts, the configurations, where state may spill."""

    model: str
    revision: str | None
    ckpt: Checkpoint
    cfg: GPT2Config
    ids_py: list[list[int]]
    base: tuple[torch.dtype, torch.device]
    configs: list[tuple[torch.dtype, torch.device]]
    reference_attn: str
    alt_attn: str
    attn: str
    kernels: str
    tc: TrainConfig
    say: Callable[[str], None]
    transform: Callable[[GPT2], GPT2 | None] | None = None
    moments_root: tempfile.TemporaryDirectory | None = None
    spill_dir: tempfile.TemporaryDirectory | None = None

    def ids_on(self, dev: torch.device) -> list[torch.Tensor]:
        return [torch.tensor([i], device=dev) for i in self.ids_py]

    def moments_dir(self, side: str) -> Path | None:
        if self.moments_root is None:
            return None
        d = Path(self.moments_root.name) / side
        d.mkdir()
        self.say(f"{side}: AdamW's moments kept on disk in {d} (the training state does not fit in memory)")
        return d


@dataclass
class ReferenceRun:
    """The reference's side: its gradients, its noise floors, its steps and the weights after them."""

    want: Grads
    order: list[str]  # transformers' parameter order, for the clip norm
    floors: dict[tuple, dict[str, tuple]] = field(default_factory=dict)
    floor_desc: dict[tuple, str] = field(default_factory=dict)
    steps: list[StepLoss] = field(default_factory=list)
    weights: Mapping[str, torch.Tensor] = field(default_factory=dict)
    step_floor: list[float] = field(default_factory=list)
    weight_floor: dict[str, tuple] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def _floor_of(
    ref: torch.nn.Module, impl: str, ids_list: Sequence[torch.Tensor], n_layer: int, want: Grads, dt: torch.dtype
) -> dict[str, tuple]:
    """Metrics of transformers with attention `impl` (on the ref's current device, under `dt`'s autocast) against
    the reference."""
    ref.set_attn_implementation(impl)
    with amp(dt, ids_list[0].device):
        g = reference_grads(ref, ids_list, n_layer)
    out = {f"grad.{n}": metrics(t, want.params[n]) for n, t in g.params.items()}
    out.update({f"act_grad.{n}": metrics(t, want.acts[n]) for n, t in g.acts.items()})
    out.update({f"act.{n}": metrics(t, want.values[n]) for n, t in g.values.items()})
    # the loss sums the prompts' losses: its floor sums their distances (noise.total_floor), as eval --check's totals do
    out["loss"] = (total_floor(g.prompt_losses, want.prompt_losses, want.loss),)
    return out


def step_floors(floor: Sequence[StepLoss], reference: Sequence[StepLoss]) -> list[float]:
    """Each step's floor: the floor run's distance from the reference at each prompt's loss, summed, over the
    reference's loss (noise.total_floor, as the gradients' loss takes it), and the largest of these up to that step:
    two runs whose losses meet again at one step (rounded to the same float) have not met again in their weights."""
    drift = (total_floor(f.prompts, r.prompts, r.total) for f, r in zip(floor, reference, strict=True))
    return list(itertools.accumulate(drift, max))


def _step_floor(s: Setup, ref_steps: Sequence[StepLoss], ref_weights: Mapping[str, torch.Tensor]):  # noqa: ANN202
    """The noise floor of the steps: transformers with its other attention, loaded afresh, takes the same steps; each
    step's loss (step_floors) and each weight after them against the reference's. Steps amplify differences (an
    oscillating loss most), so this says how far two implementations transformers itself ships drift apart on the
    same run."""
    alt = _dropout_off(load_reference(s.ckpt, s.cfg, s.base[0], s.base[1], s.alt_attn))
    names = {n: n for n, _ in alt.named_parameters()}
    moments = s.moments_dir(f"reference-{s.alt_attn}")
    losses = train_steps(alt, names, s.cfg, _ref_loss, s.ids_on(s.base[1]), s.tc, moments)
    weights = {f"weight.{n}": metrics(p.detach(), ref_weights[n]) for n, p in alt.named_parameters()}
    del alt
    gc.collect()
    return step_floors(losses, ref_steps), weights


def _reference_side(s: Setup, noise_floor: bool, spill_bytes: int | None) -> ReferenceRun:
    """1. The reference: its gradients, its noise floor per configuration, then its training run and the steps'
    floor. What is kept of it: its gradients and trained weights (spilled to disk for a large model)."""
    L, base = s.cfg.n_layer, s.base
    t0 = time.perf_counter()
    s.say("loading transformers' reference")
    ref = _dropout_off(load_reference(s.ckpt, s.cfg, base[0], base[1], s.reference_attn))
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    s.say("reference gradients")
    run = ReferenceRun(want=reference_grads(ref, s.ids_on(base[1]), L), order=[n for n, _ in ref.named_parameters()])
    if spills(run.want.params, spill_bytes):
        s.spill_dir = tempfile.TemporaryDirectory(prefix="gpt2port-grads-")
        s.say(f"reference gradients spilled to {s.spill_dir.name}")
        run.want.params = SpilledTensors(dict(run.want.params), Path(s.spill_dir.name) / "grads.safetensors")
        gc.collect()
    t_grad = time.perf_counter() - t0
    t0 = time.perf_counter()
    if noise_floor:
        for dt, dev in s.configs:
            s.say(f"noise floor {dtype_name(dt)}/{dev}")
            same = (dt, dev) == base
            ref_c = ref if dev == base[1] else copy.deepcopy(ref).to(device=dev)  # float32 weights, dt by autocast
            impls = [s.alt_attn] if same else [s.reference_attn, s.alt_attn]
            floors = [_floor_of(ref_c, i, s.ids_on(dev), L, run.want, dt) for i in impls]
            run.floors[(dt, dev)] = _furthest(floors)
            how = "" if dt == torch.float32 else " autocast"
            run.floor_desc[(dt, dev)] = (
                f"transformers {' / '.join(f'{i} {dtype_name(dt)}{how} {dev}' for i in impls)} against the reference "
                f"({s.reference_attn} float32 {base[1]}); the furthest at each point"
            )
            ref.set_attn_implementation(s.reference_attn)
            del ref_c
            gc.collect()
    t_floor = time.perf_counter() - t0
    t0 = time.perf_counter()
    if s.tc.steps:
        s.say(f"reference: {s.tc.steps} AdamW steps")
        names = {n: n for n, _ in ref.named_parameters()}
        run.steps = train_steps(ref, names, s.cfg, _ref_loss, s.ids_on(base[1]), s.tc, s.moments_dir("reference"))
        run.weights = {n: p.detach() for n, p in ref.named_parameters()}
        if s.spill_dir is not None:  # the reference's trained weights wait on disk while the scratch model trains
            run.weights = SpilledTensors(dict(run.weights), Path(s.spill_dir.name) / "weights.safetensors")
    t_train = time.perf_counter() - t0
    del ref
    gc.collect()
    t0 = time.perf_counter()
    if s.tc.steps and noise_floor:
        s.say(f"step noise floor: transformers ({s.alt_attn}) takes the same {s.tc.steps} AdamW steps")
        run.step_floor, run.weight_floor = _step_floor(s, run.steps, run.weights)
    run.timings = {
        "reference_load_s": t_load,
        "reference_backward_s": t_grad,
        "noise_floor_s": t_floor,
        "reference_train_s": t_train,
        "step_noise_floor_s": time.perf_counter() - t0,
    }
    return run


def _same_parameters(loaded: list[str], changed: list[str]) -> None:
    """The backward compares every parameter's gradient with transformers': a --scratch change that removes one (a
    weight kept as a buffer) or adds one (a learned scale) has no counterpart to compare."""
    gone = [n for n in loaded if n not in set(changed)]
    new = [n for n in changed if n not in set(loaded)]
    if gone or new:
        what = f"has no parameter {gone[0]} (a buffer now?)" if gone else f"has a parameter {new[0]} of its own"
        raise UsageError(
            f"the scratch transform's model {what}: the backward compares each parameter's gradient with "
            "transformers', so it needs the same parameters (the forward report, without --backward, checks the rest)"
        )


def _scratch_side(s: Setup, ref: ReferenceRun, dt: torch.dtype, dev: torch.device, report: BackwardReport) -> None:
    """2. One configuration of the scratch model against the reference: loss, gradients, steps, weights."""
    L, tol, lab = s.cfg.n_layer, BACKWARD_TOLERANCES[dtype_name(dt)], f"{dtype_name(dt)}/{dev}"
    t0 = time.perf_counter()
    s.say(f"scratch {lab}: load")
    scratch, _ = from_pretrained(s.model, dtype=torch.float32, device=dev, revision=s.revision, layout="checkpoint")
    loaded = [n for n, _ in scratch.named_parameters()]
    scratch = transformed(scratch, s.transform)
    _same_parameters(loaded, [n for n, _ in scratch.named_parameters()])
    scratch.set_attn_impl(s.attn)  # type: ignore[arg-type]
    scratch.set_kernels(s.kernels).set_dropout(0.0).train().requires_grad_(True)  # type: ignore[arg-type]
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    s.say(f"scratch {lab}: gradients")
    with amp(dt, dev):
        got = scratch_grads(scratch, s.ids_on(dev), L)
    t_grad = time.perf_counter() - t0
    report.loss_scratch, report.loss_reference = got.loss, ref.want.loss
    report.loss_rel = rel(got.loss, ref.want.loss)
    report.loss_tolerance = tol.loss_rel
    fl = ref.floors.get((dt, dev))
    report.noise_floor = ref.floor_desc.get((dt, dev))
    if fl is not None:
        report.loss_noise_rel = fl["loss"][0]
        if dt != torch.float32:  # judged under autocast only, where it is the dtype's distance (BackwardReport)
            v = verdict(report.loss_rel, report.loss_noise_rel)
            report.loss_noise_verdict, report.loss_within_noise = v.text, v.within
    fwd = TOLERANCES[dtype_name(dt)]  # the forward's activations, under the forward report's tolerances
    for n in act_points(L, s.kernels == "reference"):
        report.points.append(_point(f"act.{n}", got.values[n], ref.want.values[n], fwd.for_point(n), fl))
    for n, y in ref.want.params.items():
        report.points.append(_point(f"grad.{n}", got.params[n], y, tol.grad, fl))
    for n in act_points(L, s.kernels == "reference"):
        report.points.append(_point(f"act_grad.{n}", got.acts[n], ref.want.acts[n], tol.act_grad, fl))
    report.layers = _layers(report.points, L)
    del got
    scratch.zero_grad(set_to_none=True)
    gc.collect()
    t0 = time.perf_counter()
    if s.tc.steps:
        s.say(f"scratch {lab}: {s.tc.steps} AdamW steps")

        def in_hf_layout(m: torch.nn.Module = scratch) -> Iterator[torch.Tensor]:
            grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in m.named_parameters()}
            made = dict(adapter.hf_tensors(grads, m.config, prefix=PREFIX))
            return (made[n]() for n in ref.order if n in made)

        loss = _under(lambda: amp(dt, dev), _scratch_loss)
        where = s.moments_dir(f"scratch-{dtype_name(dt)}-{dev.type}")
        losses = train_steps(scratch, hf_name_of_scratch(s.cfg), s.cfg, loss, s.ids_on(dev), s.tc, where, in_hf_layout)
        floored = (dt, dev) == s.base and bool(ref.step_floor)  # the floor was taken in the reference's dtype/device
        for k, (mine_k, ref_k) in enumerate(zip(losses, ref.steps)):
            a, b = mine_k.total, ref_k.total
            d = rel(a, b)
            st = StepResult(k, a, b, d, tol.step_loss_rel, bool(d <= tol.step_loss_rel))
            if floored:
                st.noise_rel, st.within_noise = ref.step_floor[k], verdict(d, ref.step_floor[k]).within
            report.steps.append(st)
        mine = LazyTensors(
            adapter.hf_tensors({n: p.detach() for n, p in scratch.named_parameters()}, scratch.config, PREFIX)
        )
        for n, y in ref.weights.items():
            w = _point(f"weight.{n}", mine[n], y, tol.weight, ref.weight_floor if floored else None)
            # Where a gradient is near zero (a key bias: softmax ignores it) AdamW turns rounding into steps of about
            # lr, so a weight may pass its tolerance by that much and still be no further from the reference than
            # transformers' own run with its other attention kernel is: that weight passes.
            w.passed = w.passed or w.within_noise is True
            report.weights.append(w)
        report.train = {
            **asdict(s.tc),
            "optimizer": ADAMW_NAME,
            "batch": "the prompts, every step (each a batch of one; loss = their mean)",
        }
    report.timings = {
        **ref.timings,
        "scratch_load_s": t_load,
        "scratch_backward_s": t_grad,
        "scratch_train_s": time.perf_counter() - t0,
    }
    del scratch
    gc.collect()


def run_backward(
    model: str,
    prompts: Sequence[str] | Inputs | None,
    dtypes: str | Sequence[str] = "float32",
    devices: str | Sequence[str] = "cpu",
    reference_attn: str = "eager",
    attn: str = "auto",
    noise_floor: bool = True,
    train: TrainConfig | None = None,
    revision: str | None = None,
    tokenizer: str | None = None,
    log: Callable[[str], None] | None = None,
    spill_bytes: int | None = SPILL_BYTES,
    disk_moments: bool | None = None,
    kernels: str = "reference",
    transform: Callable[[GPT2], GPT2 | None] | None = None,
) -> BackwardSweep:
    import transformers

    tc = train or TrainConfig()
    if tc.steps < 0:
        raise UsageError(f"--train-steps must be a positive number of steps, got {tc.steps}")
    dts = _unique(parse_dtype(d) for d in parse_list(dtypes))
    devs = _unique(parse_device(d) for d in parse_list(devices))
    if attn == "auto":  # like for like: the hand-written path does the eager reference's arithmetic, op for op
        attn = "manual" if reference_attn == "eager" else "sdpa"
    tv = transformers.__version__
    run_versions = versions(devs)
    sd, rep = read_checkpoint(model, revision)  # lazy: validates the checkpoint before transformers loads it
    ckpt, cfg = rep.checkpoint, rep.config
    del sd, rep
    inputs = _as_inputs(prompts)  # the default prompts are stored token ids: no tokenizer needed for them
    tok = tokenizer_for(ckpt.root, tokenizer) if inputs.needs_tokenizer else None
    s = Setup(
        model=str(model),
        revision=revision,
        ckpt=ckpt,
        cfg=cfg,
        ids_py=resolve(inputs, lambda text: tok.encode(text), cfg.n_positions, cfg.vocab_size),
        base=(torch.float32, devs[0]),
        configs=[(dt, dev) for dev in devs for dt in dts],
        reference_attn=reference_attn,
        alt_attn="sdpa" if reference_attn == "eager" else "eager",
        attn=attn,
        kernels=kernels,
        tc=tc,
        say=log or (lambda _msg: None),
        transform=transform,
    )
    if tc.steps:
        if disk_moments is None:  # weights, gradients and AdamW's two moments against what is free
            on_cpu = all(d.type == "cpu" for d in devs)
            disk_moments = on_cpu and 16 * cfg.num_params() > DISK_MOMENTS_SHARE * available_cpu_memory()[0]
        s.moments_root = tempfile.TemporaryDirectory(prefix="gpt2port-adamw-") if disk_moments else None
    reports = []
    try:
        with exact_matmuls():
            ref = _reference_side(s, noise_floor, spill_bytes)
            for dt, dev in s.configs:
                r = BackwardReport(
                    model=s.model,
                    dtype=dtype_name(dt),
                    device=str(dev),
                    reference=f"transformers {tv} GPT2LMHeadModel ({reference_attn})",
                    reference_dtype="float32",
                    reference_device=str(s.base[1]),
                    scratch_attn=attn,
                    kernels=kernels,
                    precision="float32" if dt == torch.float32 else f"{dtype_name(dt)} autocast",
                    prompts=[t if t is not None else " ".join(map(str, i)) for t, i in zip(inputs.texts, s.ids_py)],
                    n_tokens=sum(len(i) for i in s.ids_py),
                    versions=run_versions,
                )
                _scratch_side(s, ref, dt, dev, r)
                reports.append(r)
            del ref
            gc.collect()
    finally:
        for d in (s.spill_dir, s.moments_root):
            if d is not None:
                d.cleanup()
    baseline = f"transformers {tv} GPT2LMHeadModel ({reference_attn}), float32, {s.base[1]}"
    return BackwardSweep(model=str(model), reports=reports, baseline=baseline)


def _point(name: str, x: torch.Tensor, y: torch.Tensor, tol: float, floor: dict[str, tuple] | None) -> PointResult:
    ma, nr, cos, el = metrics(x, y)
    p = PointResult(name, ma, nr, cos, el, tol, bool(nr <= tol))
    if floor is not None:
        f = floor[name]
        v = verdict(nr, f[1])
        p.noise_max_abs, p.noise_norm_rel = f[0], f[1]
        p.noise_ratio, p.within_noise, p.noise_verdict = v.ratio, v.within, v.text
    return p


def _layers(points: Sequence[PointResult], n_layer: int) -> list[LayerResult]:
    """Per layer, the worst gradient (parameters and activations together) and the worst floor there."""
    by: dict[str, list[PointResult]] = {}
    for p in points:
        by.setdefault(layer_of(p.name), []).append(p)
    out = []
    for layer in layer_order(n_layer):
        ps = by.get(layer)
        if not ps:
            continue
        worst = max(ps, key=lambda p: -1.0 if math.isnan(p.norm_rel) else p.norm_rel)
        floors = [p.noise_norm_rel for p in ps if p.noise_norm_rel is not None]
        out.append(
            LayerResult(layer, worst.name, worst.norm_rel, max(floors) if floors else None, all(p.passed for p in ps))
        )
    return out
