"""The transformers side of `gpt2-port eval --check`: the same windows, the same batches, scored by
transformers' GPT2LMHeadModel in the same run, and the differences reported against named tolerances.

The reference is asked exactly as GPT2LMHeadModel.forward computes its logits: `transformer(ids).last_hidden_state`
(after ln_f), then `lm_head` on the scored rows; the NLL comes from the same shared loss (`gpt2_port.model.loss`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from gpt2_port.config import GPT2Config
from gpt2_port.eval.perplexity import TextResult
from gpt2_port.eval.score import Scorer
from gpt2_port.eval.tasks import ChoiceResult, LambadaResult
from gpt2_port.io.load import Checkpoint

from .reference import load_reference

# Relative difference of NLL sums (per window, per document, per ending, and the total) against transformers in the
# same dtype, both with sdpa attention. Worst cases seen (CPU, torch 2.13, transformers 5.23), float32: 0.0 -- the same
# kernels in the same order give the same bits -- on every window with
#   gpt2-port eval DIR --text input.txt --check      (the first 20 kB of tiny shakespeare; DIR: tests' TINY layout)
# and on the LAMBADA/choices tests, and 0.0 on the total of 4 windows of a random 124M checkpoint
# (python -m benchmarks.eval_speed speed). Against transformers' eager attention one window at a time (the tests'
# independent reference), worst 7e-8. Reduced dtypes were not measured on this CPU-only machine; their gates are set
# from the parity command's measured logit error (norm-relative 1.1e-2 bfloat16, 1.4e-3 float16).
NLL_RTOL: dict[str, float] = {
    "float32": 1e-6,  # the target: float32 NLL equal to 1e-6 relative
    "bfloat16": 3e-2,
    "float16": 5e-3,
}


def reference_scorer(ckpt: Checkpoint, cfg: GPT2Config, dtype: torch.dtype, device: torch.device) -> Scorer:
    ref = load_reference(ckpt, cfg, dtype, device, attn="sdpa")
    return Scorer(
        "transformers",
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


@dataclass
class EvalParity:
    dtype: str
    rows: list[Row]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "passed": self.passed, "rows": [asdict(r) for r in self.rows]}

    def format(self) -> str:
        lines = [f"parity against transformers ({self.dtype}, same windows, same batches):"]
        lines.append(f"  {'quantity':<34} {'gpt2_port':>16} {'transformers':>16} {'diff':>10} {'tol':>8}")
        for r in self.rows:
            lines.append(
                f"  {r.quantity:<34} {r.ours:>16.8g} {r.reference:>16.8g} {r.diff:>10.2e} {r.tolerance:>8.0e}  "
                f"{'OK' if r.passed else 'FAIL'}"
            )
        lines.append("PASS" if self.passed else "FAIL: " + ", ".join(r.quantity for r in self.rows if not r.passed))
        return "\n".join(lines)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _nll_rows(name: str, ours: list[float], ref: list[float], total_o: float, total_r: float, tol: float) -> list[Row]:
    worst = max(range(len(ours)), key=lambda i: _rel(ours[i], ref[i]))
    d_worst, d_total = _rel(ours[worst], ref[worst]), _rel(total_o, total_r)
    return [
        Row("total nll", total_o, total_r, d_total, tol, d_total <= tol),
        Row(f"worst {name} nll (#{worst})", ours[worst], ref[worst], d_worst, tol, d_worst <= tol),
    ]


def compare_text(ours: TextResult, ref: TextResult, dtype: str) -> EvalParity:
    tol = NLL_RTOL[dtype]
    rows = _nll_rows("window", ours.window_nll, ref.window_nll, ours.nll, ref.nll, tol)
    same = ours.tokens == ref.tokens and len(ours.window_nll) == len(ref.window_nll)
    rows.append(Row("tokens scored", ours.tokens, ref.tokens, abs(ours.tokens - ref.tokens), 0, same))
    d = _rel(ours.perplexity, ref.perplexity)
    rows.append(Row("perplexity", ours.perplexity, ref.perplexity, d, tol, d <= tol))
    return EvalParity(dtype, rows)


def compare_lambada(ours: LambadaResult, ref: LambadaResult, dtype: str) -> EvalParity:
    tol = NLL_RTOL[dtype]
    so, sr = sum(ours.word_nll), sum(ref.word_nll)
    rows = _nll_rows("document", ours.word_nll, ref.word_nll, so, sr, tol)
    flips = sum(a != b for a, b in zip(ours.correct, ref.correct))
    n = len(ours.correct)
    rows.append(Row("accuracy", sum(ours.correct) / n, sum(ref.correct) / n, flips, 0, flips == 0))
    return EvalParity(dtype, rows)


def compare_choices(ours: ChoiceResult, ref: ChoiceResult, dtype: str) -> EvalParity:
    tol = NLL_RTOL[dtype]
    rows = _nll_rows("ending", ours.ending_nll, ref.ending_nll, sum(ours.ending_nll), sum(ref.ending_nll), tol)
    oj, rj = ours.to_json(), ref.to_json()
    for key, a, b in (("acc", ours.pred, ref.pred), ("acc_norm", ours.pred_norm, ref.pred_norm)):
        flips = sum(x != y for x, y in zip(a, b))
        rows.append(Row(key, oj[key], rj[key], flips, 0, flips == 0))
    return EvalParity(dtype, rows)
