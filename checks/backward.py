"""Backward parity: the loss, every parameter's gradient and the activation gradients of the scratch model against
transformers' GPT2LMHeadModel, the reference's own eager-vs-sdpa gradient noise, and N AdamW steps taken side by side.

Both models load the same checkpoint, dropout off, and run every prompt as its own batch of one; the loss is the mean
of the prompts' losses (labels = the prompt's ids, transformers' shift inside), so one backward gives the gradients.
The reference always runs in float32 on the first device listed; each configuration (dtype x device) of the scratch
model is compared with it. Our gradients are mapped to transformers' layout by the adapter (Conv1D transposed, q/k/v
fused into c_attn; a tied head's share is already in wte on both sides) and compared per parameter.

Memory: the reference is handled first and what is kept of it is its gradients (one copy of the parameters' size),
plus its trained weights when steps are asked for; then each scratch configuration is loaded in turn. Peak is about
three times the parameters (five with --train-steps: weights, gradients and AdamW's two moments).
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gpt2_port.config import GPT2Config
from gpt2_port.devices import dtype_name, parse_device, parse_dtype
from gpt2_port.errors import UsageError
from gpt2_port.io import adapter
from gpt2_port.io.load import read_checkpoint
from gpt2_port.io.safetensors_io import SafetensorsFile, write_safetensors
from gpt2_port.io.tokenizer import load_tokenizer
from gpt2_port.model import from_pretrained
from gpt2_port.train.memory import available_cpu_memory

from .forward import _as_inputs, _unique, parse_list
from .metrics import metrics
from .noise import verdict
from .prompts import Inputs, resolve
from .reference import load_reference
from .results import PointResult

PREFIX = "transformer."
# Above this many bytes of gradients (774M and 1.5B in float32), the reference's are kept on disk (SpilledTensors):
# the peak is then about twice the parameters instead of three times.
SPILL_BYTES = 2_000_000_000
# AdamW's moments go to disk (moments_on_disk) when weights + gradients + moments exceed this share of the free
# memory: 1.5B's 25 GB on a 24 GiB machine.
DISK_MOMENTS_SHARE = 0.8


@dataclass(frozen=True)
class GradTolerance:
    """Gates for one dtype of the scratch model against the float32 reference (norm-relative unless named _rel)."""

    grad: float  # every parameter's gradient
    act_grad: float  # the gradient at embed, each block output, ln_f, logits
    loss_rel: float  # |loss - ref| / |ref|
    step_loss_rel: float  # each training step's loss
    weight: float  # every parameter after the last step


# CPU (2-core AVX2, heavily shared; torch 2.13, transformers 5.23), the 3 default prompts (15 tokens), random
# official-layout checkpoints (gpt2-port demo-checkpoint --size SIZE --seed 0), measured with
#   gpt2-port parity DIR --backward [--train-steps 10] [--dtype float32,bfloat16]
# float32 (manual attention against eager): loss and every gradient 0.0 (bit-identical) on 124M, 355M, 774M and 1.5B
# (noise floor up to 1.1e-6); 10 steps with the clip norm over transformers' tensors (clip_grad_norm): every step's
# loss and every weight 0.0 on 124M and 1.5B. Before that change the clip factor differed in its last bit: 774M steps
# 3.0e-6, weights 3.1e-6; 1.5B steps up to 2.0e-4 by step 10. Fast kernels (--kernels fast, --train-steps 10): loss 0;
# worst gradient 8.5e-7 / 1.05e-6 / 1.19e-6 (124M / 355M / 774M, all within the noise, at most 1.84x the floor),
# worst step 5.0e-7 / 7.5e-6 / 2.1e-6, weights 5.1e-6 / 4.5e-6 / 3.1e-6. 1.5B: one gradient at 2.01x its floor, steps
# drifting to 1.2e-3 by step 9 on an oscillating loss (FAIL from step 7), weights 3.2e-4.
# bfloat16 against the float32 reference, 124M: worst beside each; every gradient within transformers' own bfloat16
# noise (floor up to 1.6e-2).
BACKWARD_TOLERANCES: dict[str, GradTolerance] = {
    "float32": GradTolerance(grad=1e-5, act_grad=1e-5, loss_rel=1e-6, step_loss_rel=1e-5, weight=1e-5),
    # worst seen 124M: grad 1.6e-2 (h.3.ln_2.weight), act_grad 1.5e-2 (embed), loss 9.7e-5, step loss 2.3e-2 (step 4,
    # loss 2.1: ten steps on one batch drift apart in bfloat16), weight 1.7e-2 after 10 steps (ln_f.bias)
    "bfloat16": GradTolerance(grad=1.5e-1, act_grad=1e-1, loss_rel=5e-3, step_loss_rel=1e-1, weight=1e-1),
    # float16 measured only on the tiny test checkpoints; its epsilon is 8x finer than bfloat16's
    "float16": GradTolerance(grad=3e-2, act_grad=2e-2, loss_rel=1e-3, step_loss_rel=2e-2, weight=2e-2),
}


@dataclass(frozen=True)
class TrainConfig:
    """torch.optim.AdamW on both sides; weight decay only on 2+-dim weights (nanoGPT's and HF Trainer's groups)."""

    steps: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip: float = 1.0


@dataclass
class StepResult:
    step: int
    loss_scratch: float
    loss_reference: float
    rel: float
    tolerance: float
    passed: bool
    noise_rel: float | None = None  # transformers' other attention taking the same steps, against the reference
    within_noise: bool | None = None


@dataclass
class LayerResult:
    layer: str  # embed, h.{i}, ln_f, head
    worst_point: str
    worst_norm_rel: float
    worst_noise_norm_rel: float | None
    passed: bool


@dataclass
class BackwardReport:
    model: str
    dtype: str
    device: str
    reference: str
    reference_dtype: str
    reference_device: str
    scratch_attn: str
    prompts: list[str]
    n_tokens: int
    kernels: str = "reference"  # the scratch model's training kernels (GPT2.set_kernels)
    loss_scratch: float = math.nan
    loss_reference: float = math.nan
    loss_rel: float = math.nan
    loss_tolerance: float = 0.0
    points: list[PointResult] = field(default_factory=list)  # grad.<hf name>, then act_grad.<point>
    layers: list[LayerResult] = field(default_factory=list)
    steps: list[StepResult] = field(default_factory=list)
    weights: list[PointResult] = field(default_factory=list)  # weight.<hf name> after the last step
    train: dict | None = None
    noise_floor: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.dtype}/{self.device}"

    @property
    def first_diverging_layer(self) -> str | None:
        """The first layer in backprop order (head, ln_f, the last block ... embed) whose gradients diverge: an
        error made in the backward pass enters there and flows down to every layer below."""
        return next((g.layer for g in reversed(self.layers) if not g.passed), None)

    @property
    def first_failure(self) -> str | None:
        if not self.loss_rel <= self.loss_tolerance:
            return "loss"
        bad = next((p.name for p in self.points if not p.passed), None)
        if bad:
            return bad
        bad_step = next((s for s in self.steps if not s.passed), None)
        if bad_step:
            return f"steps[{bad_step.step}]"
        return next((p.name for p in self.weights if not p.passed), None)

    @property
    def passed(self) -> bool:
        return self.first_failure is None

    @property
    def as_close_as_reference(self) -> bool | None:
        if not self.points or self.points[0].within_noise is None:
            return None
        return all(p.within_noise for p in self.points)

    @property
    def steps_as_close_as_reference(self) -> bool | None:
        """Every step's loss no further from the reference than transformers' own run with its other attention is
        (None without that run). The weights after the steps carry their floors too, but one sample per tensor is
        too noisy for a verdict on its own (124M, fast kernels: median ratio 1.02, a few tensors at 2-4x)."""
        if not self.steps or self.steps[0].within_noise is None:
            return None
        return all(s.within_noise for s in self.steps)

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(
            config=self.label,
            passed=self.passed,
            first_failure=self.first_failure,
            first_diverging_layer=self.first_diverging_layer,
        )
        if self.noise_floor is not None:
            d["as_close_as_reference"] = self.as_close_as_reference
            d["first_above_noise"] = next((p.name for p in self.points if p.within_noise is False), None)
        if self.steps_as_close_as_reference is not None:
            d["steps_as_close_as_reference"] = self.steps_as_close_as_reference
        return d


@dataclass
class BackwardSweep:
    model: str
    reports: list[BackwardReport]
    baseline: str

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.reports)

    @property
    def first_failing(self) -> BackwardReport | None:
        return next((r for r in self.reports if not r.passed), None)

    def to_json(self) -> dict:
        """One configuration: its report (with `kind` and `baseline`). Several: the verdict over all of them and one
        report each under `configurations`, nothing repeated at the top (the forward report's shape)."""
        if len(self.reports) == 1:
            return {**self.reports[0].to_json(), "kind": "backward", "baseline": self.baseline}
        bad = self.first_failing
        return {
            "kind": "backward",
            "model": self.model,
            "passed": self.passed,
            "first_failure": bad.first_failure if bad else None,
            "first_failure_config": bad.label if bad else None,
            "baseline": self.baseline,
            "configurations": [r.to_json() for r in self.reports],
        }


# -- names ------------------------------------------------------------------------------------------------------------


def act_points(n_layer: int, logits: bool = True) -> list[str]:
    """The activation gradients compared. Without logits when the scratch model's fast kernels fuse the head with
    the loss (asking for the logits would turn the fusion off, and it is the fused path that is measured)."""
    return ["embed", *(f"block.{i}" for i in range(n_layer)), "ln_f", *(["logits"] if logits else [])]


def layer_of(point: str) -> str:
    """grad.transformer.h.3.mlp.c_fc.weight -> h.3; act_grad.block.3 -> h.3; wte/wpe/embed -> embed; the head."""
    kind, _, name = point.partition(".")
    if kind == "act_grad":
        if name.startswith("block."):
            return "h." + name.split(".")[1]
        return {"embed": "embed", "ln_f": "ln_f", "logits": "head"}[name]
    name = name.removeprefix(PREFIX)
    if name.startswith("h."):
        return ".".join(name.split(".")[:2])
    if name.startswith(("wte.", "wpe.")):
        return "embed"
    return "ln_f" if name.startswith("ln_f.") else "head"


def layer_order(n_layer: int) -> list[str]:
    return ["embed", *(f"h.{i}" for i in range(n_layer)), "ln_f", "head"]


def hf_name_of_scratch(cfg: GPT2Config) -> dict[str, str]:
    """Scratch parameter name -> the transformers parameter it is (part of), from the adapter's one table."""
    out = {}
    for hk, _op, sks in adapter.key_table(cfg):
        hf = hk if hk == "lm_head.weight" else PREFIX + hk
        out.update({s: hf for s in sks})
    return out


def decays(hf_name: str, cfg: GPT2Config) -> bool:
    """Weight decay on 2+-dim weights only (matmul weights and embeddings; no biases, no LayerNorm): decided on
    transformers' names and shapes, so both sides' optimizer groups hold the same elements."""
    shapes = adapter.hf_shapes(cfg)
    return len(shapes[hf_name.removeprefix(PREFIX)]) >= 2


# -- one side's gradients -----------------------------------------------------------------------------------------


@dataclass
class Grads:
    loss: float
    params: Mapping[str, torch.Tensor]  # transformers' names, transformers' layout
    acts: dict[str, torch.Tensor]  # point -> activation gradients of every prompt, flattened and concatenated


def prompt_shares(ids_list: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Each (1, T) prompt with its num_items_in_batch: its summed NLL is divided by n_prompts x its T - 1 targets.
    The prompts' losses then add up to the mean of their means, and each one's backward starts from a gradient of
    exactly 1, as a training step's does (the fast kernels' fused loss makes its gradients in forward, bit for bit
    the reference's for that incoming gradient; a mean over the prompts would hand it 1/n_prompts)."""
    return [(ids, len(ids_list) * (ids.numel() - ids.shape[0])) for ids in ids_list]


def _reference_forward(
    ref: torch.nn.Module, ids: torch.Tensor, n_layer: int, num_items: int
) -> tuple[torch.Tensor, dict]:
    """Loss of one prompt on transformers, with every act point kept in the graph and its gradient retained."""
    acts: dict[str, torch.Tensor] = {}
    paths = {"embed": "transformer.drop", "ln_f": "transformer.ln_f"}
    paths.update({f"block.{i}": f"transformer.h.{i}" for i in range(n_layer)})

    def make(name: str) -> Callable:
        def hook(_m: torch.nn.Module, _inp: tuple, out: object) -> None:
            t = out[0] if isinstance(out, tuple) else out
            t.retain_grad()
            acts[name] = t

        return hook

    handles = [ref.get_submodule(p).register_forward_hook(make(n)) for n, p in paths.items()]
    try:
        out = ref(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=num_items)
    finally:
        for h in handles:
            h.remove()
    out.logits.retain_grad()
    acts["logits"] = out.logits
    return out.loss, acts


def _scratch_forward(
    model: torch.nn.Module, ids: torch.Tensor, n_layer: int, num_items: int
) -> tuple[torch.Tensor, dict]:
    with model.record(act_points(n_layer, model.kernels == "reference"), keep_graph=True) as acts:
        loss = model(ids, labels=ids, num_items_in_batch=num_items).loss
    return loss, dict(acts)


def _batch_loss(forward: Callable, model: torch.nn.Module, ids_list: Sequence[torch.Tensor], n_layer: int):
    """Mean of the prompts' losses (each prompt a batch of one; see prompt_shares) and the act points of each."""
    losses, acts = [], []
    for ids, share in prompt_shares(ids_list):
        loss, a = forward(model, ids, n_layer, share)
        losses.append(loss)
        acts.append(a)
    return torch.stack(losses).sum(), acts


def reference_grads(ref: torch.nn.Module, ids_list: Sequence[torch.Tensor], n_layer: int) -> Grads:
    ref.zero_grad(set_to_none=True)
    loss, acts = _batch_loss(_reference_forward, ref, ids_list, n_layer)
    loss.backward()
    params = {}
    for n, p in ref.named_parameters():
        params[n] = p.grad
        p.grad = None  # the dict keeps the only reference: no copy
    return Grads(loss.item(), params, _flat_act_grads(acts))


def scratch_grads(model: torch.nn.Module, ids_list: Sequence[torch.Tensor], n_layer: int) -> Grads:
    model.zero_grad(set_to_none=True)
    loss, acts = _batch_loss(_scratch_forward, model, ids_list, n_layer)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    missing = [n for n, g in grads.items() if g is None]
    if missing:
        raise AssertionError(f"scratch parameters without a gradient: {missing}")
    # transformers' layout (q/k/v fused, Conv1D transposed), one tensor at a time when read: no second full copy
    mapped = LazyTensors(adapter.hf_tensors(grads, model.config, prefix=PREFIX))
    return Grads(loss.item(), mapped, _flat_act_grads(acts))


class LazyTensors(Mapping[str, torch.Tensor]):
    """name -> tensor, each made when it is read (from adapter.hf_tensors' makers)."""

    def __init__(self, makers: Sequence[tuple[str, Callable[[], torch.Tensor]]]) -> None:
        self._makers = dict(makers)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._makers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


class SpilledTensors(Mapping[str, torch.Tensor]):
    """name -> tensor, written once to a safetensors file and read back zero-copy from its mapping: the reference's
    gradients of a large model stay on disk (reclaimable page cache) instead of in the process's memory."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        write_safetensors(path, [(n, tuple(t.shape), t.dtype, lambda t=t: t) for n, t in tensors.items()])
        tensors.clear()  # the caller's dict held the only references
        self._file = SafetensorsFile(path)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._file.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file.keys())

    def __len__(self) -> int:
        return len(self._file.keys())


def _flat_act_grads(acts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for name in acts[0]:
        out[name] = torch.cat([a[name].grad.detach().to("cpu").flatten() for a in acts])
    return out


# -- training -------------------------------------------------------------------------------------------------------


def moments_on_disk(opt: torch.optim.Optimizer, directory: Path) -> None:
    """Give AdamW its state before the first step, as it would make it (step 0, both moments zero), with the moments
    in file-backed shared mappings under `directory` (one file per parameter): the kernel writes their pages back
    and evicts them under memory pressure, so weights + gradients + moments of 1.5B (25 GB in float32) run on a
    24 GiB machine. The arithmetic is torch's own; only where the moments live changes."""
    scalar = torch.get_default_dtype()  # torch.optim keeps `step` as a scalar tensor of the default dtype
    need = 2 * sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])
    free = shutil.disk_usage(directory).free
    if need > free:  # a mapping that cannot be backed by the disk dies with SIGBUS mid-step: refuse up front
        raise UsageError(
            f"AdamW's moments on disk need {need / 2**30:.1f} GiB in {directory}, {free / 2**30:.1f} GiB free: "
            "free space there (or set TMPDIR to a larger disk)"
        )
    k = 0
    for group in opt.param_groups:
        for p in group["params"]:
            moments = {}
            for name in ("exp_avg", "exp_avg_sq"):
                path = directory / f"{k:05d}.{name}.bin"
                moments[name] = torch.from_file(str(path), shared=True, size=p.numel(), dtype=p.dtype).view_as(p)
            opt.state[p] = {"step": torch.tensor(0.0, dtype=scalar), **moments}
            k += 1


