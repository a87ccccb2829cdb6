"""Zero-shot evaluation: perplexity and bits per byte of a text, LAMBADA, multiple choice.

Every quantity is a sum of per-token negative log-likelihoods from the shared loss (`loss.token_nll`) over
`windows.Request`s, batched (padded on the right: with a causal mask, real tokens never see the padding, and their
positions stay 0..T-1). The metrics are lm-evaluation-harness's:
- text: `loglikelihood_rolling` windows (or the strided window of the transformers docs); perplexity per token,
  bits per byte and byte perplexity over the UTF-8 bytes, word perplexity over len(re.split(r"\\s+", text)) words;
- LAMBADA (lambada_openai): the last space-separated word is the target; accuracy = every target token is the
  argmax; perplexity = exp(mean over documents of the target word's NLL);
- multiple choice (HellaSwag shape): each ending scored after one space; `acc` on the summed log-likelihood,
  `acc_norm` on the log-likelihood divided by the ending's length in characters (lm-eval's normalisation).

A `Scorer` is how a model is asked: (B, T) ids -> (B, T, C) final hidden states, and (N, C) -> (N, V) logits for the
scored rows only. `checks/evaluation.py` passes transformers' model through the same interface, so both score the
same windows in the same batches in one run.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CheckpointError, UsageError
from .loss import token_nll
from .windows import READ_BLOCK, Request, TextStats, read_text_pieces, rolling_requests, strided_requests, token_chunks

HEAD_ROWS = 1024  # scored rows sent through the head at a time: (1024, 50257) float32 logits = 206 MB at most
DEFAULT_BATCH_SIZE = 8


@dataclass
class Scorer:
    """A model as the evaluator calls it (see the module docstring)."""

    name: str
    hidden: Callable[[torch.Tensor], torch.Tensor]  # (B, T) ids -> (B, T, C) after ln_f
    head: Callable[[torch.Tensor], torch.Tensor]  # (N, C) -> (N, V)
    device: torch.device
    nonfinite_hint: Callable[[], str] = lambda: ""


def model_scorer(model, name: str = "gpt2_port") -> Scorer:  # noqa: ANN001 (a GPT2; imported lazily elsewhere)
    def hint() -> str:
        from .load import nonfinite_tensors

        bad = nonfinite_tensors(dict(model.state_dict()))
        if bad:
            return f"the weights hold NaN/Inf in {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}"
        return f"no weight is NaN/Inf: the activations overflowed in {str(model.dtype).removeprefix('torch.')}"

    return Scorer(name, lambda ids: model(ids, hidden_only=True), model.head, model.device, hint)


class NonFiniteLogits(CheckpointError):
    """The model produced NaN/Inf logits on a scored position: evaluating further would report garbage."""


# -- batched scoring ---------------------------------------------------------------------------------------------
def score_batch(
    scorer: Scorer,
    reqs: Sequence[Request],
    max_length: int,
    pad_id: int,
    what: str = "window",
    first: int = 0,
    want_greedy: bool = True,
) -> tuple[list[float], list[bool], list[bool]]:
    """Per request: the summed NLL of its continuation (float64 sum of float32 token NLLs), whether every
    continuation token is the argmax, and whether the last one is (both False without `want_greedy`, which saves a
    pass over the logits). `first`: the index of reqs[0] in the whole run (for error messages)."""
    inputs = [r.model_input(max_length) for r in reqs]
    B, T = len(inputs), max(len(x) for x in inputs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)  # right padding: causal attention never looks right
    rows_b: list[int] = []
    rows_t: list[int] = []
    targets: list[int] = []
    for i, (r, x) in enumerate(zip(reqs, inputs)):
        ids[i, : len(x)] = torch.tensor(x)
        n = len(r.continuation)
        if n > len(x):
            raise UsageError(f"{what} {first + i}: {n} tokens to score do not fit a window of {max_length} tokens")
        rows_b += [i] * n
        rows_t += range(len(x) - n, len(x))  # position p predicts the token at p + 1
        targets += r.continuation
    with torch.inference_mode():
        h = scorer.hidden(ids.to(scorer.device))  # (B, T, C)
        hs = h[torch.tensor(rows_b), torch.tensor(rows_t)]  # (N, C): the scored positions only
        tgt = torch.tensor(targets, device=hs.device)  # (N,)
        nll = torch.empty(len(targets), dtype=torch.float32, device=hs.device)
        hit = torch.zeros(len(targets), dtype=torch.bool, device=hs.device)
        for s in range(0, len(targets), HEAD_ROWS):
            logits = scorer.head(hs[s : s + HEAD_ROWS])  # (R, V)
            part = token_nll(logits, tgt[s : s + HEAD_ROWS])  # (R,)
            # A NaN or +Inf logit anywhere in a row makes that row's NLL NaN/Inf (log-sum-exp), so checking the R
            # NLLs catches every non-finite logit that could change a score, without another pass over R x V.
            if not bool(torch.isfinite(part).all()):
                row = s + int((~torch.isfinite(part)).nonzero()[0, 0])
                hint = scorer.nonfinite_hint()
                raise NonFiniteLogits(
                    f"{scorer.name}: non-finite logits (NaN/Inf) at {what} {first + rows_b[row]}, position "
                    f"{rows_t[row]}: the scores would be garbage{'; ' + hint if hint else ''}"
                )
            nll[s : s + HEAD_ROWS] = part
            if want_greedy:
                hit[s : s + HEAD_ROWS] = logits.argmax(-1) == tgt[s : s + HEAD_ROWS]
        owner = torch.tensor(rows_b, device=hs.device)
        sums = torch.zeros(B, dtype=torch.float64, device=hs.device).index_add_(0, owner, nll.double())
        misses = torch.zeros(B, dtype=torch.long, device=hs.device).index_add_(0, owner, (~hit).long())
    ends = torch.tensor([len(r.continuation) for r in reqs]).cumsum(0) - 1
    last_hit = hit.cpu()[ends]
    return sums.tolist(), (misses == 0).tolist(), last_hit.tolist()


def batched(items: Iterable[Request], size: int) -> Iterator[list[Request]]:
    batch: list[Request] = []
    for r in items:
        batch.append(r)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise UsageError(f"--batch-size must be a positive integer, got {batch_size}")


# -- text: rolling or strided perplexity ---------------------------------------------------------------------------
@dataclass
class TextResult:
    tokens: int = 0
    nll: float = 0.0
    bytes: int = 0
    words: int = 0
    window_nll: list[float] = field(default_factory=list)  # per window, in order (for the parity check)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / self.bytes / math.log(2)

    @property
    def byte_perplexity(self) -> float:
        return math.exp(self.nll / self.bytes)

    @property
    def word_perplexity(self) -> float:
        return math.exp(self.nll / self.words)

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "nll": self.nll,
            "perplexity": self.perplexity,
            "bytes": self.bytes,
            "bits_per_byte": self.bits_per_byte,
            "byte_perplexity": self.byte_perplexity,
            "words": self.words,
            "word_perplexity": self.word_perplexity,
            "windows": len(self.window_nll),
        }


def check_text_file(path: str | os.PathLike[str]) -> int:
    """Fail before any work on a missing, empty or non-UTF-8 file; return its size in bytes."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--text {p}: no such file (expected a UTF-8 text file)")
    size = p.stat().st_size
    if size == 0:
        raise UsageError(f"--text {p}: the file is empty (expected some UTF-8 text to score)")
    for _ in read_text_pieces(p):  # one streaming pass: decoding errors name the byte offset
        pass
    return size


