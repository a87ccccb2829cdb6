"""LAMBADA and multiple choice, as lm-evaluation-harness scores them.

- LAMBADA (lambada_openai): the last space-separated word is the target; accuracy = every target token is the
  argmax; perplexity = exp(mean over documents of the target word's NLL); also the paper's last-token accuracy;
- multiple choice (HellaSwag shape): each ending scored after one space; `acc` on the summed log-likelihood,
  `acc_norm` on the log-likelihood divided by the ending's length in characters (lm-eval's normalisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import UsageError
from .score import DEFAULT_BATCH_SIZE, Scorer, check_batch_size, longest_first, score_batch
from .windows import Request


def encode_pair(encode: Callable[[str], list[int]], eot_id: int, context: str, continuation: str) -> Request:
    """lm-eval's `_encode_pair`: trailing spaces of the context move to the continuation; context + continuation is
    encoded as one text and the continuation's tokens are those after the context's. An empty context is
    <|endoftext|>."""
    if not context:
        return Request([eot_id], encode(continuation))
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(context + continuation)
    ctx = encode(context)
    return Request(ctx, whole[len(ctx) :])


@dataclass
class LambadaResult:
    word_nll: list[float] = field(default_factory=list)  # per document: the target word's NLL
    correct: list[bool] = field(default_factory=list)  # every target token is the argmax
    last_token_correct: list[bool] = field(default_factory=list)  # the target's last token is the argmax
    target_tokens: int = 0

    def to_json(self) -> dict:
        n = len(self.correct)
        return {
            "n": n,
            "accuracy": sum(self.correct) / n,
            "perplexity": math.exp(sum(self.word_nll) / n),
            "nll": sum(self.word_nll),
            "target_tokens": self.target_tokens,
            "accuracy_last_token": sum(self.last_token_correct) / n,
        }


def lambada_requests(docs: list[dict], encode: Callable[[str], list[int]], eot_id: int, flag: str) -> list[Request]:
    """lambada_openai: context = the text up to its last space, target = " " + the last word."""
    reqs = []
    for d in docs:
        words = d["text"].split(" ")
        r = encode_pair(encode, eot_id, " ".join(words[:-1]), " " + words[-1])
        if not r.continuation:
            raise UsageError(f"{flag}: line {d['_line']}: the last word encodes to no tokens")
        reqs.append(r)
    return reqs


def scored_tokens(reqs: Sequence[Request]) -> int:
    """The tokens a list of requests scores: what a progress bar over them counts to."""
    return sum(len(r.continuation) for r in reqs)


def evaluate_lambada(
    scorers: Sequence[Scorer],
    reqs: list[Request],
    max_length: int,
    eot_id: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int], None] | None = None,
) -> dict[str, LambadaResult]:
    """`progress(target tokens scored)` after each batch (of `scored_tokens(reqs)`). Batches are made longest
    document first (`longest_first`); the results are in the documents' order."""
    check_batch_size(batch_size)
    n = len(reqs)
    out = {s.name: LambadaResult([0.0] * n, [False] * n, [False] * n, scored_tokens(reqs)) for s in scorers}
    scored = 0
    for idx in longest_first(reqs, max_length, batch_size):
        batch = [reqs[i] for i in idx]
        for s in scorers:
            sums, greedy, last = score_batch(s, batch, max_length, eot_id, "document", idx)
            res = out[s.name]
            for j, i in enumerate(idx):
                res.word_nll[i], res.correct[i], res.last_token_correct[i] = sums[j], greedy[j], last[j]
        scored += sum(len(r.continuation) for r in batch)
        if progress is not None:
            progress(scored)
    return out


@dataclass
class ChoiceResult:
    labels: list[int] = field(default_factory=list)
    pred: list[int] = field(default_factory=list)  # argmax of the summed log-likelihood
    pred_norm: list[int] = field(default_factory=list)  # argmax of the log-likelihood per character
    ending_nll: list[float] = field(default_factory=list)  # every ending of every question, in order

    def to_json(self) -> dict:
        n = len(self.labels)
        return {
            "n": n,
            "acc": sum(p == y for p, y in zip(self.pred, self.labels)) / n,
            "acc_norm": sum(p == y for p, y in zip(self.pred_norm, self.labels)) / n,
            "normalisation": "characters",
        }


def check_choice_docs(docs: list[dict], flag: str) -> None:
    """Endings a non-empty list of non-empty strings, and the label one of them (UsageError naming the line)."""
    for d in docs:
        endings, label, n = d["endings"], d["label"], d["_line"]
        if not endings or not all(isinstance(e, str) and e for e in endings):
            raise UsageError(f"{flag}: line {n}: 'endings' must be a non-empty list of non-empty strings")
        if not 0 <= label < len(endings):
            raise UsageError(
                f"{flag}: line {n}: label {label} is outside the {len(endings)} endings "
                f"(expected 0..{len(endings) - 1})"
            )


def choice_requests(
    docs: list[dict], encode: Callable[[str], list[int]], eot_id: int, flag: str
) -> list[tuple[list[Request], list[int], int]]:
    """Per question: a request per ending (" " + ending after the context), the endings' lengths in characters,
    and the label. UsageError naming the line for a label outside the endings or an empty ending."""
    check_choice_docs(docs, flag)
    out = []
    for d in docs:
        endings, label = d["endings"], d["label"]
        reqs = [encode_pair(encode, eot_id, d["ctx"], " " + e) for e in endings]
        out.append((reqs, [len(e) for e in endings], label))
    return out


def _argmax(xs: Sequence[float]) -> int:
    """The first index of the largest value (numpy's argmax, which lm-eval uses)."""
    return max(range(len(xs)), key=lambda i: (xs[i], -i))


def evaluate_choices(
    scorers: Sequence[Scorer],
    questions: list[tuple[list[Request], list[int], int]],
    max_length: int,
    eot_id: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int], None] | None = None,
) -> dict[str, ChoiceResult]:
    """`progress(ending tokens scored)` after each batch (of `scored_tokens` over every question's endings). Batches
    are made longest ending first (`longest_first`) over all questions' endings."""
    check_batch_size(batch_size)
    flat = [r for reqs, _, _ in questions for r in reqs]
    nll: dict[str, list[float]] = {s.name: [0.0] * len(flat) for s in scorers}
    scored = 0
    for idx in longest_first(flat, max_length, batch_size):
        batch = [flat[i] for i in idx]
        for s in scorers:
            sums = score_batch(s, batch, max_length, eot_id, "ending", idx, want_greedy=False)[0]
            for j, i in enumerate(idx):
                nll[s.name][i] = sums[j]
        scored += sum(len(r.continuation) for r in batch)
        if progress is not None:
            progress(scored)
    out = {}
    for s in scorers:
        res = ChoiceResult(ending_nll=nll[s.name])
        i = 0
        for reqs, chars, label in questions:
            ll = [-x for x in nll[s.name][i : i + len(reqs)]]
            i += len(reqs)
            res.labels.append(label)
            res.pred.append(_argmax(ll))
            res.pred_norm.append(_argmax([x / c for x, c in zip(ll, chars)]))
        out[s.name] = res
    return out
