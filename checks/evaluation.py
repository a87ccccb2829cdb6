"""The transformers side of `gpt2-port eval --check`: the same windows, the same batches, scored by
transformers' GPT2LMHeadModel in the same run, and the differences reported against named tolerances.

The reference is asked exactly as GPT2LMHeadModel.forward computes its logits: `transformer(ids).last_hidden_state`
(after ln_f), then `lm_head` on the scored rows; the NLL comes from the same shared loss (`gpt2_port.model.loss`).

The noise floor: transformers with its eager attention scores the same windows too, and each difference is shown
beside the same difference between transformers' two kernels (eager against sdpa), marked within or above it
(`noise.verdict`, NOISE_MARGIN). A sum's floor (the total NLL, the perplexity) is the sum of the per-item
distances, not the distance of the two sums, whose signed errors cancel by chance. Pass and fail stay the
tolerances'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from gpt2_port.config import GPT2Config
from gpt2_port.eval.perplexity import TextResult
from gpt2_port.eval.score import Scorer
from gpt2_port.eval.tasks import ChoiceResult, LambadaResult
from gpt2_port.io.load import Checkpoint

from .metrics import rel, relative
from .noise import NOISE_MARGIN, Verdict, closeness, spread, verdict
from .reference import load_reference
from .render import Table, markdown_tables, num, ok, plain_document, tol
from .results import all_within_noise

# Relative difference of NLL sums (per window, per document, per ending, and the total) against transformers in the
# same dtype, both with sdpa attention. Worst cases seen (CPU, torch 2.13, transformers 5.23), float32: 0.0 -- the same
# kernels in the same order give the same bits -- on every window with
#   gpt2-port eval DIR --text input.txt --check      (the first 20 kB of tiny shakespeare; DIR: tests' TINY layout)
# and on the LAMBADA/choices tests, and 0.0 on the total of 4 windows of a random 124M checkpoint
# (python -m benchmarks.eval_speed speed). Against transformers' eager attention one window at a time (the tests'
# independent reference), worst 7e-8. Reduced dtypes: the gates are set from the parity command's measured logit error
# (norm-relative 1.1e-2 bfloat16, 1.4e-3 float16). Worst seen on this AVX2 CPU, where the port's bf16/fp16 matmuls
# run from float32 copies (model/lowp.py), transformers 5.24, random 124M, 700 tokens of tiny shakespeare in windows
# of 128 (`eval --check --dtype D`): 1.0e-4 bfloat16, 8.2e-6 float16 (a window's NLL), each within NOISE_MARGIN of
# transformers' own eager-to-sdpa distance (worst x1.2). Not yet measured on a GPU.
NLL_RTOL: dict[str, float] = {
    "float32": 1e-6,  # the target: float32 NLL equal to 1e-6 relative
    "bfloat16": 3e-2,
    "float16": 5e-3,
}


REFERENCE = "transformers"  # the scorer the port is compared with: sdpa attention, as the port runs
FLOOR = "transformers (eager)"  # the scorer the reference's own noise is measured with
SCORER_NAMES = {"sdpa": REFERENCE, "eager": FLOOR}
FLOOR_DESC = "transformers' own eager attention against its sdpa attention, same windows and batches"


def reference_scorer(
    ckpt: Checkpoint, cfg: GPT2Config, dtype: torch.dtype, device: torch.device, attn: str = "sdpa"
) -> Scorer:
    """transformers as the evaluator asks a model, named by its attention (SCORER_NAMES)."""
    ref = load_reference(ckpt, cfg, dtype, device, attn=attn)
    return Scorer(
        SCORER_NAMES[attn],
        lambda ids: ref.transformer(input_ids=ids).last_hidden_state,
        ref.lm_head,
        device,
        vocab_size=cfg.vocab_size,
    )


@dataclass
class Row:
    quantity: str
    ours: float
    reference: float
    diff: float  # relative for NLLs; absolute (count of disagreements) for predictions
    tolerance: float
    passed: bool
    # The noise floor: the same difference between transformers' eager and sdpa scorers; None when not measured.
    floor: float | None = None
    noise_ratio: float | None = None  # diff / floor; None when the floor is 0 and the diff is not
    within_noise: bool | None = None  # diff within NOISE_MARGIN x floor
    noise_verdict: str | None = None  # "within noise", "above x4.8", "above (reference exact here)"


@dataclass
class EvalParity:
    dtype: str
    rows: list[Row]
    noise_floor: str | None = None  # what the floor is; None when it was not measured

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    @property
    def as_close_as_reference(self) -> bool | None:
        """Every difference within the reference's own noise (None without a floor)."""
        return all_within_noise(self.rows)

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "passed": self.passed,
            "noise_floor": self.noise_floor,
            "as_close_as_reference": self.as_close_as_reference,
            "rows": [asdict(r) for r in self.rows],
        }

    def noise_summary(self) -> str | None:
        """One sentence: is the port as close to transformers (sdpa) as transformers' eager attention is?"""
        if self.noise_floor is None:
            return None
        judged = [(r.quantity, r.diff, Verdict(bool(r.within_noise), r.noise_ratio)) for r in self.rows]
        head = f"as close to sdpa transformers ({self.dtype}) as transformers' own eager attention is"
        return closeness(head, judged, "figure")

    def table(self) -> Table:
        floor = self.noise_floor is not None
        cols = ["quantity", "gpt2_port", "transformers", "diff", "tol"] + (["floor", "vs floor"] if floor else [])
        t = Table(f"parity against transformers ({self.dtype}, same windows, same batches)", cols + ["result"])
        for i, r in enumerate(self.rows):
            row = [r.quantity, f"{r.ours:.8g}", f"{r.reference:.8g}", _cell(r.diff), tol(r.tolerance)]
            t.rows.append(row + ([_cell(r.floor), r.noise_verdict or "-"] if floor else []) + [ok(r.passed)])
            if not r.passed:
                t.bad.add(i)
        if floor:
            t.notes.append(
                f"noise floor: {self.noise_floor} (a total's: the sum of the items' distances); a difference within "
                f"{NOISE_MARGIN:g}x its floor counts as within"
            )
        return t

    def verdicts(self) -> list[str]:
        """The noise sentence (with a floor), then PASS or FAIL and the rows over their tolerances."""
        failed = [r.quantity for r in self.rows if not r.passed]
        summary = self.noise_summary()
        return ([summary] if summary else []) + ["PASS" if self.passed else "FAIL: " + ", ".join(failed)]

    def format(self) -> str:
        """Plain text, as checks/render.py writes every parity table."""
        return plain_document([], [self.table()], self.verdicts()).strip("\n")

    def markdown(self) -> list[str]:
        """The table as a Markdown section, then the verdicts."""
        return markdown_tables([self.table()]) + [""] + [f"- {x}" for x in self.verdicts()]