def check_window_args(max_length: int, stride: int | None, n_positions: int) -> None:
    if not 0 < max_length <= n_positions:
        raise UsageError(f"--max-length must be in 1..{n_positions} (the model's context), got {max_length}")
    if stride is not None and not 0 < stride <= max_length:
        raise UsageError(f"--stride must be in 1..{max_length} (--max-length), got {stride}")


def evaluate_text(
    scorers: Sequence[Scorer],
    encode: Callable[[str], list[int]],
    path: str | os.PathLike[str],
    max_length: int,
    eot_id: int,
    stride: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
    block: int = READ_BLOCK,
) -> dict[str, TextResult]:
    """Stream `path` through rolling (or strided) windows; every scorer scores the same batches.

    `progress(bytes_read, tokens_scored)` is called after each batch. Memory stays flat as the file grows: the text
    is read and encoded in blocks, and only one batch of windows is held.
    """
    check_batch_size(batch_size)
    stats = TextStats()
    chunks = token_chunks(read_text_pieces(path, stats, block), encode)
    if stride is None:
        reqs = rolling_requests(chunks, eot_id, max_length)
    else:
        reqs = strided_requests(chunks, eot_id, max_length, stride)
    out = {s.name: TextResult() for s in scorers}
    done = 0
    for batch in batched(reqs, batch_size):
        n = sum(len(r.continuation) for r in batch)
        for s in scorers:
            sums, _, _ = score_batch(s, batch, max_length, eot_id, "window", done, want_greedy=False)
            res = out[s.name]
            res.window_nll += sums
            res.nll += sum(sums)
            res.tokens += n
        done += len(batch)
        if progress is not None:
            progress(stats.bytes_read, next(iter(out.values())).tokens)
    for res in out.values():
        if res.tokens == 0:
            raise UsageError(f"--text {path}: encodes to no tokens (expected some text to score)")
        res.bytes, res.words = stats.bytes, stats.words
    return out


