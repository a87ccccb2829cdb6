"""The one batched scorer of zero-shot evaluation: requests in, summed NLL and greedy hits out.

Every quantity the evaluator reports is a sum of per-token negative log-likelihoods from the shared loss
(model/loss.py's `token_nll`) over `windows.Request`s, batched (padded on the right: with a causal mask, real tokens
never see the padding, and their positions stay 0..T-1). perplexity.py (texts) and tasks.py (LAMBADA, multiple
choice) build the requests and the metrics.

A `Scorer` is how a model is asked: (B, T) ids -> (B, T, C) final hidden states, and (N, C) -> (N, V) logits for the
scored rows only. `checks/evaluation.py` passes transformers' model through the same interface, so both score the
same windows in the same batches in one run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..devices import without_cudnn_attention
from ..errors import CheckpointError, UsageError
from ..io.load import listed, nonfinite_tensors
from ..model.loss import token_nll
from .windows import Request

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
    vocab_size: int | None = None  # ids at or above it are refused on the host (on CUDA they would assert)


def model_scorer(model, name: str = "gpt2_port") -> Scorer:  # noqa: ANN001 (a GPT2; imported lazily elsewhere)
    def hint() -> str:
        bad = nonfinite_tensors(dict(model.state_dict()))
        if bad:
            return f"the weights hold NaN/Inf in {listed(bad)}"
        return f"no weight is NaN/Inf: the activations overflowed in {str(model.dtype).removeprefix('torch.')}"

    return Scorer(
        name, lambda ids: model(ids, hidden_only=True), model.head, model.device, hint, model.config.vocab_size
    )


class NonFiniteLogits(CheckpointError):
    """The model produced NaN/Inf logits on a scored position: evaluating further would report garbage."""


# -- batched scoring ---------------------------------------------------------------------------------------------
def score_batch(
    scorer: Scorer,
    reqs: Sequence[Request],
    max_length: int,
    pad_id: int,
    what: str = "window",
    first: int | Sequence[int] = 0,
    want_greedy: bool = True,
) -> tuple[list[float], list[bool], list[bool]]:
    """Per request: the summed NLL of its continuation (float64 sum of float32 token NLLs), whether every
    continuation token is the argmax, and whether the last one is (both False without `want_greedy`, which saves a
    pass over the logits). `first`: the index of reqs[0] in the whole run, or each request's index (for error
    messages)."""
    number = (lambda i: first + i) if isinstance(first, int) else first.__getitem__
    inputs = [r.model_input(max_length) for r in reqs]
    B, T = len(inputs), max(len(x) for x in inputs)
    flat: list[int] = []  # the (B, T) ids row by row, padded on the right: causal attention never looks right
    rows_b: list[int] = []
    rows_t: list[int] = []
    targets: list[int] = []
    for i, (r, x) in enumerate(zip(reqs, inputs)):
        n = len(r.continuation)
        if n > len(x):
            raise UsageError(f"{what} {number(i)}: {n} tokens to score do not fit a window of {max_length} tokens")
        flat += x
        flat += [pad_id] * (T - len(x))
        rows_b += [i] * n
        rows_t += range(len(x) - n, len(x))  # position p predicts the token at p + 1
        targets += r.continuation
    N = len(targets)
    # The ids, the scored positions and the targets go to the device in one copy, queued before the forward: an
    # index made on the host after it would wait for the whole forward before the head could be queued. One array
    # from one list (numpy reads a list of ints ~15x faster than torch.tensor infers one: the host's share of a batch
    # matters on a GPU).
    flat += rows_b + rows_t + targets
    packed = torch.from_numpy(np.fromiter(flat, dtype=np.int64, count=len(flat)))  # (B*T + 3N,)
    V = scorer.vocab_size  # every id read or scored in 0..V-1, checked on the host (on CUDA: a device-side assert)
    if V is not None and bool((packed[: B * T] >= V).any() | (packed[B * T + 2 * N :] >= V).any() | (packed < 0).any()):
        raise UsageError(_outside_vocabulary(inputs, reqs, V, pad_id, what, number))
    with torch.inference_mode():
        on_dev = packed.to(scorer.device, non_blocking=True)
        ids_d, rb, rt, tgt = on_dev.split([B * T, N, N, N])  # (B*T,), (N,), (N,), (N,)
        with without_cudnn_attention(scorer.device):  # a batch's length differs from the last one's
            h = scorer.hidden(ids_d.view(B, T))  # (B, T, C)
        hs = h[rb, rt]  # (N, C): the scored positions only
        nll = torch.empty(N, dtype=torch.float32, device=hs.device)
        hit = torch.zeros(N, dtype=torch.bool, device=hs.device)
        for s in range(0, N, HEAD_ROWS):
            logits = scorer.head(hs[s : s + HEAD_ROWS])  # (R, V)
            nll[s : s + HEAD_ROWS] = token_nll(logits, tgt[s : s + HEAD_ROWS])  # (R,)
            if want_greedy:
                hit[s : s + HEAD_ROWS] = logits.argmax(-1) == tgt[s : s + HEAD_ROWS]
        nll, hit = nll.cpu(), hit.cpu()  # the batch's one wait for the device; the sums below run on the host
    # A NaN or +Inf logit anywhere in a row makes that row's NLL NaN/Inf (log-sum-exp), so checking the N NLLs catches
    # every non-finite logit that could change a score, without another pass over the logits.
    bad = ~torch.isfinite(nll)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        hint = scorer.nonfinite_hint()
        raise NonFiniteLogits(
            f"{scorer.name}: non-finite logits (NaN/Inf) at {what} {number(rows_b[row])}, position "
            f"{rows_t[row]}: the scores would be garbage{'; ' + hint if hint else ''}"
        )
    owner = packed[B * T : B * T + N]  # (N,): each scored row's request
    sums = torch.zeros(B, dtype=torch.float64).index_add_(0, owner, nll.double())  # in order: the same bits each run
    misses = torch.zeros(B, dtype=torch.long).index_add_(0, owner, (~hit).long())
    ends = torch.tensor([len(r.continuation) for r in reqs]).cumsum(0) - 1
    return sums.tolist(), (misses == 0).tolist(), hit[ends].tolist()


def _outside_vocabulary(
    inputs: Sequence[list[int]], reqs: Sequence[Request], V: int, pad_id: int, what: str, number: Callable[[int], int]
) -> str:
    """The message for a batch holding an id outside 0..V-1: the first request with one, else the padding id."""
    for i, (x, r) in enumerate(zip(inputs, reqs)):
        bad = next((t for t in (*x, *r.continuation) if not 0 <= t < V), None)
        if bad is not None:
            return (
                f"{what} {number(i)}: token id {bad} is outside the model's vocabulary of {V} tokens (0..{V - 1}): "
                "the tokenizer does not match the model"
            )
    return f"padding id {pad_id} is outside the model's vocabulary of {V} tokens (0..{V - 1})"


def batched(items: Iterable[Request], size: int) -> Iterator[list[Request]]:
    batch: list[Request] = []
    for r in items:
        batch.append(r)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def longest_first(reqs: Sequence[Request], max_length: int, size: int) -> Iterator[list[int]]:
    """The requests' indices in batches of `size`, longest input first (lm-evaluation-harness's order): a batch is
    padded to its longest row, so rows of alike lengths waste the least compute, and the largest batch comes first,
    so a batch size the device cannot hold fails at once instead of at the end."""
    order = sorted(range(len(reqs)), key=lambda i: -len(reqs[i].model_input(max_length)))  # stable: ties in order
    for s in range(0, len(order), size):
        yield order[s : s + size]


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise UsageError(f"--batch-size must be a positive integer, got {batch_size}")