def _cell(x: float | None) -> str:
    """A difference as the table shows it: a count as a count, a relative difference as render's num."""
    return str(x) if isinstance(x, int) else num(x)


def _flips(a: Sequence[bool | int], b: Sequence[bool | int]) -> int:
    """How many verdicts (or picks) differ."""
    return sum(x != y for x, y in zip(a, b, strict=True))


def _nll_rows(
    name: str,
    ours: list[float],
    ref: list[float],
    total_o: float,
    total_r: float,
    tol: float,
    floor: list[float] | None,
) -> tuple[list[Row], float | None]:
    """The total and the worst item; and the floor's total spread in nats (None without a floor)."""
    worst = max(range(len(ours)), key=lambda i: rel(ours[i], ref[i]))
    d_worst, d_total = rel(ours[worst], ref[worst]), rel(total_o, total_r)
    rows = [
        Row("total nll", total_o, total_r, d_total, tol, d_total <= tol),
        Row(f"worst {name} nll (#{worst})", ours[worst], ref[worst], d_worst, tol, d_worst <= tol),
    ]
    if floor is None:
        return rows, None
    # a total's floor is the per-item distances summed (noise.spread) over the total (as noise.total_floor); the worst
    # item's is the floor's own worst item
    nats = spread(floor, ref)
    rows[0].floor = relative(nats, total_r)
    rows[1].floor = max(rel(f, r) for f, r in zip(floor, ref, strict=True))
    return rows, nats


