"""`gpt2-port eval MODEL`: zero-shot perplexity / bits per byte of a text or a prepared split, LAMBADA accuracy,
multiple choice."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .common import (
    add_device_arg,
    add_model_arg,
    add_progress_arg,
    add_revision_arg,
    add_tokenizer_arg,
    check_input_file,
    check_outputs,
    checkpoint_inputs,
    data_inputs,
    file_input,
    report_written,
    tokenizer_inputs,
)

EPILOG = """\
--text FILE: rolling windows by default, exactly lm-evaluation-harness's loglikelihood_rolling (disjoint windows of
--max-length tokens; the first token conditioned on <|endoftext|>, later windows on the token before them, the last
partial window on as much context as fits). --stride S: the transformers docs' sliding window on <|endoftext|> + text
(windows every S tokens, each scoring only tokens no earlier window scored). Every token is scored exactly once.
JSON keys: tokens, nll (nats), perplexity (per token), bytes, bits_per_byte, byte_perplexity, words, word_perplexity.

--wikitext FILE: lm-evaluation-harness's wikitext task on WikiText's raw file (wiki.test.raw of wikitext-2-raw-v1 or
-103; or a .jsonl of {"page": ...}, the EleutherAI/wikitext_document_level pages): one document per article, each
scored after lm-eval's de-tokenizer with its own rolling windows; words and bytes counted on the article as the file
has it. JSON keys: as --text, and documents. (--text on the raw file scores WikiText's tokenization as one text.)

--lambada FILE.jsonl: lambada_openai's format ({"text": ...} per line); the target is the last word with its leading
space. JSON keys: accuracy (every target token is the argmax), perplexity (exp of the mean word NLL), n.

--choices FILE.jsonl: {"ctx": ..., "endings": [...], "label": k} per line; each ending scored after one space.
A HellaSwag row (with activity_label, ctx_a, ctx_b) is asked as lm-eval's hellaswag asks it: "activity_label: ctx_a
Ctx_b" and the endings without WikiHow's [title]/[step] markup (--hellaswag-prompt raw: ctx and endings as given,
build-nanogpt's way). JSON keys: acc, acc_norm (log-likelihood divided by the ending's length in characters,
lm-eval's), n, prompt.

--data DIR: the .bin split `gpt2-port prepare` wrote (--split val by default): its tokens scored like a text's
(rolling or strided windows, every token once, the first conditioned on <|endoftext|>; between the documents of a
split, the <|endoftext|> prepare put there is scored as a token). bytes and words come from DIR/meta.json (prepare
records them), so bits_per_byte and word_perplexity need no text; a meta.json without them leaves those keys null.

--check: score the same windows with transformers' GPT2LMHeadModel in the same run and report the differences
(exit 1 if any is over its tolerance), each beside the reference's own noise floor: the same difference between
transformers' eager and sdpa attention, which score the windows too (--no-noise-floor: sdpa only).
"""


OOM_HINT = "a smaller --batch-size (or --max-length; with --check, --no-noise-floor loads one model fewer)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="zero-shot evaluation: perplexity, bits per byte, LAMBADA, multiple choice",
        description="Score a text, LAMBADA or multiple-choice file with MODEL, with lm-evaluation-harness's "
        "methods; --check scores the same windows with transformers in the same run.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arg(p)
    task = p.add_mutually_exclusive_group(required=True)
    task.add_argument("--text", metavar="FILE", help="a UTF-8 text: its log-likelihood, perplexity and bits per byte")
    task.add_argument(
        "--wikitext", metavar="FILE", help="lm-eval's wikitext: WikiText's raw file (wiki.test.raw), per article"
    )
    task.add_argument("--lambada", metavar="FILE", help="LAMBADA in lambada_openai's JSONL format")
    task.add_argument("--choices", metavar="FILE", help="multiple choice, HellaSwag's shape, as JSONL")
    task.add_argument("--data", metavar="DIR", help="a split gpt2-port prepare wrote (DIR/val.bin by default)")
    p.add_argument("--split", choices=["val", "train"], default=None, help="--data: which .bin to score (val)")
    p.add_argument(
        "--hellaswag-prompt",
        choices=["lm-eval", "raw"],
        default=None,
        help="--choices: HellaSwag rows as lm-eval asks them (default), or their ctx and endings as given",
    )
    p.add_argument("--max-length", type=int, default=None, metavar="N", help="tokens per window (default: n_positions)")
    p.add_argument("--stride", type=int, default=None, metavar="S", help="--text: strided windows every S tokens")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="windows per forward pass (default 8)")
    add_device_arg(p)
    p.add_argument("--dtype", default="float32", help="float32 (default), float16 or bfloat16")
    add_revision_arg(p)
    add_tokenizer_arg(p)
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON (- for stdout)")
    p.add_argument("--markdown", metavar="PATH", default=None, help="write the results as a Markdown table")
    p.add_argument("--check", action="store_true", help="also score with transformers and report the differences")
    p.add_argument(
        "--noise-floor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --check: also score with transformers' eager attention and mark each difference within or above "
        "the distance between its eager and sdpa kernels (default: on with --check)",
    )
    add_progress_arg(p, "scored tokens")
    p.set_defaults(func=run, oom_hint=OOM_HINT)


def _rows(task: str, res: dict) -> list[tuple[str, str]]:
    text = ["tokens", "nll", "perplexity", "bytes", "bits_per_byte", "byte_perplexity", "words", "word_perplexity"]
    keys = {
        "text": text,
        "data": text,
        "wikitext": ["documents", *text],
        "lambada": ["n", "accuracy", "perplexity", "accuracy_last_token", "target_tokens"],
        "choices": ["n", "acc", "acc_norm"],
    }[task]
    return [
        (k, f"{res[k]:.6g}" if isinstance(res[k], float) else "n/a" if res[k] is None else str(res[k])) for k in keys
    ]


def _task(args: argparse.Namespace) -> str:
    for task in ("text", "wikitext", "lambada", "choices"):
        if getattr(args, task):
            return task
    return "data"


def _published_lines(model: str, task: str, res: dict, markdown: bool) -> list[str]:
    from ..eval.published import published

    figs = published(model, task)
    if not figs:
        return []
    out = ["", "Published figures (other data and methods: compare with care):"]
    if markdown:
        out = ["", "| dataset | metric | published | this run | source |", "|---|---|---:|---:|---|"]
    for f in figs:
        mine = f"{res[f.metric]:.4g}" if res.get(f.metric) is not None else "-"
        if markdown:
            out.append(f"| {f.dataset} | {f.metric} | {f.value:g} | {mine} | {f.source} |")
        else:
            out.append(f"  {f.dataset:<20} {f.metric:<16} {f.value:>9g}   (this run: {mine})  -- {f.source}")
    return out


def _inputs(args: argparse.Namespace) -> list:
    """Every file the run reads (files.Inputs), to keep --json and --markdown off them."""
    return (
        checkpoint_inputs(args.model)
        + tokenizer_inputs(args.tokenizer)
        + file_input(args.text, "--text")
        + file_input(args.wikitext, "--wikitext")
        + file_input(args.lambada, "--lambada")
        + file_input(args.choices, "--choices")
        + data_inputs(args.data)
    )


def run(args: argparse.Namespace) -> int:
    from ..devices import dtype_name as name_of
    from ..devices import memory_errors, parse_device, parse_dtype
    from ..errors import UsageError
    from ..eval.jsonl import read_jsonl
    from ..eval.perplexity import (
        check_text_file,
        check_window_args,
        count_text_tokens,
        evaluate_split,
        evaluate_text,
        open_split_for_eval,
    )
    from ..eval.published import published
    from ..eval.score import check_batch_size, model_scorer
    from ..eval.tasks import (
        check_choice_docs,
        choice_requests,
        evaluate_choices,
        evaluate_lambada,
        is_hellaswag_row,
        lambada_requests,
        scored_tokens,
    )
    from ..eval.wikitext import evaluate_wikitext, page_tokens, read_pages
    from ..files import write_output
    from ..io.tokenizer import check_tokenizer_dir, tokenizer_for
    from ..model import from_pretrained
    from .progress import Progress

    # every argument and input file is checked before the (slow) load
    task = _task(args)
    if args.stride is not None and task not in ("text", "data"):
        raise UsageError("--stride applies to --text only (and --data, a prepared text)")
    if args.stride is not None and args.stride <= 0:
        raise UsageError(f"--stride must be a positive integer, got {args.stride}")
    if args.max_length is not None and args.max_length <= 0:
        raise UsageError(f"--max-length must be a positive integer, got {args.max_length}")
    if args.stride is not None and args.max_length is not None and args.stride > args.max_length:
        raise UsageError(f"--stride {args.stride} is larger than --max-length {args.max_length} (expected <=)")
    if args.hellaswag_prompt is not None and task != "choices":
        raise UsageError(f"--hellaswag-prompt {args.hellaswag_prompt} applies to --choices only")
    if args.split is not None and task != "data":
        raise UsageError(f"--split {args.split} applies to --data only (it picks the prepared .bin to score)")
    args.split = args.split or "val"
    check_batch_size(args.batch_size)
    if args.noise_floor is not None and not args.check:
        flag = "--noise-floor" if args.noise_floor else "--no-noise-floor"
        raise UsageError(f"{flag}: only with --check (the floor is transformers' own, measured beside it)")
    dtype, device = parse_dtype(args.dtype), parse_device(args.device)
    if args.tokenizer is not None:
        check_tokenizer_dir(args.tokenizer)
    check_outputs([(o, p) for o, p in (("--json", args.json), ("--markdown", args.markdown)) if p], _inputs(args))
    docs = pages = None
    if task == "text":
        check_input_file(args.text, "--text", "a UTF-8 text file")
        check_text_file(args.text)
    elif task == "wikitext":
        check_input_file(args.wikitext, "--wikitext", "WikiText's raw file (wiki.test.raw) or JSON lines of pages")
        pages = read_pages(args.wikitext)
    elif task == "lambada":
        check_input_file(args.lambada, "--lambada", "JSON lines")
        docs = read_jsonl(args.lambada, "--lambada", {"text": str})
    elif task == "choices":
        check_input_file(args.choices, "--choices", "JSON lines")
        docs = read_jsonl(args.choices, "--choices", {"ctx": str, "endings": list, "label": int})
        check_choice_docs(docs, "--choices " + args.choices)
    else:  # the file, its size against meta.json and its dtype now; its ids against the vocabulary after the load
        open_split_for_eval(args.data, args.split, 1 << 16)

    model, report = from_pretrained(args.model, dtype=dtype, device=device, revision=args.revision)
    n_pos = model.config.n_positions
    max_length = args.max_length if args.max_length is not None else n_pos
    check_window_args(max_length, args.stride, n_pos)
    tok = tokenizer_for(report.checkpoint.root, args.tokenizer)
    if tok.eot_id >= model.config.vocab_size:
        raise UsageError(
            f"{args.model}: the model's vocabulary of {model.config.vocab_size} tokens has no <|endoftext|> "
            f"({tok.eot_id}), which the evaluation needs as the first token's context"
        )
    split = None
    if task == "data":
        split = open_split_for_eval(args.data, args.split, model.config.vocab_size)
    scorers = [model_scorer(model)]
    dt = name_of(dtype)
    if args.check:
        from gpt2_port_checks.evaluation import NLL_RTOL, reference_scorer

        if dt not in NLL_RTOL:
            raise UsageError(f"--check: no tolerance for dtype {dt} (expected one of {', '.join(NLL_RTOL)})")
        scorers.append(reference_scorer(report.checkpoint, report.config, dtype, device))
        if args.noise_floor is not False:
            scorers.append(reference_scorer(report.checkpoint, report.config, dtype, device, attn="eager"))

    # the work to count: the tokens scored (known before scoring: a text is encoded once more to count them)
    reqs = qs = None
    if task == "text":
        total = count_text_tokens(args.text, tok.encode)
    elif task == "wikitext":
        tokens = page_tokens(pages, tok.encode)  # type: ignore[arg-type]
        total = sum(len(ids) for ids in tokens)
    elif task == "data":
        total = len(split[0])  # type: ignore[index]
    elif task == "lambada":
        reqs = lambada_requests(docs, tok.encode, tok.eot_id, "--lambada " + args.lambada)  # type: ignore[arg-type]
        total = scored_tokens(reqs)
    else:
        as_lm_eval = args.hellaswag_prompt != "raw"
        qs = choice_requests(docs, tok.encode, tok.eot_id, "--choices " + args.choices, as_lm_eval)  # type: ignore[arg-type]
        total = scored_tokens([r for q in qs for r in q[0]])
    bar = Progress("eval", total, "tokens") if args.progress else None
    update = bar.update if bar is not None else None
    t0 = time.perf_counter()
    during = f"scoring --batch-size {args.batch_size} windows of {max_length} tokens on {device} in {dt}"
    try:
        with memory_errors(during):  # the CLI adds OOM_HINT
            if task == "text":
                results = evaluate_text(
                    scorers, tok.encode, args.text, max_length, tok.eot_id, args.stride, args.batch_size, update
                )
            elif task == "wikitext":
                results = evaluate_wikitext(
                    scorers,
                    pages,
                    tokens,
                    max_length,
                    tok.eot_id,
                    args.batch_size,
                    update,  # type: ignore[arg-type]
                )
            elif task == "data":
                results = evaluate_split(
                    scorers,
                    *split,
                    args.split,
                    max_length,
                    tok.eot_id,
                    args.stride,
                    args.batch_size,
                    update,  # type: ignore[misc]
                )
            elif task == "lambada":
                results = evaluate_lambada(scorers, reqs, max_length, tok.eot_id, args.batch_size, update)  # type: ignore[arg-type]
            else:
                results = evaluate_choices(scorers, qs, max_length, tok.eot_id, args.batch_size, update)  # type: ignore[arg-type]
    except BaseException:
        if bar is not None:
            bar.abandon()
        raise
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - t0
    windowed = "rolling (lm-eval loglikelihood_rolling)" if args.stride is None else f"strided (stride {args.stride})"
    method = {
        "text": windowed,
        "wikitext": "wikitext (lm-eval): one document per article, de-tokenized, rolling windows; words and bytes "
        "of the article before de-tokenizing",
        "data": f"{windowed} over {Path(args.data or '') / (args.split + '.bin')}",
        "lambada": "lambada_openai (lm-eval): last word, greedy over all its tokens",
        "choices": "multiple choice (lm-eval): ending after one space; acc_norm per character",
    }[task]

    res = results["gpt2_port"].to_json()
    if task == "wikitext":
        res["documents"] = len(pages)  # type: ignore[arg-type]
    if task == "choices":
        asked = "lm-eval hellaswag" if as_lm_eval and any(is_hellaswag_row(d) for d in docs) else "as given"  # type: ignore[union-attr]
        res["prompt"] = asked
    parity = None
    if args.check:
        from gpt2_port_checks import evaluation as ev

        compare = {"text": ev.compare_text, "wikitext": ev.compare_text, "data": ev.compare_text}
        compare["lambada"] = ev.compare_lambada
        floor = results.get(ev.FLOOR)
        parity = compare.get(task, ev.compare_choices)(results["gpt2_port"], results[ev.REFERENCE], dt, floor)

    hub_id = args.model if report.checkpoint.from_hub else ""  # published figures are for the official files only
    header = f"{args.model} | {task}: {method} | max-length {max_length} | {device} {dt}"
    lines = [header] + [f"  {k:<20} {v}" for k, v in _rows(task, res)]
    lines += _published_lines(hub_id, task, res, markdown=False)
    if task == "data" and res["bytes"] is None:
        lines.append(f"  (no byte or word counts in {args.data}/meta.json: rerun gpt2-port prepare to record them)")
    if parity is not None:
        lines += ["", parity.format()]
    if args.json != "-" and args.markdown != "-":
        print("\n".join(lines))
    rate = total / elapsed if elapsed > 0 else 0.0
    print(
        f"scored in {elapsed:.2f}s: {total:,} tokens, {rate:,.0f} tokens/s (load {report.load_s:.2f}s)", file=sys.stderr
    )

    data = {
        "model": args.model,
        "task": task,
        "method": method,
        "max_length": max_length,
        "stride": args.stride,
        "batch_size": args.batch_size,
        "device": str(device),
        "dtype": dt,
        **res,
        "published": [
            {"dataset": f.dataset, "metric": f.metric, "value": f.value, "source": f.source}
            for f in published(hub_id, task)
        ],
    }
    if parity is not None:
        data["check"] = parity.to_json()
    written = []
    if args.json:
        written.append(write_output(args.json, json.dumps(data, indent=2) + "\n", "--json"))
    if args.markdown:
        md = [f"**{header}**", "", "| metric | value |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in _rows(task, res)]
        md += _published_lines(hub_id, task, res, markdown=True)
        md += parity.markdown() if parity is not None else []
        written.append(write_output(args.markdown, "\n".join(md) + "\n", "--markdown"))
    report_written(written)
    return 0 if parity is None or parity.passed else 1
