"""Text generation: greedy or sampled decoding with a static KV cache, left-padded batches, stop strings, streaming.

The decoding rules follow transformers' `generate` so that results can be compared token for token:

- next-token logits are taken in float32 (a plain greedy argmax reads them in the model's dtype: the same token,
  the cast being exact); the repetition penalty applies first (also when greedy), then, when sampling,
  temperature, top-k and top-p, each written as transformers' logits processors write it; sampling draws from the
  softmax as `torch.multinomial` does (from `torch.Generator` seeded with `seed`, so a seed repeats its output);
- a row that has produced `eos_token_id` (or a stop string) is finished; its later positions hold `pad_token_id`
  (default: the EOS id) and generation ends when every row is finished or `max_new_tokens` are made;
- left-padded prompts carry an `attention_mask`; position ids come from the mask (first real token at 0), so each row
  gives what that prompt gives alone. The repetition penalty counts a row's real tokens only, never its padding
  (as transformers 5 does).

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

from ..devices import value_range
from ..errors import UsageError
from ..io.tokenizer import EOT_ID, Tokenizer
from .accept import take
from .choose import NONFINITE, OK, NextToken, nonfinite_message, overflow_message
from .protocol import CausalLM
from .readback import Readback
from .sampling import SamplingSettings, number, seen_tokens
from .steps import decode_steps
from .stopping import Rows, TextCallback

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- the loop
@dataclass
class Generation:
    """What `generate_full` produced.

    sequences: (B, T + steps) prompt (as given, padding included) + new tokens; finished rows hold pad_token_id.
    new_ids: per row, the new tokens up to and including its EOS / stop-string token (no padding after it).
    texts: per row, the new text (with a tokenizer): EOS not included, cut just after a stop string.
    stop_reasons: per row "eos", "stop" (a stop string), "length" (max_new_tokens) or "context" (n_positions reached).
    prefill_s: the prompt's forward pass and the choice of the first token; decode_s: all later steps, without
    capture_s, the one-time recording of the CUDA-graph step (warm-up included) when this call made it.
    decode_tokens: tokens made by the later steps (all rows; a finished row's padding not counted).
    scores: with output_scores, per step the (B, V) float32 scores each row's token was chosen from (the logits after
    repetition penalty, temperature, top-k and top-p, as transformers' `output_scores`); else None.
    """

    sequences: torch.Tensor
    new_ids: list[list[int]]
    texts: list[str] | None
    stop_reasons: list[str]
    prompt_len: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0
    decode_tokens: int = 0
    context_limited: bool = False
    max_new_tokens: int = 0
    extra: dict = field(default_factory=dict)
    scores: list[torch.Tensor] | None = None

    @property
    def decode_tok_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


def _check_prompt(model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    cfg = model.config
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise UsageError(
            f"input_ids must be a (batch, tokens) integer tensor, got {tuple(input_ids.shape)} {input_ids.dtype}"
        )
    B, T = input_ids.shape
    if B == 0 or T == 0:
        raise UsageError("empty prompt: input_ids holds no tokens (expected at least one token per row)")
    lo, hi = value_range(input_ids)
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


def _backend(compile_step: bool | str | Callable) -> str | Callable | None:
    """generate's compile_step as a torch.compile backend (a name, or a backend callable as torch.compile takes), or
    None (not compiled)."""
    if compile_step is True:
        return "inductor"
    if not compile_step:
        return None
    if callable(compile_step):
        return compile_step
    known = torch._dynamo.list_backends(exclude_tags=())
    if compile_step not in known:
        raise UsageError(
            f"compile_step: {compile_step!r} is not a torch.compile backend (expected True, or a name that "
            "torch._dynamo.list_backends() gives, such as 'inductor')"
        )
    return str(compile_step)


def _prepare(
    model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, num_return_sequences: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checked (B * num_return_sequences, T) ids and mask on the model's device.

    The mask is None when nothing is padded."""
    dev = model.device
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.tensor(input_ids, dtype=torch.long)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        attention_mask = torch.tensor(attention_mask, dtype=torch.long)
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


def _counts(
    max_new_tokens: int,
    num_return_sequences: int,
    min_new_tokens: int,
    eos_token_id: int | None,
    pad_token_id: int | None,
) -> tuple[int, int, int, int | None, int | None]:
    """The integer options as Python ints (numpy's too), checked: UsageError naming the option."""
    n = number("max_new_tokens", max_new_tokens, int)
    if n <= 0:
        raise UsageError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    r = number("num_return_sequences", num_return_sequences, int)
    if r < 1:
        raise UsageError(f"num_return_sequences must be a positive integer, got {num_return_sequences!r}")
    m = number("min_new_tokens", min_new_tokens, int)
    if m < 0:
        raise UsageError(f"min_new_tokens must be >= 0, got {m}")
    # a list of EOS ids is not taken (transformers takes several)
    eos = None if eos_token_id is None else number("eos_token_id", eos_token_id, int)
    pad = None if pad_token_id is None else number("pad_token_id", pad_token_id, int)
    return n, r, m, eos, pad


def _check_options(stops: list[str], needs_tokenizer: bool) -> None:
    if any(not s for s in stops):
        raise UsageError("stop strings must be non-empty")
    if needs_tokenizer:
        raise UsageError("stop strings and on_text need a tokenizer (pass tokenizer=...)")


@torch.no_grad()  # not inference_mode: callers get ordinary tensors back
def generate_full(
    model: CausalLM,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    seed: int | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = EOT_ID,
    pad_token_id: int | None = None,
    min_new_tokens: int = 0,
    num_return_sequences: int = 1,
    stop_strings: Sequence[str] | str | None = None,
    tokenizer: Tokenizer | None = None,
    on_text: TextCallback | None = None,
    use_cache: bool = True,
    fast_head: bool = True,
    fast_step: bool = True,
    static_cache: bool | None = None,
    cuda_graph: bool = True,
    compile_step: bool | str | Callable = False,
    fused_kernels: bool | None = None,
    progress: Callable[[int], None] | None = None,
    output_scores: bool = False,
    **sampling: object,
) -> Generation:
    """Generate up to `max_new_tokens` per row; see the module docstring for the rules. Returns a `Generation`.

    sampling: `SamplingSettings`' fields by keyword (do_sample, temperature, top_k, top_p, repetition_penalty).
    fast_head: for greedy float32 (and float16, where oneDNN has bf16 kernels) on CPU without a repetition penalty,
    pick tokens through `FastGreedyHead` (the same tokens, proven per step; falls back to the exact logits when it
    cannot prove it).
    fast_step: run the decode steps through `DecodePlan` (the forward's ops without module dispatch; bit-identical
    hidden states) when the model allows it; False: `model.forward` every step.
    static_cache: decode over fixed-size buffers with a mask, every shape the same for the whole generation (None:
    on CUDA, where it lets the step be captured; elsewhere the plan over a growing cache is faster).
    cuda_graph: on CUDA, record the static step once as a CUDA graph and replay it (False: run it eagerly).
    compile_step: torch.compile the static step (True: inductor, which fuses each block's elementwise work into a few
    kernels; a name or a callable: another backend, as torch.compile takes it), compiled once per kept step (batch,
    length bucket, dtype) and then, on CUDA, recorded as the CUDA graph. Implies the static cache unless static_cache
    is False. The compiled step computes the same function with other roundings (its tokens, not its bits, are the
    uncompiled step's); a compile that fails is logged and the step runs uncompiled.
    fused_kernels: the static step in fewer kernels than the forward's ops (None: on CUDA, where a batch-1 step's
    time is mostly its launches): the GELU as torch's one tanh-GELU kernel instead of gelu_new's eight ops (in bf16/
    fp16 in c_fc's matmul, cuBLASLt's GELU epilogue): 8 kernels a block fewer in bf16, 7 in float32 (about 12.6 a
    block where the forward's ops take 20.4, 124M on an H100); on CUDA each residual add and the layer norm after it
    as one Triton kernel (model/add_norm.py, the embeddings' lookups in the first), 2 a block and 3 a token fewer, and
    each block's cache write and attention as another (model/decode_attention.py), 1 a block fewer; for up to 4 rows
    each matmul as one kernel with the add and norm before it (model/norm_linear.py): 5 kernels a block. The same
    function rounded otherwise, so its tokens, not its bits, are the forward's (DecodePlan.static_step). The plan and
    the forward keep the forward's ops.
    progress: called after each step with the number of new tokens made so far (all rows).
    output_scores: keep each step's scores in `Generation.scores` (the fast greedy head is then off: it makes no
    logits; the tokens are the same, as it proves).
    None of these shortcuts runs in train mode (generation then runs the forward, dropout included).

    The loop waits for the device once per token: the new ids and whether the logits were finite come back in one
    transfer (streaming, EOS and stop strings need the ids; the finite check travels with them). Without stop strings
    that transfer is read one step late (readback.py): the next step is queued first, so the device does not idle
    while the host takes the ids.
    """
    settings = SamplingSettings.from_options(sampling)
    stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
    max_new_tokens, num_return_sequences, min_new_tokens, eos_token_id, pad_token_id = _counts(
        max_new_tokens, num_return_sequences, min_new_tokens, eos_token_id, pad_token_id
    )
    _check_options(stops, (bool(stops) or on_text is not None) and tokenizer is None)
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
    how = {"use_cache": use_cache, "fast_step": fast_step, "static_cache": static_cache, "cuda_graph": cuda_graph}
    how["compile_step"], how["fused_kernels"] = _backend(compile_step), fused_kernels
    scores: list[torch.Tensor] | None = [] if output_scores else None
    hold = (eos_token_id, min_new_tokens) if eos_token_id is not None and min_new_tokens > 0 else None
    choose = NextToken(model, settings, seen, gen, fast_head, scores, hold)
    rows = Rows(B, dev, eos_token_id, stops, tokenizer, on_text)
    rows_idx = torch.arange(B, device=dev)
    # made once, by a fill on the device (torch.tensor would copy from the host): torch.where takes a tensor, not a
    # number, where it writes into `out`
    pad_id = torch.full((), pad, dtype=torch.long, device=dev)

    reader = Readback(B + 1, dev)
    # Without stop strings a row stops on the device (EOS), so step k + 1 can be queued before the host reads step
    # k's ids: the host's work on them overlaps the device's on the next token. A stop string is found on the host,
    # and the row's next token must already be padding: then each step is read before the next is queued.
    ahead = not stops
    t0 = time.perf_counter()
    prefill_s, decode_tokens, made, S = 0.0, 0, 0, T  # S: tokens in the sequence so far
    nxt = None
    pending: tuple[object, int] | None = None  # a step queued but not read yet: (its readback handle, its index)

    def finish(handle: object, step: int) -> bool:
        """The host's side of step `step`: its ids and finite flag read (the one wait), the rows' tokens taken;
        whether any row still runs."""
        nonlocal prefill_s, decode_tokens, made, t0
        *toks, status = reader.read(handle)
        if status != OK:
            why = nonfinite_message(model, step) if status == NONFINITE else overflow_message(settings, step)
            raise UsageError(why)
        taken = rows.accept(toks)
        made += taken
        if progress is not None:
            progress(made)
        if step == 0:
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
        else:
            decode_tokens += taken
        return rows.any_running

    steps = decode_steps(model, B, L, seq, full_mask, how)
    captured0 = steps.capture_s  # a step kept from an earlier call was recorded then
    with steps.held():  # a kept static step (its cache) is this generation's alone until it ends
        for step in range(steps_max):
            if step == 0:
                h = steps.prefill(seq[:, :T], attention_mask)  # (B, 1, C)
            else:
                h = steps.next(nxt, S - 1)  # the token just chosen, at slot S - 1
            choice, status = choose(h, step)
            # (B,) into its column, finished rows padded; the rows still running (the next step pads a row that
            # chose EOS here, whenever the host learns of it); the ids and the status side by side for the host; a
            # static step's inputs for the next token set with them (the token goes into slot S)
            feed = None if steps.inputs is None else (steps.inputs, S)
            nxt, still, sent = take(choice, status, rows.unfinished, (pad, pad_id), eos_token_id, seq[:, S], feed)
            S += 1
            if seen is not None:
                seen[rows_idx, nxt] |= rows.unfinished
            rows.unfinished = still
            handle = reader.send(sent)
            if pending is not None:
                running = finish(*pending)
                pending = None
                if not running:  # every row had ended: the step just queued is not part of the result
                    S -= 1
                    break
            if ahead and step > 0:  # the first token read at once: the prefill's time, and the first text out
                pending = (handle, step)
            elif not finish(handle, step):
                break
        if pending is not None:
            finish(*pending)
    if scores is not None:
        del scores[S - T :]  # a step queued after every row had ended chose from scores of its own: not in the result
    capture_s = steps.capture_s - captured0
    decode_s = time.perf_counter() - t0 - capture_s if S - T > 1 else 0.0
    rows.close(context_limited)
    return Generation(
        sequences=seq[:, :S].clone(),
        new_ids=rows.new_ids,
        texts=rows.texts if rows.decoders is not None else None,
        stop_reasons=rows.reasons,
        prompt_len=T,
        prefill_s=prefill_s,
        decode_s=decode_s,
        capture_s=capture_s,
        decode_tokens=decode_tokens,
        context_limited=context_limited,
        max_new_tokens=max_new_tokens,
        scores=scores,
        extra={
            "fast_head": choose.fast_head is not None,
            "fast_head_kind": None if choose.fast_head is None else type(choose.fast_head).__name__,
            "exact_head_steps": choose.exact_steps,
            "fast_step": steps.name != "forward",
            "step": steps.name,
            "fused_kernels": steps.fused_kernels,
        },
    )


def generate(model: CausalLM, input_ids: torch.Tensor, max_new_tokens: int, **options: object) -> torch.Tensor:
    """Like transformers' `generate`: LongTensor (B * num_return_sequences, T + new). Options: `generate_full`."""
    return generate_full(model, input_ids, max_new_tokens, **options).sequences
