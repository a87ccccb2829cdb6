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

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .decode import DecodePlan
from .errors import UsageError
from .kv_cache import KVCache
from .load import nonfinite_tensors
from .model import GPT2, wants_grad
from .tokenizer import EOT_ID, StreamDecoder, Tokenizer

log = logging.getLogger(__name__)

# on_text(row, text): called with each row's new text as soon as it forms whole characters (needs a tokenizer)
TextCallback = Callable[[int, str], None]


# ---------------------------------------------------------------------------------------------- logits processing
@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen: the sampling options, defined here once. `generate_full`, `generate` and
    `GPT2.generate` take them as keyword arguments of these names. Values that disable a step: temperature 1.0,
    top_k None/0, top_p None/1.0, repetition_penalty 1.0."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0

    @classmethod
    def from_options(cls, options: dict) -> SamplingSettings:
        """The settings named by keyword arguments, validated; UsageError for a name that is no option."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise UsageError(
                f"generate: unknown argument(s) {', '.join(map(repr, unknown))}: the sampling options are "
                f"{', '.join(names)}; see gpt2_port.generate.generate_full for the others"
            )
        settings = cls(**options)
        settings.validate()
        return settings

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
    """(B, V) float32 next-token logits -> the processed scores a token is drawn from.

    Their softmax is the distribution the token is drawn from."""
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
        """float32 on CPU (no reduced-precision matmul), a plain head, no recording of the logits, and inference
        (not in train mode, no gradient wanted: the copy is detached)."""
        plain = model.lm_head is None or type(model.lm_head) is torch.nn.Linear
        cpu32 = model.device.type == "cpu" and model.dtype == torch.float32
        return plain and cpu32 and model.taps.rec is None and not wants_grad(model)

    def argmax(self, h: torch.Tensor) -> torch.Tensor | None:
        """(B, C) float32 final hidden states -> (B,) the exact argmax, or None when the margin is too thin.

        Non-finite logits always get None, so that the exact ones are computed (and generate checks them): NaN fails
        the margin test, and an Inf in h or the weight makes the bound Inf. A logit that overflows from finite
        inputs would pass the margin test with an infinite lead; with torch's unscaled norms their bound overflows
        first, but the explicit test does not rely on how a norm is computed (~20 us on a (1, 50257) row).
        """
        fast = h @ self.wt  # (B, V)
        if not bool(torch.isfinite(fast).all()):
            return None
        best = fast.argmax(dim=-1, keepdim=True)  # (B, 1)
        top1 = fast.gather(1, best)[:, 0]
        top2 = fast.scatter(1, best, -float("inf")).amax(dim=-1)  # (topk is several times slower on CPU)
        bound = self.scale * h.norm(dim=-1)  # (B,)
        if bool(((top1 - top2) > bound).all()):
            return best[:, 0]
        return None


class NextToken:
    """Chooses each row's next token from the last position's final hidden state: through `FastGreedyHead` when it
    applies, else the head's float32 logits, processed (`process_logits`), then argmax or a draw from the softmax.

    Logits that hold NaN or Inf stop generation with a UsageError naming the step (and the model's non-finite
    weights, if any): their argmax would be an arbitrary token and text made of it silent garbage.
    """

    def __init__(
        self,
        model: GPT2,
        settings: SamplingSettings,
        seen: torch.Tensor | None,
        generator: torch.Generator | None,
        fast_head: bool,
    ) -> None:
        self.model, self.settings, self.seen, self.generator = model, settings, seen, generator
        greedy = not settings.do_sample and settings.repetition_penalty == 1.0
        usable = fast_head and greedy and FastGreedyHead.usable(model)
        self.fast_head = FastGreedyHead.for_model(model) if usable else None
        self.exact_steps = 0  # steps where the fast head could not prove its argmax

    def __call__(self, h: torch.Tensor, step: int) -> torch.Tensor:
        """(B, 1, C) ln_f output of the last position -> (B,) token ids. step: 0 for the first new token."""
        if self.fast_head is not None:
            nxt = self.fast_head.argmax(h[:, -1])
            if nxt is not None:
                return nxt
            self.exact_steps += 1
        logits = self.model.head(h)[:, -1].float()  # (B, V)
        if not bool(torch.isfinite(logits).all()):
            raise UsageError(nonfinite_message(self.model, step))
        if self.fast_head is not None:
            return torch.argmax(logits, dim=-1)
        scores = process_logits(logits, self.seen, self.settings)
        if self.settings.do_sample:
            probs = F.softmax(scores, dim=-1)
            return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)  # (B,)
        return torch.argmax(scores, dim=-1)


def nonfinite_message(model: GPT2, step: int) -> str:
    """One line: the step whose logits are not finite, and the weights that are not (checked now, once)."""
    bad = nonfinite_tensors(dict(model.named_parameters()) | dict(model.named_buffers()))
    if bad:
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        cause = f"non-finite weights: {', '.join(bad[:8])}{more} (expected finite values; check the checkpoint)"
    else:
        cause = f"the weights are all finite, so an activation overflowed in {str(model.dtype).removeprefix('torch.')}"
    return f"generate: the logits of step {step + 1} (new token {step + 1}) hold NaN or Inf; {cause}"


# ---------------------------------------------------------------------------------------------- stopping
class Rows:
    """Each row's progress: its new tokens, whether and why it stopped (EOS, a stop string), and its text, streamed
    to `on_text` as it forms whole characters. `unfinished` (B,) bool lives on the model's device."""

    def __init__(
        self,
        B: int,
        device: torch.device,
        eos_token_id: int | None,
        stops: list[str],
        tokenizer: Tokenizer | None,
        on_text: TextCallback | None,
    ) -> None:
        self.unfinished = torch.ones(B, dtype=torch.bool, device=device)
        self.new_ids: list[list[int]] = [[] for _ in range(B)]
        self.reasons = ["length"] * B
        self.decoders: list[StreamDecoder] | None = (
            [tokenizer.stream_decoder() for _ in range(B)] if tokenizer else None
        )
        self.texts = [""] * B
        self.eos, self.stops, self.on_text = eos_token_id, stops, on_text
        self.longest_stop = max((len(s) for s in stops), default=0)

    def _emit(self, row: int, text: str) -> None:
        if text and self.on_text is not None:
            self.on_text(row, text)

    def _stop(self, row: int, reason: str) -> None:
        self.reasons[row] = reason
        self.unfinished[row] = False

    def _flush(self, row: int) -> None:
        if self.decoders is not None:
            rest = self.decoders[row].flush()
            self.texts[row] += rest
            self._emit(row, rest)

    def accept(self, toks: list[int], running: list[bool]) -> int:
        """Take one step's token per row (rows not `running` skip theirs); returns how many rows took one."""
        taken = 0
        for r, (tok, was_running) in enumerate(zip(toks, running)):
            if not was_running:
                continue
            taken += 1
            self.new_ids[r].append(tok)
            if self.eos is not None and tok == self.eos:
                self._stop(r, "eos")
                self._flush(r)
            elif self.decoders is not None:
                self._add_text(r, tok)
        return taken

    def _add_text(self, r: int, tok: int) -> None:
        """Decode the row's token; a stop string in the new text cuts the text just after it and stops the row."""
        piece = self.decoders[r].push(tok)  # type: ignore[index]
        if not piece:
            return
        before = len(self.texts[r])
        self.texts[r] += piece
        if self.stops:
            start = max(0, before - self.longest_stop + 1)
            hits = [(i, s) for s in self.stops if (i := self.texts[r].find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                end = i + len(s)
                self._emit(r, self.texts[r][before:end])
                self.texts[r] = self.texts[r][:end]
                self._stop(r, "stop")
                return
        self._emit(r, piece)

    def close(self, context_limited: bool) -> None:
        """After the last step: rows still running stopped at the length (or the context), their text flushed."""
        for r in range(len(self.reasons)):
            if self.reasons[r] == "length" and context_limited:
                self.reasons[r] = "context"
            if self.reasons[r] in ("length", "context"):
                self._flush(r)


# ---------------------------------------------------------------------------------------------- the steps
def prefill(model: GPT2, ids: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
    """The prompt (B, T) through the forward, filling the cache -> (B, 1, C) the last position's ln_f output."""
    return model(ids, attention_mask=mask, cache=cache, last_only=True, hidden_only=True)


def decode_one_token(
    model: GPT2, plan: DecodePlan | None, seq: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None
) -> torch.Tensor:
    """seq (B, S) so far -> (B, 1, C) ln_f output at its last token: one cached step (through the plan when there is
    one), or, without a cache, the whole sequence again."""
    if cache is None:
        return model(seq, attention_mask=mask, last_only=True, hidden_only=True)
    x = seq[:, -1:]  # (B, 1)
    if plan is not None:  # the forward's ops without module dispatch (bit-identical)
        return plan.step(x, cache, mask)
    return model(x, attention_mask=mask, cache=cache, last_only=True, hidden_only=True)


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


def _prepare(
    model: GPT2, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, num_return_sequences: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checked (B * num_return_sequences, T) ids and mask on the model's device.

    The mask is None when nothing is padded."""
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
    return input_ids, attention_mask


def _check_options(max_new_tokens: int, num_return_sequences: int, stops: list[str], needs_tokenizer: bool) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise UsageError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(num_return_sequences, int) or num_return_sequences < 1:
        raise UsageError(f"num_return_sequences must be a positive integer, got {num_return_sequences!r}")
    if any(not s for s in stops):
        raise UsageError("stop strings must be non-empty")
    if needs_tokenizer:
        raise UsageError("stop strings and on_text need a tokenizer (pass tokenizer=...)")


@torch.no_grad()  # not inference_mode: callers get ordinary tensors back
def generate_full(
    model: GPT2,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
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
    **sampling: object,
) -> Generation:
    """Generate up to `max_new_tokens` per row; see the module docstring for the rules. Returns a `Generation`.

    sampling: `SamplingSettings`' fields by keyword (do_sample, temperature, top_k, top_p, repetition_penalty).
    fast_head: for greedy float32 on CPU without a repetition penalty, pick tokens through `FastGreedyHead` (the
    same tokens, proven per step; falls back to the exact logits when it cannot prove it).
    fast_step: run the decode steps through `DecodePlan` (the forward's ops without module dispatch; bit-identical
    hidden states) when the model allows it; False: `model.forward` every step.
    Neither shortcut runs in train mode (generation then runs the forward, dropout included).
    """
    settings = SamplingSettings.from_options(sampling)
    stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
    _check_options(
        max_new_tokens, num_return_sequences, stops, (bool(stops) or on_text is not None) and tokenizer is None
    )
    input_ids, attention_mask = _prepare(model, input_ids, attention_mask, num_return_sequences)
    B, T = input_ids.shape
    dev, cfg = model.device, model.config
    steps_max = min(max_new_tokens, cfg.n_positions - T)
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
    gen = None if seed is None else torch.Generator(device=dev).manual_seed(seed)

    L = T + steps_max
    seq = torch.full((B, L), pad, dtype=torch.long, device=dev)  # (B, L): the prompt, then the new tokens
    seq[:, :T] = input_ids
    full_mask = None
    if attention_mask is not None:
        full_mask = torch.ones(B, L, dtype=torch.long, device=dev)
        full_mask[:, :T] = attention_mask
    seen = seen_tokens(input_ids, cfg.vocab_size, attention_mask) if settings.repetition_penalty != 1.0 else None
    cache = KVCache(cfg, B, L, model.dtype, dev) if use_cache else None
    choose = NextToken(model, settings, seen, gen, fast_head)
    plan = DecodePlan.for_model(model) if cache is not None and fast_step else None
    rows = Rows(B, dev, eos_token_id, stops, tokenizer, on_text)

    t0 = time.perf_counter()
    prefill_s, decode_tokens, S = 0.0, 0, T  # S: tokens in the sequence so far
    for step in range(steps_max):
        mask = full_mask[:, :S] if full_mask is not None else None
        if step == 0:
            h = prefill(model, seq[:, :T], mask, cache)  # (B, 1, C)
        else:
            h = decode_one_token(model, plan, seq[:, :S], mask, cache)
        nxt = torch.where(rows.unfinished, choose(h, step), pad)  # (B,): finished rows get padding
        seq[:, S] = nxt
        S += 1
        if seen is not None:
            seen[torch.arange(B, device=dev), nxt] |= rows.unfinished
        taken = rows.accept(nxt.tolist(), rows.unfinished.tolist())  # one host sync per step (to stream, to stop)
        if step == 0:
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        else:
            decode_tokens += taken
        if not bool(rows.unfinished.any()):
            break
    decode_s = time.perf_counter() - t0 if S - T > 1 else 0.0
    rows.close(context_limited)
    return Generation(
        sequences=seq[:, :S].clone(),
        new_ids=rows.new_ids,
        texts=rows.texts if rows.decoders is not None else None,
        stop_reasons=rows.reasons,
        prompt_len=T,
        prefill_s=prefill_s,
        decode_s=decode_s,
        decode_tokens=decode_tokens,
        context_limited=context_limited,
        max_new_tokens=max_new_tokens,
        extra={
            "fast_head": choose.fast_head is not None,
            "exact_head_steps": choose.exact_steps,
            "fast_step": plan is not None,
        },
    )


def generate(model: GPT2, input_ids: torch.Tensor, max_new_tokens: int, **options: object) -> torch.Tensor:
    """Like transformers' `generate`: LongTensor (B * num_return_sequences, T + new). Options: `generate_full`."""
    return generate_full(model, input_ids, max_new_tokens, **options).sequences