def _parity(dtype: str, rows: list[Row], floor: bool) -> EvalParity:
    if not floor:
        return EvalParity(dtype, rows)
    for r in rows:
        v = verdict(r.diff, r.floor)  # type: ignore[arg-type]
        r.noise_ratio, r.within_noise, r.noise_verdict = v.ratio, v.within, v.text
    return EvalParity(dtype, rows, FLOOR_DESC)


def compare_text(ours: TextResult, ref: TextResult, dtype: str, floor: TextResult | None = None) -> EvalParity:
    """Texts and prepared splits: the NLL per window, the token count, the perplexity; beside `floor` (transformers'
    eager scorer) when given."""
    tol = NLL_RTOL[dtype]
    fl = None if floor is None else floor.window_nll
    rows, nats = _nll_rows("window", ours.window_nll, ref.window_nll, ours.nll, ref.nll, tol, fl)
    same = ours.tokens == ref.tokens and len(ours.window_nll) == len(ref.window_nll)
    rows.append(Row("tokens scored", ours.tokens, ref.tokens, abs(ours.tokens - ref.tokens), 0, same))
    d = rel(ours.perplexity, ref.perplexity)
    rows.append(Row("perplexity", ours.perplexity, ref.perplexity, d, tol, d <= tol))
    if floor is not None:
        rows[2].floor = abs(floor.tokens - ref.tokens)
        rows[3].floor = math.expm1(nats / max(ref.tokens, 1))  # type: ignore[operator]
    return _parity(dtype, rows, floor is not None)


def compare_lambada(
    ours: LambadaResult, ref: LambadaResult, dtype: str, floor: LambadaResult | None = None
) -> EvalParity:
    """LAMBADA: the target word's NLL per document and the accuracy (documents whose verdict differs)."""
    so, sr, fl = sum(ours.word_nll), sum(ref.word_nll), None if floor is None else floor.word_nll
    rows, _ = _nll_rows("document", ours.word_nll, ref.word_nll, so, sr, NLL_RTOL[dtype], fl)
    n = len(ours.correct)
    flips = _flips(ours.correct, ref.correct)
    rows.append(Row("accuracy", sum(ours.correct) / n, sum(ref.correct) / n, flips, 0, flips == 0))
    if floor is not None:
        rows[2].floor = _flips(floor.correct, ref.correct)
    return _parity(dtype, rows, floor is not None)


def compare_choices(ours: ChoiceResult, ref: ChoiceResult, dtype: str, floor: ChoiceResult | None = None) -> EvalParity:
    """Multiple choice: the NLL per ending, and acc and acc_norm (questions whose pick differs)."""
    so, sr, fl = sum(ours.ending_nll), sum(ref.ending_nll), None if floor is None else floor.ending_nll
    rows, _ = _nll_rows("ending", ours.ending_nll, ref.ending_nll, so, sr, NLL_RTOL[dtype], fl)
    oj, rj = ours.to_json(), ref.to_json()
    for key, pick in (("acc", "pred"), ("acc_norm", "pred_norm")):
        flips = _flips(getattr(ours, pick), getattr(ref, pick))
        rows.append(Row(key, oj[key], rj[key], flips, 0, flips == 0))
        if floor is not None:
            rows[-1].floor = _flips(getattr(floor, pick), getattr(ref, pick))
    return _parity(dtype, rows, floor is not None)
