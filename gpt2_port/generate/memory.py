"""The memory a generation adds to the loaded model, known before it starts: the KV cache, the prompt's forward and
the next-token scores of every sample, against the memory free where the model runs (`check_decode_memory`). The
constants were measured on the CPU as peak RSS; the estimate is meant to err high, so that a batch that would not
fit stops with one line instead of an out-of-memory kill.

`sampling`: the options as `gpt2-port generate` collects them (do_sample, top_k, top_p, repetition_penalty)."""

from __future__ import annotations

from collections.abc import Mapping

from .. import devices
from ..config import GPT2Config
from ..devices import MEMORY_HEADROOM, GiB
from ..errors import UsageError
from .cache import static_len
from .protocol import CausalLM

# Bytes per (sample, vocabulary entry) that choosing a token holds at its peak, the float32 logits and what processing
# them makes. Measured on the CPU as the peak RSS of `generate --num-samples 8000 --max-new-tokens 2` on a 2-layer
# model with GPT-2's vocabulary, less that of one sample: greedy 12, sampling 16, top-k 20, top-k and top-p 29, greedy
# with a repetition penalty 18.
SCORE_BYTES_GREEDY = 12
SCORE_BYTES_SAMPLING = 16
SCORE_BYTES_TOP_K = 4
SCORE_BYTES_TOP_P = 10
SCORE_BYTES_PENALTY = 6
# Bytes the prompt's forward (prefill) holds per prompt token, in units of n_embd x the activation's size: measured
# 17 to 26 on gpt2 (124M, 8 or 16 prompts of 450 or 900 tokens, peak RSS less the KV cache and one short sample's)
PREFILL_PER_TOKEN = 28


def score_bytes(sampling: Mapping) -> int:
    """Bytes per (sample, vocabulary entry) that choosing a token holds (see SCORE_BYTES_*)."""
    n = SCORE_BYTES_SAMPLING if sampling["do_sample"] else SCORE_BYTES_GREEDY
    if sampling["do_sample"] and sampling["top_k"]:
        n += SCORE_BYTES_TOP_K
    if sampling["do_sample"] and sampling["top_p"] is not None and sampling["top_p"] < 1:
        n += SCORE_BYTES_TOP_P
    if sampling["repetition_penalty"] != 1.0:
        n += SCORE_BYTES_PENALTY
    return n


def decode_memory(
    cfg: GPT2Config,
    samples: int,
    prompt_len: int,
    total_len: int,
    act_bytes: int,
    sampling: Mapping,
    cache: bool,
) -> dict[str, int]:
    """Estimated bytes a generation adds to the loaded model, by part: the KV cache (k and v of every layer for
    every sample and position), the prompt's forward (over the whole sequence each step without the cache), and the
    next-token scores of every sample."""
    C = cfg.n_embd
    forward_len = prompt_len if cache else total_len
    slots = static_len(total_len, cfg.n_positions)  # the static cache's (CUDA's) rounded length: at most 63 more
    return {
        "KV cache": 2 * cfg.n_layer * samples * slots * C * act_bytes if cache else 0,
        "prompt forward": samples * forward_len * C * act_bytes * PREFILL_PER_TOKEN,
        "next-token scores": samples * cfg.vocab_size * score_bytes(sampling),
    }


def check_decode_memory(
    model: CausalLM, samples: int, prompt_len: int, new_tokens: int, sampling: Mapping, cache: bool
) -> None:
    """UsageError before generating when the estimate (decode_memory) is over 90% of the memory available where the
    model runs, naming the parts and the most samples that fit."""
    cfg = model.config
    total_len = prompt_len + min(new_tokens, cfg.n_positions - prompt_len)
    parts = decode_memory(cfg, samples, prompt_len, total_len, model.dtype.itemsize, sampling, cache)
    need = sum(parts.values())
    avail, source = devices.available_memory(model.device)
    budget = int(avail * MEMORY_HEADROOM)
    if need <= budget:
        return
    fits = budget * samples // need  # every part grows with the number of samples
    detail = ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items())
    hint = f"try --num-samples {fits}" if fits else "try a shorter prompt or a smaller model"
    raise UsageError(
        f"memory: {samples} sample(s) of {total_len} tokens need about {need / GiB:.1f} GiB ({detail} GiB), but only "
        f"{avail / GiB:.1f} GiB is available ({source}); {hint}, or --no-memory-check to start anyway"
    )
