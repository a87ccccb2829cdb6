"""`gpt2-port eval --wikitext`: lm-evaluation-harness's `wikitext` task on WikiText's raw file (one document per
article, each de-tokenized, words and bytes counted before), and HellaSwag's raw rows turned into lm-eval's prompt."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from gpt2_port.cli import main
from gpt2_port.eval.tasks import hellaswag_prompt
from gpt2_port.eval.wikitext import detokenize, is_title, split_pages, words

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

# WikiText's raw layout: a blank line of one space first, titles ` = T = `, sections ` = = S = = `, every line
# starting and ending with a space, tokens spaced, numbers split by @-@ / @,@ / @.@
RAW = "".join(
    line + " \n"
    for line in [
        "",
        " = Robert Boulter =",
        "",
        " Robert Boulter is an English film , television and theatre actor . He had a guest @-@ role in 2000 .",
        "",
        " = = Career = =",
        "",
        " = = = 2000 – 2005 = = =",
        "",
        ' In 2006 , Boulter earned 1 @,@ 500 pounds ( about $ 2 @.@ 5 k ) , in " Citizenship " . It \'s 30 ° C .',
        "",
        " = Du Fu =",
        "",
        " Du Fu ( 712 – 770 ) was a poet of the Tang dynasty . Critics ' views : \" It 's a poem \" , he said .",
        "",
    ]
)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["eval", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_raw_file_is_cut_into_its_articles_with_their_sections() -> None:
    pages = split_pages(RAW)
    assert len(pages) == 2
    assert pages[0].startswith(" = Robert Boulter = \n") and " = = Career = = " in pages[0]
    assert " = = = 2000 – 2005 = = = " in pages[0] and pages[1].startswith(" = Du Fu = \n")
    assert "\n".join(pages) == RAW[len(" \n") :]  # nothing lost but the blank line before the first title
    # a title is "= X =" as a whole line; a line of text that starts with "= " is not one
    assert is_title(" = Du Fu = \n") and not is_title(" = = Career = = ")
    assert not is_title(" = 2 + 2 is four , a line of text ")
    assert len(split_pages(" = A = \n = 2 + 2 is four , a line \n")) == 1


def test_the_detokenizer_gives_plain_text() -> None:
    line = " He earned 1 @,@ 500 pounds ( about $ 2 @.@ 5 k ) , a guest @-@ starring role . "
    assert detokenize(line) == " He earned 1,500 pounds (about $ 2.5 k), a guest-starring role. "
    assert detokenize(' " It \'s a poem " , he said . ') == ' "It\'s a poem", he said. '
    assert detokenize(" = = Career = = \n It was 30 ° C . ") == " == Career ==\nIt was 30°C. "


def test_words_are_lm_evals_count_of_the_raw_page() -> None:
    page = split_pages(RAW)[1]
    assert words(page) == len(re.split(r"\s+", page)) > words(detokenize(page))
    assert words(" a  b\n c ") == 5  # a leading and a trailing empty word, as re.split gives


def _pages_as_texts(tmp_path: Path) -> list[Path]:
    out = []
    for i, page in enumerate(split_pages(RAW)):
        f = tmp_path / f"page{i}.txt"
        f.write_text(detokenize(page), encoding="utf-8")
        out.append(f)
    return out


def test_each_article_is_scored_as_its_own_document_with_the_raw_pages_counts(
    tiny_official: Path, tmp_path: Path, capsys
) -> None:
    raw = tmp_path / "wiki.test.raw"
    raw.write_text(RAW, encoding="utf-8")
    common = ["--max-length", "16", "--batch-size", "1", "--no-progress", "--json", "-"]
    rc, out, _ = run(capsys, str(tiny_official), "--wikitext", str(raw), *common)
    assert rc == 0
    got = json.loads(out)
    # the same as scoring each de-tokenized article as a text of its own (its own <|endoftext|> first)
    parts = [
        json.loads(run(capsys, str(tiny_official), "--text", str(f), *common)[1]) for f in _pages_as_texts(tmp_path)
    ]
    assert got["tokens"] == sum(p["tokens"] for p in parts) and got["windows"] == sum(p["windows"] for p in parts)
    assert got["nll"] == pytest.approx(sum(p["nll"] for p in parts), rel=1e-12)
    pages = split_pages(RAW)
    assert got["documents"] == 2 and got["task"] == "wikitext"
    assert got["words"] == sum(len(re.split(r"\s+", p)) for p in pages) != sum(p["words"] for p in parts)
    assert got["bytes"] == sum(len(p.encode()) for p in pages) != sum(p["bytes"] for p in parts)
    assert got["word_perplexity"] == pytest.approx(math.exp(got["nll"] / got["words"]), rel=1e-12)
    # scoring the raw file as one text is another measure: WikiText's tokenization, one document
    whole = json.loads(run(capsys, str(tiny_official), "--text", str(raw), *common)[1])
    assert whole["tokens"] != got["tokens"]


def test_the_datasets_pages_as_json_lines_give_the_same_scores(tiny_official: Path, tmp_path: Path, capsys) -> None:
    raw, jsonl = tmp_path / "wiki.test.raw", tmp_path / "pages.jsonl"
    raw.write_text(RAW, encoding="utf-8")
    jsonl.write_text("".join(json.dumps({"page": p}) + "\n" for p in split_pages(RAW)), encoding="utf-8")
    common = ["--max-length", "16", "--no-progress", "--json", "-"]
    a = json.loads(run(capsys, str(tiny_official), "--wikitext", str(raw), *common)[1])
    b = json.loads(run(capsys, str(tiny_official), "--wikitext", str(jsonl), *common)[1])
    assert {k: a[k] for k in ("tokens", "nll", "words", "bytes", "documents")} == {
        k: b[k] for k in ("tokens", "nll", "words", "bytes", "documents")
    }


def test_check_scores_the_same_windows_with_transformers(tiny_official: Path, tmp_path: Path, capsys) -> None:
    raw = tmp_path / "wiki.test.raw"
    raw.write_text(RAW, encoding="utf-8")
    rc, out, _ = run(
        capsys, str(tiny_official), "--wikitext", str(raw), "--max-length", "16", "--check", "--no-noise-floor",
        "--no-progress", "--json", "-",
    )  # fmt: skip
    assert rc == 0
    check = json.loads(out)["check"]
    assert check["passed"] and {r["quantity"] for r in check["rows"]} >= {"total nll"}


# -- HellaSwag's raw rows: lm-eval's prompt ------------------------------------------------------------------------
ROW = {
    "activity_label": "Personal Care and Style",
    "ctx_a": "[header] How to get long hair [title] Eat well.",
    "ctx_b": "a Healthy DIET helps",
    "ctx": "[header] How to get long hair [title] Eat well. a Healthy DIET helps",
    "endings": ["your hair  grow. [step] Eat protein.", " it shine.", "[substeps] nothing.", "it fall out."],
    "label": "0",
}


def test_a_hellaswag_row_gets_lm_evals_query_and_choices() -> None:
    query, choices = hellaswag_prompt(ROW)
    # ctx_b capitalised as str.capitalize does (the rest lowercased), " [title]" a full stop, other [..] dropped
    assert query == "Personal Care and Style: How to get long hair. Eat well. A healthy diet helps"
    # stripped before the markup goes: "[substeps] nothing." keeps the space that followed it, as lm-eval's does
    assert choices == ["your hair grow. Eat protein.", "it shine.", " nothing.", "it fall out."]


def test_hellaswag_rows_are_scored_on_lm_evals_prompt_unless_raw_is_asked(
    tiny_official: Path, tmp_path: Path, capsys
) -> None:
    rows, plain = tmp_path / "hs.jsonl", tmp_path / "plain.jsonl"
    rows.write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "label": 2}) + "\n", encoding="utf-8")
    query, choices = hellaswag_prompt(ROW)
    plain.write_text(
        json.dumps({"ctx": query, "endings": choices, "label": 0}) + "\n"
        + json.dumps({"ctx": query, "endings": choices, "label": 2}) + "\n",
        encoding="utf-8",
    )  # fmt: skip
    common = ["--no-progress", "--json", "-", "--check", "--no-noise-floor"]
    lm = json.loads(run(capsys, str(tiny_official), "--choices", str(rows), *common)[1])
    same = json.loads(run(capsys, str(tiny_official), "--choices", str(plain), *common)[1])
    raw = json.loads(run(capsys, str(tiny_official), "--choices", str(rows), "--hellaswag-prompt", "raw", *common)[1])
    assert lm["prompt"] == "lm-eval hellaswag" and raw["prompt"] == same["prompt"] == "as given"
    nll = [r for r in lm["check"]["rows"] if r["quantity"] == "total nll"][0]["ours"]
    assert nll == [r for r in same["check"]["rows"] if r["quantity"] == "total nll"][0]["ours"]
    assert nll != [r for r in raw["check"]["rows"] if r["quantity"] == "total nll"][0]["ours"]


def test_a_context_of_only_whitespace_is_named(tiny_official: Path, tmp_path: Path, capsys) -> None:
    f = tmp_path / "ws.jsonl"
    f.write_text(json.dumps({"ctx": "ok", "endings": ["a"], "label": 0}) + "\n" + json.dumps(
        {"ctx": "   ", "endings": ["a", "b"], "label": 0}) + "\n")  # fmt: skip
    rc, _, err = run(capsys, str(tiny_official), "--choices", str(f), "--no-progress")
    assert rc == 2 and "line 2: the context is only whitespace" in err and "Traceback" not in err


def test_the_papers_wikitext_figures_stand_beside_the_task() -> None:
    from gpt2_port.eval.published import published

    got = {f.dataset for f in published("gpt2", "wikitext")}
    assert got == {"WikiText-2 (test)", "WikiText-103 (test)"}
    assert {f.dataset for f in published("gpt2", "text")} > got and not published("gpt2", "choices")