# -- JSONL tasks ---------------------------------------------------------------------------------------------------
def read_jsonl(path: str | os.PathLike[str], flag: str, fields: dict[str, type]) -> list[dict]:
    """Every line of `path` as an object holding `fields` of the given types; UsageError naming the line."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{flag} {p}: no such file (expected JSON lines)")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{flag} {p}: not UTF-8 ({e.reason} at byte {e.start}); expected JSON lines") from None
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{flag} {p}: line {n} is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(doc, dict):
            raise UsageError(f"{flag} {p}: line {n} is a JSON {type(doc).__name__}, expected an object")
        for key, typ in fields.items():
            if key not in doc:
                raise UsageError(f"{flag} {p}: line {n} has no {key!r} field (expected {', '.join(fields)})")
            if not isinstance(doc[key], typ) or (typ is int and isinstance(doc[key], bool)):
                raise UsageError(
                    f"{flag} {p}: line {n}: {key!r} is a {type(doc[key]).__name__}, expected a {typ.__name__}"
                )
        doc["_line"] = n
        docs.append(doc)
    if not docs:
        raise UsageError(f"{flag} {p}: the file has no lines (expected one JSON object per line)")
    return docs


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


def evaluate_lambada(
    scorers: Sequence[Scorer],
    reqs: list[Request],
    max_length: int,
    eot_id: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, LambadaResult]:
    check_batch_size(batch_size)
    out = {s.name: LambadaResult() for s in scorers}
    done = 0
    for batch in batched(reqs, batch_size):
        for s in scorers:
            sums, greedy, last = score_batch(s, batch, max_length, eot_id, "document", done)
            res = out[s.name]
            res.word_nll += sums
            res.correct += greedy
            res.last_token_correct += last
            res.target_tokens += sum(len(r.continuation) for r in batch)
        done += len(batch)
        if progress is not None:
            progress(done, len(reqs))
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
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, ChoiceResult]:
    check_batch_size(batch_size)
    flat = [r for reqs, _, _ in questions for r in reqs]
    nll: dict[str, list[float]] = {s.name: [] for s in scorers}
    for batch in batched(flat, batch_size):
        done = len(next(iter(nll.values())))
        for s in scorers:
            nll[s.name] += score_batch(s, batch, max_length, eot_id, "ending", done, want_greedy=False)[0]
        if progress is not None:
            progress(len(next(iter(nll.values()))), len(flat))
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
