"""lm-evaluation-harness's `wikitext` task on WikiText's own raw file (`wiki.test.raw` of wikitext-2-raw-v1 or
wikitext-103-raw-v1), or on the pages of `EleutherAI/wikitext_document_level` exported as JSON lines.

lm-eval does not score the file as one text. It reads it as `EleutherAI/wikitext_document_level` cuts it, one
document per article (`pages`), scores each article after its de-tokenizer (`detokenize`: WikiText's " @-@ ",
" , " and spaced brackets back to plain text) as a document of its own (rolling windows, the first token
conditioned on <|endoftext|>), and counts words and bytes on the article as the file has it, before the
de-tokenizer (lm-eval issue #806: counting them after made word perplexity 1.2x larger in the exponent). Scoring
the raw file whole gives neither its log-likelihood (WikiText's tokenization is scored) nor, after de-tokenizing
it whole, its counts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..errors import UsageError
from ..io.text import read_utf8
from .jsonl import read_jsonl
from .perplexity import TextResult, evaluate_requests
from .score import DEFAULT_BATCH_SIZE, Scorer
from .windows import Request, rolling_requests

_WHITESPACE_RUN = re.compile(r"\s+")


def is_title(line: str) -> bool:
    """An article's title line (` = Robert Boulter = `), as the dataset tells it from a section heading
    (` = = Career = = `): with the spaced runs of `=` joined, it starts with "= " and ends with " =" after strip."""
    joined = line.replace("= = =", "===").replace("= =", "==").strip()
    return joined.startswith("= ") and joined.endswith(" =")


def split_pages(text: str) -> list[str]:
    """The articles of a raw WikiText file, as `EleutherAI/wikitext_document_level` cuts them.

    The text is cut into lines at "\\n"; a title line starts a new page, which holds the title line and every line up
    to the next title, joined again with "\\n". A page before the first title is kept only if it holds more than
    whitespace; the last page always is.
    """
    pages, lines = [], []
    for line in text.split("\n"):
        if is_title(line):
            page = "\n".join(lines)
            if page.strip():
                pages.append(page)
            lines = []
        lines.append(line)
    pages.append("\n".join(lines))
    return pages


# The de-tokenizer lm-eval applies to each page (tasks/wikitext/preprocess_wikitext.py), in its order: plain
# replacements (old, new) and regular expressions (pattern, replacement). The second rule is written there as a
# pattern between slashes; it matches those characters literally (and so almost never), and is kept as written.
_DETOKENIZE: tuple[tuple[str, str, bool], ...] = (
    ("s '", "s'", False),  # contractions
    (r"/' [0-9]/", r"/'[0-9]/", True),
    (" @-@ ", "-", False),  # number separators
    (" @,@ ", ",", False),
    (" @.@ ", ".", False),
    (" : ", ": ", False),  # punctuation
    (" ; ", "; ", False),
    (" . ", ". ", False),
    (" ! ", "! ", False),
    (" ? ", "? ", False),
    (" , ", ", ", False),
    (r"\(\s*([^\)]*?)\s*\)", r"(\1)", True),  # brackets and quotes without their inner spaces
    (r"\[\s*([^\]]*?)\s*\]", r"[\1]", True),
    (r"{\s*([^}]*?)\s*}", r"{\1}", True),
    (r"\"\s*([^\"]*?)\s*\"", r'"\1"', True),
    (r"'\s*([^']*?)\s*'", r"'\1'", True),
    ("= = = =", "====", False),  # headings
    ("= = =", "===", False),
    ("= =", "==", False),
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}", False),
    (" \n", "\n", False),
    ("\n ", "\n", False),
    (" N ", " 1 ", False),
    (" 's", "'s", False),
)


def detokenize(page: str) -> str:
    """lm-eval's `wikitext_detokenizer`: the page as plain text, the text it scores."""
    for old, new, regex in _DETOKENIZE:
        page = re.sub(old, new, page) if regex else page.replace(old, new)
    return page


def words(page: str) -> int:
    """lm-eval's word count of a page: `len(re.split(r"\\s+", page))` (a leading space counts one empty word)."""
    return len(_WHITESPACE_RUN.split(page))


def read_pages(path: str | os.PathLike[str], flag: str = "--wikitext") -> list[str]:
    """The pages to score: a `.jsonl` file's `page` fields (the dataset exported), else the raw file cut by
    `split_pages` (read as the dataset reads it: UTF-8, "\\r\\n" and "\\r" as "\\n"). UsageError naming the file."""
    p = Path(path)
    if p.suffix.lower() == ".jsonl":
        return [d["page"] for d in read_jsonl(p, flag, {"page": str})]
    text = "".join(read_utf8(p, f"{flag} {p}"))
    if not text.strip():
        raise UsageError(f"{flag} {p}: the file holds no text (expected WikiText's raw file, e.g. wiki.test.raw)")
    return split_pages(text.replace("\r\n", "\n").replace("\r", "\n"))


def page_tokens(pages: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each page's scored tokens: its de-tokenized text encoded (once: the count for progress and the scoring share
    them; the pages are held anyway)."""
    return [encode(detokenize(page)) for page in pages]


def page_requests(tokens: Sequence[list[int]], eot_id: int, max_length: int) -> Iterator[Request]:
    """Each page's rolling windows (lm-eval's loglikelihood_rolling of one document), page after page."""
    for ids in tokens:
        yield from rolling_requests([ids], eot_id, max_length)


def evaluate_wikitext(
    scorers: Sequence[Scorer],
    pages: Sequence[str],
    tokens: Sequence[list[int]],
    max_length: int,
    eot_id: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: Callable[[int], None] | None = None,
) -> dict[str, TextResult]:
    """lm-eval's `wikitext` metrics over `pages` and their `page_tokens`: the log-likelihood summed over the pages'
    windows, words and bytes summed over the pages as the file has them (`word_perplexity` = exp(nll / words),
    lm-eval's weighted_perplexity)."""
    out = evaluate_requests(
        scorers, page_requests(tokens, eot_id, max_length), max_length, eot_id, batch_size, progress
    )
    n_words, n_bytes = sum(words(p) for p in pages), sum(len(p.encode("utf-8")) for p in pages)
    for res in out.values():
        if res.tokens == 0:
            raise UsageError("--wikitext: the pages encode to no tokens (expected some text to score)")
        res.bytes, res.words = n_bytes, n_words
    return out
