"""Published zero-shot figures for the four official GPT-2 checkpoints, each with its source and method.

Printed beside `gpt2-port eval` results when MODEL is an official id. Only figures with a source that can be cited
are here; where none was found the entry is absent (never filled in).
"""

from __future__ import annotations

from dataclasses import dataclass

PAPER = (
    "GPT-2 paper (Radford et al. 2019, 'Language Models are Unsupervised Multitask Learners'), Table 3: zero-shot, "
    "with invertible de-tokenizers; perplexities normalised by the dataset's original word-level tokens; LAMBADA on "
    "OpenAI's detokenized test set, predicting the last word (gpt2-xl's 63.24% with a stop-word filter)"
)
LM_EVAL_2159 = (
    "lm-evaluation-harness, task lambada_openai v1, zero-shot, as run and posted in EleutherAI/lm-evaluation-harness "
    "issue #2159 (openai-community/gpt2, batch size 4): accuracy = every token of the last word is the argmax; "
    "perplexity = exp(mean over documents of the last word's NLL)"
)
LM_EVAL_911 = (
    "lm-evaluation-harness, task lambada_openai, zero-shot, as run and posted in EleutherAI/lm-evaluation-harness "
    "issue #911 (gpt2-xl, batch size 8)"
)

SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


@dataclass(frozen=True)
class Figure:
    tasks: tuple[str, ...]  # the eval tasks it is printed beside: text, wikitext, lambada, choices
    metric: str  # the JSON key it compares with
    value: float
    dataset: str
    source: str


def _paper(dataset: str, tasks: str, metric: str, values: tuple[float, float, float, float]) -> dict[str, Figure]:
    return {size: Figure(tuple(tasks.split()), metric, v, dataset, PAPER) for size, v in zip(SIZES, values)}


_TABLE: list[dict[str, Figure]] = [
    _paper("LAMBADA", "lambada", "perplexity", (35.13, 15.60, 10.87, 8.63)),
    _paper("LAMBADA", "lambada", "accuracy", (0.4599, 0.5548, 0.6012, 0.6324)),
    _paper("WikiText-2 (test)", "text wikitext", "word_perplexity", (29.41, 22.76, 19.93, 18.34)),
    _paper("PTB (test)", "text", "word_perplexity", (65.85, 47.33, 40.31, 35.76)),
    _paper("WikiText-103 (test)", "text wikitext", "word_perplexity", (37.50, 26.37, 22.05, 17.48)),
    _paper("enwik8 (test)", "text", "bits_per_byte", (1.16, 1.01, 0.97, 0.93)),
    _paper("text8 (test)", "text", "bits_per_byte", (1.17, 1.06, 1.02, 0.98)),
    {"gpt2": Figure(("lambada",), "accuracy", 0.3256, "lambada_openai", LM_EVAL_2159)},
    {"gpt2": Figure(("lambada",), "perplexity", 40.0554, "lambada_openai", LM_EVAL_2159)},
    {"gpt2-xl": Figure(("lambada",), "perplexity", 10.63, "lambada_openai", LM_EVAL_911)},
]


def official_size(model: str) -> str | None:
    """'gpt2' for gpt2 or openai-community/gpt2, ...; None for anything else (a path, another id)."""
    name = model.removeprefix("openai-community/")
    return name if name in SIZES else None


def published(model: str, task: str) -> list[Figure]:
    """The figures published for an official model id on a task (empty for other models)."""
    size = official_size(model)
    if size is None:
        return []
    return [row[size] for row in _TABLE if size in row and task in row[size].tasks]
