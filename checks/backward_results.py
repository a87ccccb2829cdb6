"""What a backward parity run reports: per configuration the loss, every gradient (grouped by layer), the optimizer
steps and the weights after them; per sweep, one report per configuration and the verdict over them all."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .grads import layer_of
from .results import PointResult, Verdicts, all_within_noise


@dataclass
class StepResult:
    step: int
    loss_scratch: float
    loss_reference: float
    rel: float
    tolerance: float
    passed: bool
    # transformers' other attention taking the same steps, against the reference: backward.step_floors
    noise_rel: float | None = None
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
    # "float32", or "<dtype> autocast": float32 weights, the forward and backward under torch.autocast (as trainers
    # run mixed precision), against the float32 reference
    precision: str = "float32"
    loss_scratch: float = math.nan
    loss_reference: float = math.nan
    loss_rel: float = math.nan
    loss_tolerance: float = 0.0
    # the loss against the reference's own distance (the floor's transformers run against the reference at each
    # prompt's loss, the distances summed: noise.spread, a bound on how far that noise moves the loss): judged under
    # autocast, where that distance is the dtype's; in float32 shown only, since there each prompt's loss is one
    # float32 scalar from the two attentions, which often round to the same value (a floor of 0 no other code meets)
    loss_noise_rel: float | None = None
    loss_noise_verdict: str | None = None
    loss_within_noise: bool | None = None
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
    def forward_failure(self) -> str | None:
        """The first of the forward's activations (in forward order) past its tolerance: the loss and every gradient
        then differ from it, and the backward is not where the error is."""
        return next((p.name for p in self.points if p.name.startswith("act.") and not p.passed), None)

    @property
    def first_diverging_layer(self) -> str | None:
        """Where the forward first differs, as "h.0 (in the forward)"; else the first layer in backprop order (head,
        ln_f, the last block ... embed) whose gradients diverge: an error made in the backward pass enters there and
        flows down to every layer below."""
        fwd = self.forward_failure
        if fwd is not None:
            return f"{layer_of(fwd)} (in the forward)"
        return next((g.layer for g in reversed(self.layers) if not g.passed), None)

    @property
    def first_failure(self) -> str | None:
        """The loss, else the first failing gradient in backprop order (the head's first, the embeddings' last: where
        an error made in the backward pass enters, every parameter below inheriting it), else an activation
        gradient, a step, a weight after the steps."""
        if self.forward_failure is not None:
            return self.forward_failure
        if not self.loss_rel <= self.loss_tolerance:
            return "loss"
        params = [p for p in self.points if p.name.startswith("grad.")]  # in the model's order: embeddings first
        bad = next((p.name for p in reversed(params) if not p.passed), None)
        bad = bad or next((p.name for p in self.points if not p.passed), None)
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
    def judged(self) -> list[tuple[str, bool | None]]:
        """(name, within_noise) of each figure judged against the floor: the loss under autocast, then every point."""
        loss = [("loss", self.loss_within_noise)] if self.loss_within_noise is not None else []
        return loss + [(p.name, p.within_noise) for p in self.points]

    @property
    def as_close_as_reference(self) -> bool | None:
        """Every gradient, and under autocast the loss, within transformers' own noise (None: no floor measured)."""
        if all_within_noise(self.points) is None:
            return None
        return all(within for _, within in self.judged)

    @property
    def first_above_noise(self) -> str | None:
        return next((name for name, within in self.judged if within is False), None)

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
            d["first_above_noise"] = self.first_above_noise
        if self.steps_as_close_as_reference is not None:
            d["steps_as_close_as_reference"] = self.steps_as_close_as_reference
        return d


@dataclass
class BackwardSweep(Verdicts):
    model: str
    reports: list[BackwardReport]
    baseline: str

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
            "as_close_as_reference": self.as_close_as_reference,
            "baseline": self.baseline,
            "configurations": [r.to_json() for r in self.reports],
        }