def train_steps(
    model: torch.nn.Module,
    hf_names: dict[str, str],
    cfg: GPT2Config,
    forward: Callable,
    ids_list: Sequence[torch.Tensor],
    tc: TrainConfig,
    moments_dir: Path | None = None,
    clip_layout: Callable[[], Iterator[torch.Tensor]] | None = None,
) -> list[float]:
    """N AdamW steps on the same batch (llm.c's check); each step's loss before its update.

    hf_names: the model's parameter name -> transformers' name; the decay groups are decided on the latter.
    moments_dir: keep AdamW's moments on disk there (moments_on_disk), for models whose training state does not fit.
    clip_layout: the gradients as transformers holds them (one at a time, in its parameter order), for the clip norm;
    None: the model's own gradients are transformers' (the reference itself). See clip_grad_norm.
    """
    named = list(model.named_parameters())
    decay = [p for n, p in named if decays(hf_names[n], cfg)]
    no_decay = [p for n, p in named if not decays(hf_names[n], cfg)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr,
        betas=tc.betas,
        eps=tc.eps,
    )
    if moments_dir is not None:
        moments_on_disk(opt, moments_dir)
    params = [p for _, p in named]
    losses = []
    for _ in range(tc.steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.stack([forward(model, ids, share) for ids, share in prompt_shares(ids_list)]).sum()
        loss.backward()
        layout = clip_layout() if clip_layout is not None else (p.grad for p in params if p.grad is not None)
        clip_grad_norm(params, layout, tc.clip)
        opt.step()
        losses.append(loss.item())
    del opt
    if moments_dir is not None:  # this run's moments are done with: the next run's need the disk
        shutil.rmtree(moments_dir, ignore_errors=True)
    model.zero_grad(set_to_none=True)
    return losses


def clip_grad_norm(params: Sequence[torch.Tensor], layout: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s arithmetic (each gradient's 2-norm, the norm of those norms, the gradients
    scaled by min(1, max_norm / (total + 1e-6))), with the total norm taken over `layout`: the same gradients in
    transformers' tensors and order. The global norm is the same number either way, but its rounding depends on how
    the elements are grouped and summed; summed over our separate q/k/v it differs from transformers' one c_attn in
    the last bit, and ten AdamW steps of a large model amplify that (1.5B: 2e-4 on the loss by step 10). Summed
    the same way, the clip factor is the same float, so the steps compare the models and not the bookkeeping."""
    norms = [torch.linalg.vector_norm(g.contiguous(), 2.0) for g in layout]  # one tensor made at a time
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device))
    return total


def _ref_loss(ref: torch.nn.Module, ids: torch.Tensor, num_items: int) -> torch.Tensor:
    return ref(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=num_items).loss


def _scratch_loss(model: torch.nn.Module, ids: torch.Tensor, num_items: int) -> torch.Tensor:
    return model(ids, labels=ids, num_items_in_batch=num_items).loss


# -- the run --------------------------------------------------------------------------------------------------------


def _dropout_off(ref: torch.nn.Module) -> torch.nn.Module:
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):
        setattr(ref.config, k, 0.0)
    return ref.train().requires_grad_(True)


def _floor_of(ref: torch.nn.Module, impl: str, ids_list, n_layer: int, want: Grads) -> dict[str, tuple]:
    """Metrics of transformers with attention `impl` (in the ref's current dtype/device) against the reference."""
    ref.set_attn_implementation(impl)
    g = reference_grads(ref, ids_list, n_layer)
    out = {f"grad.{n}": metrics(t, want.params[n]) for n, t in g.params.items()}
    out.update({f"act_grad.{n}": metrics(t, want.acts[n]) for n, t in g.acts.items()})
    out["loss"] = (_rel(g.loss, want.loss),)
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def _step_floor(
    ckpt,  # noqa: ANN001 (a resolved checkpoint)
    cfg: GPT2Config,
    base: tuple[torch.dtype, torch.device],
    impl: str,
    ids_list: Sequence[torch.Tensor],
    tc: TrainConfig,
    ref_steps: Sequence[float],
    ref_weights: Mapping[str, torch.Tensor],
    moments_dir: Path | None,
) -> tuple[list[float], dict[str, tuple]]:
    """The noise floor of the steps: transformers with attention `impl`, loaded afresh, takes the same steps; each
    step's loss and each weight after them against the reference's. Steps amplify differences (an oscillating loss
    most), so this says how far two implementations transformers itself ships drift apart on the same run. A step's
    floor is the largest drift up to it: two runs whose losses meet again at one step (rounded to the same float)
    have not met again in their weights."""
    alt = _dropout_off(load_reference(ckpt, cfg, base[0], base[1], impl))
    names = {n: n for n, _ in alt.named_parameters()}
    losses = train_steps(alt, names, cfg, _ref_loss, ids_list, tc, moments_dir)
    weights = {f"weight.{n}": metrics(p.detach(), ref_weights[n]) for n, p in alt.named_parameters()}
    del alt
    gc.collect()
    return list(itertools.accumulate((_rel(a, b) for a, b in zip(losses, ref_steps)), max)), weights


def _furthest(floors: Sequence[dict[str, tuple]]) -> dict[str, tuple]:
    return {k: max((f[k] for f in floors), key=lambda m: m[0] if k == "loss" else m[1]) for k in floors[0]}


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
) -> BackwardSweep:
    import transformers

    say = log or (lambda _msg: None)
    tc = train or TrainConfig()
    if tc.steps < 0:
        raise UsageError(f"--train-steps must be a positive number of steps, got {tc.steps}")
    dts = _unique(parse_dtype(d) for d in parse_list(dtypes))
    devs = _unique(parse_device(d) for d in parse_list(devices))
    configs = [(dt, dev) for dev in devs for dt in dts]
    base = (torch.float32, devs[0])
    if attn == "auto":  # like for like: the hand-written path does the eager reference's arithmetic, op for op
        attn = "manual" if reference_attn == "eager" else "sdpa"
    alt_attn = "sdpa" if reference_attn == "eager" else "eager"
    tv = transformers.__version__
    versions = {"torch": torch.__version__, "transformers": tv, "python": platform.python_version()}

    sd, rep = read_checkpoint(model, revision)  # lazy: validates the checkpoint before transformers loads it
    ckpt, cfg = rep.checkpoint, rep.config
    del sd, rep
    inputs = _as_inputs(prompts)  # the default prompts are stored token ids: no tokenizer needed for them
    tok = load_tokenizer(tokenizer if tokenizer is not None else ckpt.root) if inputs.needs_tokenizer else None
    ids_py = resolve(inputs, lambda text: tok.encode(text), cfg.n_positions, cfg.vocab_size)
    n_tokens = sum(len(i) for i in ids_py)
    L = cfg.n_layer

    def ids_on(dev: torch.device) -> list[torch.Tensor]:
        return [torch.tensor([i], device=dev) for i in ids_py]

    # 1. The reference: its gradients, its noise floor per configuration, then its training run.
    t0 = time.perf_counter()
    say("loading transformers' reference")
    ref = _dropout_off(load_reference(ckpt, cfg, base[0], base[1], reference_attn))
    t_ref_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    say("reference gradients")
    want = reference_grads(ref, ids_on(base[1]), L)
    spill_dir = None
    if spill_bytes is not None and sum(t.numel() * t.element_size() for t in want.params.values()) > spill_bytes:
        spill_dir = tempfile.TemporaryDirectory(prefix="gpt2port-grads-")
        say(f"reference gradients spilled to {spill_dir.name}")
        want.params = SpilledTensors(dict(want.params), Path(spill_dir.name) / "grads.safetensors")
        gc.collect()
    t_ref = time.perf_counter() - t0
    floors: dict[tuple, dict[str, tuple]] = {}
    floor_desc: dict[tuple, str] = {}
    t0 = time.perf_counter()
    if noise_floor:
        for dt, dev in configs:
            say(f"noise floor {dtype_name(dt)}/{dev}")
            same = (dt, dev) == base
            ref_c = ref if same else copy.deepcopy(ref).to(device=dev, dtype=dt)
            impls = [alt_attn] if same else [reference_attn, alt_attn]
            floors[(dt, dev)] = _furthest([_floor_of(ref_c, i, ids_on(dev), L, want) for i in impls])
            floor_desc[(dt, dev)] = (
                f"transformers {' / '.join(f'{i} {dtype_name(dt)} {dev}' for i in impls)} against the reference "
                f"({reference_attn} float32 {base[1]}); the furthest at each point"
            )
            ref.set_attn_implementation(reference_attn)
            del ref_c
            gc.collect()
    t_floor = time.perf_counter() - t0
    ref_steps: list[float] = []
    ref_weights: Mapping[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    if disk_moments is None:  # gradients and AdamW's two moments (the weights are in already) against what is free
        param_bytes = sum(t.numel() * t.element_size() for t in ref.parameters())
        on_cpu = all(d.type == "cpu" for d in devs)
        disk_moments = on_cpu and 3 * param_bytes > DISK_MOMENTS_SHARE * available_cpu_memory()[0]
    moments_root = tempfile.TemporaryDirectory(prefix="gpt2port-adamw-") if tc.steps and disk_moments else None

    def moments_dir(side: str) -> Path | None:
        if moments_root is None:
            return None
        d = Path(moments_root.name) / side
        d.mkdir()
        say(f"{side}: AdamW's moments kept on disk in {d} (the training state does not fit in memory)")
        return d

    ref_order = [n for n, _ in ref.named_parameters()]  # transformers' parameter order, for the clip norm
    if tc.steps:
        say(f"reference: {tc.steps} AdamW steps")
        ref_names = {n: n for n, _ in ref.named_parameters()}
        ref_steps = train_steps(ref, ref_names, cfg, _ref_loss, ids_on(base[1]), tc, moments_dir("reference"))
        ref_weights = {n: p.detach() for n, p in ref.named_parameters()}
        if spill_dir is not None:  # the reference's trained weights wait on disk while the scratch model trains
            ref_weights = SpilledTensors(dict(ref_weights), Path(spill_dir.name) / "weights.safetensors")
    t_ref_train = time.perf_counter() - t0
    del ref
    gc.collect()
    step_floor: list[float] = []
    weight_floor: dict[str, tuple] = {}
    t0 = time.perf_counter()
    if tc.steps and noise_floor:
        say(f"step noise floor: transformers ({alt_attn}) takes the same {tc.steps} AdamW steps")
        step_floor, weight_floor = _step_floor(
            ckpt, cfg, base, alt_attn, ids_on(base[1]), tc, ref_steps, ref_weights, moments_dir(f"reference-{alt_attn}")
        )
    t_step_floor = time.perf_counter() - t0

    # 2. Each scratch configuration against it.
    reports = []
    for dt, dev in configs:
        lab = f"{dtype_name(dt)}/{dev}"
        tol = BACKWARD_TOLERANCES[dtype_name(dt)]
        t0 = time.perf_counter()
        say(f"scratch {lab}: load")
        scratch, _ = from_pretrained(model, dtype=dt, device=dev, revision=revision)
        scratch.set_attn_impl(attn)  # type: ignore[arg-type]
        scratch.set_kernels(kernels).set_dropout(0.0).train().requires_grad_(True)  # type: ignore[arg-type]
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        say(f"scratch {lab}: gradients")
        got = scratch_grads(scratch, ids_on(dev), L)
        t_grad = time.perf_counter() - t0
        r = BackwardReport(
            model=str(model),
            dtype=dtype_name(dt),
            device=str(dev),
            reference=f"transformers {tv} GPT2LMHeadModel ({reference_attn})",
            reference_dtype="float32",
            reference_device=str(base[1]),
            scratch_attn=attn,
            kernels=kernels,
            prompts=[t if t is not None else " ".join(map(str, i)) for t, i in zip(inputs.texts, ids_py)],
            n_tokens=n_tokens,
            versions=versions,
        )
        r.loss_scratch, r.loss_reference = got.loss, want.loss
        r.loss_rel = _rel(got.loss, want.loss)
        r.loss_tolerance = tol.loss_rel
        fl = floors.get((dt, dev))
        r.noise_floor = floor_desc.get((dt, dev))
        for n, y in want.params.items():
            r.points.append(_point(f"grad.{n}", got.params[n], y, tol.grad, fl))
        for n in act_points(L, kernels == "reference"):
            r.points.append(_point(f"act_grad.{n}", got.acts[n], want.acts[n], tol.act_grad, fl))
        r.layers = _layers(r.points, L)
        del got
        scratch.zero_grad(set_to_none=True)
        gc.collect()
        t0 = time.perf_counter()
        if tc.steps:
            say(f"scratch {lab}: {tc.steps} AdamW steps")
            where = moments_dir(f"scratch-{dtype_name(dt)}-{dev.type}")

            def in_hf_layout(m: torch.nn.Module = scratch) -> Iterator[torch.Tensor]:
                grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
                made = dict(adapter.hf_tensors(grads, m.config, prefix=PREFIX))
                return (made[n]() for n in ref_order if n in made)

            names = hf_name_of_scratch(cfg)
            losses = train_steps(scratch, names, cfg, _scratch_loss, ids_on(dev), tc, where, in_hf_layout)
            floored = (dt, dev) == base and bool(step_floor)  # the floor was taken in the reference's dtype/device
            for k, (a, b) in enumerate(zip(losses, ref_steps)):
                rel = _rel(a, b)
                st = StepResult(k, a, b, rel, tol.step_loss_rel, bool(rel <= tol.step_loss_rel))
                if floored:
                    st.noise_rel, st.within_noise = step_floor[k], verdict(rel, step_floor[k]).within
                r.steps.append(st)
            mine = LazyTensors(
                adapter.hf_tensors({n: p.detach() for n, p in scratch.named_parameters()}, scratch.config, PREFIX)
            )
            for n, y in ref_weights.items():
                r.weights.append(_point(f"weight.{n}", mine[n], y, tol.weight, weight_floor if floored else None))
            r.train = {**asdict(tc), "batch": "the prompts, every step (each a batch of one; loss = their mean)"}
        t_train = time.perf_counter() - t0
        r.timings = {
            "reference_load_s": t_ref_load,
            "reference_backward_s": t_ref,
            "noise_floor_s": t_floor,
            "reference_train_s": t_ref_train,
            "step_noise_floor_s": t_step_floor,
            "scratch_load_s": t_load,
            "scratch_backward_s": t_grad,
            "scratch_train_s": t_train,
        }
        reports.append(r)
        del scratch
        gc.collect()
    del want
    gc.collect()
    if spill_dir is not None:
        spill_dir.cleanup()
    if moments_root is not None:
        moments_root.cleanup()
    baseline = f"transformers {tv} GPT2LMHeadModel ({reference_attn}), float32, {base[1]}"
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
