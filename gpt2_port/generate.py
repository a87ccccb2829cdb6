"""Text generation: greedy or sampled decoding with a static KV cache, left-padded batches, stop strings, streaming.

The decoding rules follow transformers' `generate` so that results can be compared token for token:

- next-token logits are taken in float32; the repetition penalty applies first (also when greedy), then, when sampling,
  temperature, top-k and top-p, each written as transformers' logits processors write it; sampling draws with
  `torch.multinomial` from the softmax (from `torch.Generator` seeded with `seed`, so a seed repeats its output);
- a row that has produced `eos_token_id` (or a stop string) is finished; its later positions hold `pad_token_id`
  (default: the EOS id) and generation ends when every row is finished or `max_new_tokens` are made;
- left-padded prompts carry an `attention_mask`; position ids come from the mask (first real token at 0), so each row
  gives what that prompt gives alone. The repetition penalty counts a row's real tokens only, never its padding
  (transformers also counts the pad ids of a padded row).

The context: a prompt must be shorter than the model's context (`n_positions`, 1024 for GPT-2), else UsageError.
Generation never slides the window: when prompt + new tokens would pass the context, it stops at the context with
`stop_reason == "context"` and a logged warning (the CLI prints the message). Every token is then exact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .decode import DecodePlan
from .errors import UsageError
from .kv_cache import KVCache
from .model import GPT2
from .tokenizer import EOT_ID, StreamDecoder, Tokenizer

log = logging.getLogger(__name__)

# on_text(row, text): called with each row's new text as soon as it forms whole characters (needs a tokenizer)
TextCallback = Callable[[int, str], None]


# ---------------------------------------------------------------------------------------------- logits processing
@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen. Values that disable a step: temperature 1.0, top_k None/0, top_p None/1.0,
    repetition_penalty 1.0."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        """UsageError naming the argument and what was expected, for values that make no distribution."""
        if self.do_sample and not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise UsageError(
                f"temperature must be > 0 when sampling, got {self.temperature} (use greedy decoding "
                f"for the most likely token)"
            )
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise UsageError(f"top_k must be a non-negative integer (0: no top-k), got {self.top_k}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise UsageError(f"top_p must be in (0, 1] (1: no top-p), got {self.top_p}")
        if not (self.repetition_penalty > 0):
            raise UsageError(f"repetition_penalty must be > 0 (1.0: no penalty), got {self.repetition_penalty}")


def apply_repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """(B, V) scores, (B, V) bool seen tokens: divide positive scores by `penalty`, multiply negative ones."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def apply_top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` highest scores (and any tied with the k-th), -inf elsewhere."""
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1, None]  # (B, 1)
    return scores.masked_fill(scores < kth, -float("inf"))


def apply_top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (always at least one)."""
    sorted_scores, sorted_idx = torch.sort(scores, descending=False)
    cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # ascending: the tail to drop comes first
    drop_sorted = cum <= (1 - top_p)
    drop_sorted[..., -1:] = False
    drop = drop_sorted.scatter(1, sorted_idx, drop_sorted)
    return scores.masked_fill(drop, -float("inf"))


def process_logits(scores: torch.Tensor, seen: torch.Tensor | None, s: SamplingSettings) -> torch.Tensor:
    """(B, V) float32 next-token logits -> the processed scores a token is drawn from (softmax gives the distribution)."""
    if s.repetition_penalty != 1.0 and seen is not None:
        scores = apply_repetition_penalty(scores, seen, s.repetition_penalty)
    if s.do_sample:
        if s.temperature != 1.0:
            scores = scores / s.temperature
        if s.top_k:
            scores = apply_top_k(scores, s.top_k)
        if s.top_p is not None and s.top_p < 1.0:
            scores = apply_top_p(scores, s.top_p)
    return scores


def seen_tokens(input_ids: torch.Tensor, vocab_size: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) ids -> (B, V) bool: which tokens each row holds (its padding excluded)."""
    seen = torch.zeros(input_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=input_ids.device)
    ids = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, vocab_size)
    seen.scatter_(1, ids, True)
    return seen[:, :vocab_size]


