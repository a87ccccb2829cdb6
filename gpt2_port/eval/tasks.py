"""LAMBADA and multiple choice, as lm-evaluation-harness scores them.

- LAMBADA (lambada_openai): the last space-separated word is the target; accuracy = every target token is the
  argmax; perplexity = exp(mean over documents of the target word's NLL); also the paper's last-token accuracy;
- multiple choice (HellaSwag shape): each ending scored after one space; `acc` on the summed log-likelihood,
  `acc_norm` on the log-likelihood divided by the ending's length in characters (lm-eval's normalisation).
"""

from __future__ import annotations

import math
import re
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


def _pair(encode: Callable[[str], list[int]], eot_id: int, context: str, continuation: str, where: str) -> Request:
    """`encode_pair`, refusing a context of whitespace only: lm-eval moves it onto the continuation and is left with
    no context to condition on (its scorer asserts); `where` names the line."""
    if context and not context.strip():
        raise UsageError(f"{where}: the context is only whitespace (expected some text, or none at all)")
    return encode_pair(encode, eot_id, context, continuation)


def lambada_requests(docs: list[dict], encode: Callable[[str], list[int]], eot_id: int, flag: str) -> list[Request]:
    """lambada_openai: context = the text up to its last space, target = " " + the last word."""
    reqs = []
    for d in docs:
        words = d["text"].split(" ")
        r = _pair(encode, eot_id, " ".join(words[:-1]), " " + words[-1], f"{flag}: line {d['_line']}")
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


# HellaSwag's own rows (rowanz/hellaswag's JSONL, or Rowan/hellaswag exported) carry these fields: lm-eval builds its
# prompt from them rather than from `ctx`
HELLASWAG_FIELDS = ("activity_label", "ctx_a", "ctx_b")
_BRACKETED = re.compile(r"\[.*?\]")


def _hellaswag_clean(text: str) -> str:
    """lm-eval's hellaswag `preprocess`: stripped, " [title]" as a full stop, the other WikiHow markup ([header],
    [step], [substeps], ...) dropped, double spaces made single (once, as lm-eval does)."""
    text = text.strip().replace(" [title]", ". ")
    return _BRACKETED.sub("", text).replace("  ", " ")


def is_hellaswag_row(doc: dict) -> bool:
    return all(isinstance(doc.get(k), str) for k in HELLASWAG_FIELDS)


def hellaswag_prompt(doc: dict) -> tuple[str, list[str]]:
    """lm-eval's hellaswag `process_docs`: the query "activity_label: ctx_a Ctx_b" (ctx_b through str.capitalize,
    which also lowercases the rest) and each ending, cleaned of WikiHow's markup."""
    query = _hellaswag_clean(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
    return query, [_hellaswag_clean(e) for e in doc["endings"]]


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
    docs: list[dict], encode: Callable[[str], list[int]], eot_id: int, flag: str, hellaswag: bool = True
) -> list[tuple[list[Request], list[int], int]]:
    """Per question: a request per ending (" " + ending after the context), the endings' lengths in characters,
    and the label. A HellaSwag row (`is_hellaswag_row`) is asked as lm-eval asks it (`hellaswag_prompt`) unless
    `hellaswag` is False; any other row by its `ctx` and `endings` as given. UsageError naming the line for a label
    outside the endings, an empty ending or a context of whitespace only."""
    check_choice_docs(docs, flag)
    out = []
    for d in docs:
        ctx, endings, label = d["ctx"], d["endings"], d["label"]
        if hellaswag and is_hellaswag_row(d):
            ctx, endings = hellaswag_prompt(d)
            if not all(endings):
                raise UsageError(f"{flag}: line {d['_line']}: an ending is empty once its WikiHow markup is removed")
        reqs = [_pair(encode, eot_id, ctx, " " + e, f"{flag}: line {d['_line']}") for e in endings]
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
