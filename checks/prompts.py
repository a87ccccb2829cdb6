"""The inputs of a parity run: prompts as text (encoded with the checkpoint's tokenizer) or as token ids.

The default prompts are stored as GPT-2 BPE token ids (tests/test_parity_report.py checks them against the real
tokenizer), so the default run needs no tokenizer files and no network.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpt2_port.errors import UsageError

DEFAULT_PROMPTS = ["The students opened their books", "The cat chased the mouse", "The chef prepared a meal"]
# The same prompts through GPT-2's BPE (encoder.json + vocab.bpe).
DEFAULT_PROMPT_IDS = [
    [464, 2444, 4721, 511, 3835],
    [464, 3797, 26172, 262, 10211],
    [464, 21221, 5597, 257, 9799],
]


@dataclass
class Inputs:
    """One entry per prompt: its text (None when given as ids only) and its token ids (None until encoded)."""

    texts: list[str | None]
    ids: list[list[int] | None]

    @property
    def needs_tokenizer(self) -> bool:
        return any(i is None for i in self.ids)

    def add_text(self, text: str) -> None:
        self.texts.append(text)
        self.ids.append(None)

    def add_ids(self, ids: list[int], text: str | None = None) -> None:
        self.texts.append(text)
        self.ids.append(list(ids))


def default_inputs() -> Inputs:
    return Inputs(list(DEFAULT_PROMPTS), [list(i) for i in DEFAULT_PROMPT_IDS])


def parse_ids(text: str, what: str) -> list[int]:
    """ "464 2444 4721" or "464,2444,4721" -> [464, 2444, 4721]; `what` names the option or file line in errors."""
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    if not parts:
        raise UsageError(f"{what}: no token ids (expected integers separated by spaces or commas)")
    out = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise UsageError(f"{what}: {p!r} is not a token id (expected a non-negative integer)") from None
        if v < 0:
            raise UsageError(f"{what}: token id {v} is negative (expected a non-negative integer)")
        out.append(v)
    return out


def check_ids(ids: Sequence[int], label: str, n_positions: int, vocab_size: int, hint: str = "") -> None:
    """Every prompt fits the model: not empty, within the context, every id inside the vocabulary."""
    if not ids:
        raise UsageError(f"{label} encodes to no tokens")
    if len(ids) > n_positions:
        raise UsageError(f"{label} is {len(ids)} tokens, more than the model's context of {n_positions}")
    if max(ids) >= vocab_size:
        raise UsageError(f"{label} has token id {max(ids)}, outside the model's vocabulary of {vocab_size}{hint}")


def resolve(inputs: Inputs, encode, n_positions: int, vocab_size: int) -> list[list[int]]:
    """The token ids of every prompt: stored ids as they are, texts through `encode` (called only if needed)."""
    out = []
    for k, (text, ids) in enumerate(zip(inputs.texts, inputs.ids)):
        hint = ""
        if ids is None:
            ids = encode(text)
            label, hint = f"prompt {text!r}", " (the tokenizer does not fit this checkpoint)"
        elif text is not None:
            label = f"prompt {text!r} (stored as GPT-2 token ids)"
        else:
            label = f"token-id prompt #{k + 1} (--ids, --ids-file)"
        check_ids(ids, label, n_positions, vocab_size, hint)
        out.append(list(ids))
    return out


# The batch every parity run compares besides the prompts one by one: prompt k cut to its first len - k tokens (so
# rows differ in length and are padded), and one long row of the prompts' ids repeated up to BATCH_LONG_TOKENS (or
# the model's context less one: a position one past the end, a common bug, then fails at a point instead of
# stopping the run with an index error): positions far beyond the prompts', and hundreds of padding positions
# before the short rows.
BATCH_LONG_TOKENS = 256


def _cut(ids_list: Sequence[Sequence[int]]) -> list[list[int]]:
    """Prompt k cut to its first len - k tokens (at least one): rows of different lengths, so some are padded."""
    return [list(ids[: max(1, len(ids) - k)]) for k, ids in enumerate(ids_list)]


def _repeated(ids_list: Sequence[Sequence[int]], n: int) -> list[int]:
    """The prompts' ids one after another, repeated, to `n` tokens."""
    every = [t for ids in ids_list for t in ids]
    return (every * (n // len(every) + 1))[:n]


def batch_rows(ids_list: Sequence[Sequence[int]], n_positions: int) -> list[list[int]]:
    """The rows of the padded batch: each prompt cut by its index, then the long row."""
    return [*_cut(ids_list), _repeated(ids_list, max(1, min(n_positions - 1, BATCH_LONG_TOKENS)))]


def left_padded(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(ids, attention_mask), each (B, T): every row right-aligned, `pad_id` and mask 0 before it."""
    T = max(len(r) for r in rows)
    ids = [[pad_id] * (T - len(r)) + list(r) for r in rows]
    mask = [[0] * (T - len(r)) + [1] * len(r) for r in rows]
    return ids, mask


# The cached decoding every parity run compares: the prompts, each cut by its index as in the batch, left-padded as
# generate takes them, prefilled, then DECODE_STEPS tokens fed one at a time (the prompts' ids again, the same for
# every row), through generate's own steps
DECODE_STEPS = 16


def decode_batch(ids_list: Sequence[Sequence[int]], n_positions: int) -> tuple[list[list[int]], list[list[int]], int]:
    """(ids, attention_mask, prompt_len): the cut prompts left-padded to the longest, then the same fed tokens after
    each (at most DECODE_STEPS, and short of the context's last position, as the long row)."""
    rows = _cut(ids_list)
    prompt_len = max(len(r) for r in rows)
    n = max(0, min(DECODE_STEPS, n_positions - 1 - prompt_len))
    fed = _repeated(ids_list, n)
    ids, mask = left_padded(rows)
    return [r + fed for r in ids], [m + [1] * n for m in mask], prompt_len