# ---------------------------------------------------------------------------------------------- greedy head
class FastGreedyHead:
    """Greedy next tokens from a transposed copy of the head weight, used only when provably the exact argmax.

    On CPU a matrix-vector product runs ~30% faster with the weight laid out (C, V) than (V, C), and the head is the
    largest single read of a decode step. The two layouts sum in different orders, so their logits differ in the last
    bits. Each is within gamma_n * sum_i |h_i w_ji| <= gamma_n * |h| * |w_j| of the true dot product (Higham, any
    summation order; gamma_n = n u / (1 - n u), u = 2^-24, n = C), so when the fast top-1 leads the fast top-2 by more
    than twice that bound (times 2 for safety), the exact logits have the same unique argmax. Otherwise the exact
    logits are computed as usual. Costs one (C, V) copy of the head weight, kept on the model after the first greedy
    call (154 MB for GPT-2 124M; `fast_head=False` avoids it).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        V, C = weight.shape
        u = 2.0**-24
        gamma = C * u / (1 - C * u)
        self.wt = weight.detach().t().contiguous()  # (C, V)
        self.scale = 2 * 2 * gamma * float(weight.detach().norm(dim=1).max())

    @staticmethod
    def for_model(model: GPT2) -> FastGreedyHead:
        """The model's cached instance, rebuilt when the head weight changes (another tensor, or written in place).

        Kept on the model between calls, so only the first greedy call pays the copy (0.1 s for 124M).
        """
        w = model.head_weight
        key = (w.data_ptr(), w._version, tuple(w.shape), w.dtype)
        cached = model.__dict__.get("_fast_greedy_head")
        if cached is None or cached[0] != key:
            cached = (key, FastGreedyHead(w))
            model.__dict__["_fast_greedy_head"] = cached
        return cached[1]

    @staticmethod
    def usable(model: GPT2) -> bool:
        """float32 on CPU (no reduced-precision matmul), a plain head, and no recording of the logits."""
        plain = model.lm_head is None or type(model.lm_head) is torch.nn.Linear
        return plain and model.device.type == "cpu" and model.dtype == torch.float32 and model.taps.rec is None

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """(B, C) float32 final hidden states -> (B,) the exact argmax, or None when the margin is too thin."""
        fast = h @ self.wt  # (B, V)
        best = fast.argmax(dim=-1, keepdim=True)  # (B, 1)
        top1 = fast.gather(1, best)[:, 0]
        top2 = fast.scatter(1, best, -float("inf")).amax(dim=-1)  # (topk is several times slower on CPU)
        bound = self.scale * h.norm(dim=-1)  # (B,)
        if bool(((top1 - top2) > bound).all()):
            return best[:, 0]
        return None


# ---------------------------------------------------------------------------------------------- the loop
@dataclass
class Generation:
    """What `generate_full` produced.

    sequences: (B, T + steps) prompt (as given, padding included) + new tokens; finished rows hold pad_token_id.
    new_ids: per row, the new tokens up to and including its EOS / stop-string token (no padding after it).
    texts: per row, the new text (with a tokenizer): EOS not included, cut just after a stop string.
    stop_reasons: per row "eos", "stop" (a stop string), "length" (max_new_tokens) or "context" (n_positions reached).
    prefill_s: the prompt's forward pass and the choice of the first token; decode_s: all later steps.
    decode_tokens: tokens made by the later steps (all rows; a finished row's padding not counted).
    """

    sequences: torch.Tensor
    new_ids: list[list[int]]
    texts: list[str] | None
    stop_reasons: list[str]
    prompt_len: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    context_limited: bool = False
    max_new_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def decode_tok_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def _check_prompt(model: GPT2, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    cfg = model.config
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise UsageError(
            f"input_ids must be a (batch, tokens) integer tensor, got {tuple(input_ids.shape)} {input_ids.dtype}"
        )
    B, T = input_ids.shape
    if B == 0 or T == 0:
        raise UsageError("empty prompt: input_ids holds no tokens (expected at least one token per row)")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= cfg.vocab_size:
        bad = lo if lo < 0 else hi
        raise UsageError(f"input_ids: token id {bad} is out of range (expected 0 <= id < {cfg.vocab_size})")
    if T >= cfg.n_positions:
        raise UsageError(
            f"prompt is {T} tokens; the model's context is {cfg.n_positions} tokens, so the prompt must "
            f"be at most {cfg.n_positions - 1} to leave room for a new token"
        )
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise UsageError(
                f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
                f"{tuple(attention_mask.shape)}"
            )
        m = attention_mask.bool()
        if not bool(m.any(dim=1).all()):
            raise UsageError("empty prompt: a row of attention_mask is all zeros (expected at least one real token)")
        # left padding only: once a row's real tokens start, they run to the end
        if not bool((m.long().cummax(dim=1).values == m.long()).all()):
            raise UsageError("attention_mask must be left-padded (zeros first, then ones) in every row")


@torch.no_grad()  # not inference_mode: callers get ordinary tensors back
def generate_full(
    model: GPT2,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = EOT_ID,
    pad_token_id: int | None = None,
    num_return_sequences: int = 1,
    stop_strings: Sequence[str] | str | None = None,
    tokenizer: Tokenizer | None = None,
    on_text: TextCallback | None = None,
    use_cache: bool = True,
    fast_head: bool = True,
    fast_step: bool = True,
) -> Generation:
    """Generate up to `max_new_tokens` per row; see the module docstring for the rules. Returns a `Generation`.

    fast_head: for greedy float32 on CPU without a repetition penalty, pick tokens through `FastGreedyHead` (the
    same tokens, proven per step; falls back to the exact logits when it cannot prove it).
    fast_step: run the decode steps through `DecodePlan` (the forward's ops without module dispatch; bit-identical
    hidden states) when the model allows it; False: `model.forward` every step.
    """
    settings = SamplingSettings(do_sample, temperature, top_k, top_p, repetition_penalty)
    settings.validate()
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise UsageError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(num_return_sequences, int) or num_return_sequences < 1:
        raise UsageError(f"num_return_sequences must be a positive integer, got {num_return_sequences!r}")
    stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
    if any(not s for s in stops):
        raise UsageError("stop strings must be non-empty")
    if (stops or on_text is not None) and tokenizer is None:
        raise UsageError("stop strings and on_text need a tokenizer (pass tokenizer=...)")

    dev = model.device
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.tensor(input_ids, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    _check_prompt(model, input_ids, attention_mask)
    input_ids = input_ids.to(device=dev, dtype=torch.long)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=dev, dtype=torch.long)
        if bool(attention_mask.all()):
            attention_mask = None  # no padding: plain causal attention, positions counted from 0
    if num_return_sequences > 1:  # each prompt's samples side by side, as transformers orders them
        input_ids = input_ids.repeat_interleave(num_return_sequences, dim=0)
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(num_return_sequences, dim=0)

    B, T = input_ids.shape
    cfg = model.config
    room = cfg.n_positions - T
    steps_max = min(max_new_tokens, room)
    context_limited = steps_max < max_new_tokens
    if context_limited:
        log.info(
            "prompt (%d tokens) + %d new tokens would pass the context of %d tokens: generation stops at "
            "the context after %d new tokens",
            T,
            max_new_tokens,
            cfg.n_positions,
            steps_max,
        )
    pad = pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0)
    gen = None
    if seed is not None:
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)

    L = T + steps_max
    seq = torch.full((B, L), pad, dtype=torch.long, device=dev)
    seq[:, :T] = input_ids
    full_mask = None
    if attention_mask is not None:
        full_mask = torch.ones(B, L, dtype=torch.long, device=dev)
        full_mask[:, :T] = attention_mask
    seen = seen_tokens(input_ids, cfg.vocab_size, attention_mask) if repetition_penalty != 1.0 else None
    cache = KVCache(cfg, B, L, model.dtype, dev) if use_cache else None

    unfinished = torch.ones(B, dtype=torch.bool, device=dev)
    new_ids: list[list[int]] = [[] for _ in range(B)]
    reasons = ["length"] * B
    decoders: list[StreamDecoder] | None = [tokenizer.stream_decoder() for _ in range(B)] if tokenizer else None
    texts = [""] * B
    longest_stop = max((len(s) for s in stops), default=0)

    def emit(row: int, text: str) -> None:
        if text and on_text is not None:
            on_text(row, text)

    t0 = time.perf_counter()
    greedy_head = None
    if fast_head and not do_sample and repetition_penalty == 1.0 and FastGreedyHead.usable(model):
        greedy_head = FastGreedyHead.for_model(model)
    plan = DecodePlan.for_model(model) if cache is not None and fast_step else None
    exact_steps = 0
    prefill_s = 0.0
    decode_tokens = 0
    S = T  # tokens in the sequence so far
    for step in range(steps_max):
        if cache is not None:
            x = seq[:, :T] if step == 0 else seq[:, S - 1 : S]
        else:
            x = seq[:, :S]
        mask = full_mask[:, :S] if full_mask is not None else None
        if plan is not None and step > 0:  # the forward's ops without module dispatch (bit-identical)
            h = plan.step(x, cache, mask)  # (B, 1, C)
        else:
            h = model(x, attention_mask=mask, cache=cache, last_only=True, hidden_only=True)  # (B, 1, C)
        if greedy_head is not None:
            nxt = greedy_head.argmax(h[:, -1])
            if nxt is None:
                exact_steps += 1
                nxt = torch.argmax(model.head(h)[:, -1].float(), dim=-1)
        else:
            logits = model.head(h)[:, -1].float()  # (B, V)
            scores = process_logits(logits, seen, settings)
            if do_sample:
                probs = F.softmax(scores, dim=-1)
                nxt = torch.multinomial(probs, num_samples=1, generator=gen).squeeze(1)  # (B,)
            else:
                nxt = torch.argmax(scores, dim=-1)
        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
        seq[:, S] = nxt
        S += 1
        if seen is not None:
            seen[torch.arange(B, device=dev), nxt] |= unfinished
        toks = nxt.tolist()  # one host sync per step (needed to stream and to stop)
        was_running = unfinished.tolist()
        for r in range(B):
            if not was_running[r]:
                continue
            tok = toks[r]
            new_ids[r].append(tok)
            if step > 0:
                decode_tokens += 1
            if eos_token_id is not None and tok == eos_token_id:
                reasons[r] = "eos"
                unfinished[r] = False
                if decoders is not None:
                    rest = decoders[r].flush()
                    texts[r] += rest
                    emit(r, rest)
                continue
            if decoders is None:
                continue
            piece = decoders[r].push(tok)
            if not piece:
                continue
            before = len(texts[r])
            texts[r] += piece
            if stops:
                start = max(0, before - longest_stop + 1)
                hits = [(i, s) for s in stops if (i := texts[r].find(s, start)) >= 0]
                if hits:
                    i, s = min(hits)
                    end = i + len(s)
                    emit(r, texts[r][before:end])
                    texts[r] = texts[r][:end]
                    reasons[r] = "stop"
                    unfinished[r] = False
                    continue
            emit(r, piece)
        if step == 0:
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        if not bool(unfinished.any()):
            break
    decode_s = time.perf_counter() - t0 if S - T > 1 else 0.0

    for r in range(B):
        if reasons[r] == "length" and context_limited:
            reasons[r] = "context"
        if decoders is not None and reasons[r] in ("length", "context"):
            rest = decoders[r].flush()
            texts[r] += rest
            emit(r, rest)
    return Generation(
        sequences=seq[:, :S].clone(),
        new_ids=new_ids,
        texts=texts if decoders is not None else None,
        stop_reasons=reasons,
        prompt_len=T,
        prefill_s=prefill_s,
        decode_s=decode_s,
        decode_tokens=decode_tokens,
        context_limited=context_limited,
        max_new_tokens=max_new_tokens,
        extra={"fast_head": greedy_head is not None, "exact_head_steps": exact_steps, "fast_step": plan is not None},
    )


def generate(model: GPT2, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """Like transformers' `generate`: LongTensor (B * num_return_sequences, T + new). Arguments: `generate_full`."""
    return generate_full(model, input_ids, max_new_tokens, **kwargs).sequences
