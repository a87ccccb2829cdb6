"""What a parity run found, as data: one PointResult per point, one Report per configuration (dtype x device), and
a Sweep holding every configuration. Every output (terminal, Markdown, JSON, PNG) is made from these.

JSON (`Sweep.to_json`): a single configuration is one Report object; a sweep is an envelope whose `configurations`
list holds one Report object each (with a `config` label) and repeats none of them at the top level. The keys are
listed in docs (README, "Parity JSON").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class PointResult:
    name: str
    max_abs: float
    norm_rel: float
    cosine: float
    elementwise_rel: float
    tolerance: float  # the norm_rel gate this point was judged by (Tolerance.for_point)
    passed: bool
    # The noise floor (checks/noise.py): transformers against itself at this point; None when not measured.
    noise_max_abs: float | None = None
    noise_norm_rel: float | None = None
    noise_ratio: float | None = None  # norm_rel / noise_norm_rel; None when the floor is 0 and the error is not
    within_noise: bool | None = None
    noise_verdict: str | None = None  # "within noise", "above x12.5", "above (reference exact here)"


def all_within_noise(points: Sequence) -> bool | None:
    """Whether every point (anything with `within_noise`: a PointResult, an eval row) is within transformers' own
    noise; None when the floor was not measured."""
    if not points or points[0].within_noise is None:
        return None
    return all(p.within_noise for p in points)


@dataclass
class Report:
    """One configuration: the scratch model in `dtype` on `device` against the reference."""

    model: str
    dtype: str
    device: str
    reference: str
    scratch_attn: str
    prompts: list[str | None]  # the text of each prompt; None where it was given as token ids only
    n_tokens: int
    token_ids: list[list[int]] = field(default_factory=list)  # what both models ran, one list per prompt
    points: list[PointResult] = field(default_factory=list)
    top1_agreement: float = 0.0  # positions with non-finite logits count as disagreements
    top1_tolerance: float = 1.0
    logprob_max_abs: float = 0.0  # NaN when any logit is non-finite
    logprob_tolerance: float = 0.0
    nonfinite_logit_positions: int = 0
    nonfinite_weights: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    detail: str = "block"  # "block" or "sublayer"
    reference_dtype: str = ""  # what the scratch model was compared with (the float32 reference in a sweep)
    reference_device: str = ""
    noise_floor: str | None = None  # what the floor is: which transformers runs, against what
    logit_lens: list[dict] = field(default_factory=list)  # per layer: top-1 of ln_f(h) @ wte.T for both models
    # the left-padded batch the `batch.` points ran: (B, T) ids and attention mask
    batch_ids: list[list[int]] = field(default_factory=list)
    batch_mask: list[list[int]] = field(default_factory=list)
    # the cached decoding `decode.logits` ran: (B, T) ids (prompts left-padded, then the fed tokens), the prompt's
    # length, and generate's step kind that ran it (plan, static, cuda graph)
    decode_ids: list[list[int]] = field(default_factory=list)
    decode_prompt_len: int = 0
    decode_path: str = ""

    @property
    def decode_shape(self) -> str:
        """ "B rows, a prefill of P tokens, N decode steps (PATH)" ("" when none ran)."""
        if not self.decode_ids:
            return ""
        B, n = len(self.decode_ids), len(self.decode_ids[0]) - self.decode_prompt_len
        rows = f"{B} row{'s' if B != 1 else ''}"
        return f"{rows}, a prefill of {self.decode_prompt_len} tokens, {n} decode steps ({self.decode_path} steps)"

    @property
    def batch_shape(self) -> str:
        """ "B x T, N real tokens" of the padded batch ("" when none ran)."""
        if not self.batch_ids:
            return ""
        return f"{len(self.batch_ids)} x {len(self.batch_ids[0])}, {sum(map(sum, self.batch_mask))} real tokens"

    @property
    def first_above_noise(self) -> str | None:
        return next((p.name for p in self.points if p.within_noise is False), None)

    @property
    def as_close_as_reference(self) -> bool | None:
        """Whether every point is within transformers' own noise (None: floor not measured)."""
        return all_within_noise(self.points)

    @property
    def top1_passed(self) -> bool:
        return self.top1_agreement >= self.top1_tolerance

    @property
    def logprob_passed(self) -> bool:
        return self.logprob_max_abs <= self.logprob_tolerance  # False for NaN

    @property
    def first_failure(self) -> str | None:
        for p in self.points:
            if not p.passed:
                return p.name
        if self.nonfinite_weights:
            return "weights"
        if not self.top1_passed:
            return "top1_agreement"
        if not self.logprob_passed:
            return "logprob_max_abs"
        return None

    @property
    def passed(self) -> bool:
        return self.first_failure is None

    def to_json(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        d["first_failure"] = self.first_failure
        if self.noise_floor is not None:
            d["first_above_noise"] = self.first_above_noise
            d["as_close_as_reference"] = self.as_close_as_reference
        return d


def label(r: Report) -> str:
    return f"{r.dtype}/{r.device}"


class Verdicts:
    """The verdict over a sweep's reports (forward or backward): all passed, and the first that did not."""

    reports: list

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.reports)

    @property
    def first_failing(self):  # noqa: ANN201
        return next((r for r in self.reports if not r.passed), None)

    @property
    def as_close_as_reference(self) -> bool | None:
        """Every configuration as close to the reference as its own noise; None where no floor was measured."""
        each = [r.as_close_as_reference for r in self.reports]
        return None if any(v is None for v in each) else all(each)

    def exit_code(self, strict_noise: bool) -> int:
        """0 when every configuration passed (and, strict_noise, is as close as the reference's noise: its figures,
        and a backward's step losses), else 1."""
        return 0 if self.passed and (not strict_noise or self.noise_failure() is None) else 1

    def noise_failure(self) -> str | None:
        """The first configuration's figure above the reference's noise, as `dtype/device name`; None if none is."""
        for r in self.reports:
            if r.as_close_as_reference is False:
                return f"{r.dtype}/{r.device} {r.first_above_noise}"
            if getattr(r, "steps_as_close_as_reference", None) is False:
                k = next(s.step for s in r.steps if s.within_noise is False)
                return f"{r.dtype}/{r.device} the loss of step {k}"
        return None


@dataclass
class Sweep(Verdicts):
    """Every configuration's Report, in the order they ran."""

    model: str
    reports: list[Report]
    baseline: str  # the reference every configuration was compared with
    is_sweep: bool

    def to_json(self) -> dict:
        """One configuration: its Report. A sweep: the verdict over all configurations and one Report each."""
        if not self.is_sweep:
            return self.reports[0].to_json()
        bad = self.first_failing
        return {
            "model": self.model,
            "passed": self.passed,
            "first_failure": bad.first_failure if bad else None,
            "first_failure_config": label(bad) if bad else None,
            "as_close_as_reference": self.as_close_as_reference,
            "baseline": self.baseline,
            "configurations": [{"config": label(r), **r.to_json()} for r in self.reports],
        }
