"""Evaluation speed and memory: scored tokens/s of the rolling evaluation of 124M against transformers on the same
windows, and the peak RSS of `evaluate_text` as the text grows (windows are streamed).

    python -m benchmarks.eval_speed speed  [--windows 8] [--rounds 5] [--batch-size 4] [--ckpt DIR]
    python -m benchmarks.eval_speed memory [--mb 1 10] [--full-mb 0.1 1]
    python -m benchmarks.eval_speed order  [--docs 96] [--rounds 2] [--batch-size 8] [--ckpt DIR]
    python -m benchmarks.eval_speed host   [--batch-size 8] [--tokens 1024] [--rounds 50]

speed: a random-weight 124M checkpoint in the official layout (written once with write_demo_checkpoint unless --ckpt
is given), the first --windows rolling windows (1024 tokens) of tiny shakespeare, scored in one process, in rounds
that alternate ours and transformers on the same batches (interleaved, so the shared machine's load hits both):
- gpt2_port: the product path (`model_scorer`: hidden states, the head on the scored rows, the shared loss);
- transformers (same scorer): GPT2LMHeadModel's transformer + lm_head through the same batching and loss;
- transformers (logits): GPT2LMHeadModel(ids).logits for the whole batch, then the same loss on the scored rows --
  how a user of transformers scores windows.
Both sdpa attention, float32, CPU. The ratio is the median of per-round ratios.

order: LAMBADA-shaped passages of 15 to 160 words cut from tiny shakespeare (seeded), batched in file order and
longest first (what `evaluate_lambada` does), ours and transformers (same scorer) in interleaved rounds; the tokens
each order pads to and the speed-up.

host: score_batch's host work per batch (building it, checking its ids, indexing, summing) with a stand-in scorer
whose forward and head return zeros: the share a GPU waits on between batches when the host is the slower side.

memory: one fresh process per (mode, text size), tiny shakespeare repeated to N MB, peak RSS (ru_maxrss):
- `full`: the whole rolling evaluation (`evaluate_text`, batch 8, max-length 1024) with a small random model of
  GPT-2's vocabulary (1 layer, 16 wide: the streaming is what is measured, not the model);
- `stream`: the same pipeline without the model (read, encode, cut into windows, batch), which is the only part
  whose work grows with the file: the model sees batches of the same shape whatever the file's size;
- `whole`: for contrast, the text read and encoded at once and every window built up front (what streaming avoids).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
TOKENIZER = REPO.parent / "shared" / "gpt2-tokenizer"


def _models(ckpt: str | None) -> tuple:
    """(temporary folder or None, transformers' model, ours as a scorer, transformers through the same scorer) on
    the 124M checkpoint at `ckpt`, or on one written into a temporary folder (random weights, the official layout)."""
    from transformers import GPT2LMHeadModel

    from gpt2_port.eval.score import Scorer, model_scorer
    from gpt2_port.io.demo import write_demo_checkpoint
    from gpt2_port.model import from_pretrained

    tmp = None
    if ckpt is None:
        tmp = tempfile.TemporaryDirectory(prefix="evalbench-")
        ckpt = write_demo_checkpoint(Path(tmp.name) / "gpt2", size="gpt2", seed=0, tokenizer_dir=TOKENIZER)
    ours = model_scorer(from_pretrained(ckpt)[0])
    ref = GPT2LMHeadModel.from_pretrained(ckpt, attn_implementation="sdpa").eval()
    same = Scorer("transformers", lambda x: ref.transformer(input_ids=x).last_hidden_state, ref.lm_head, ours.device)
    return tmp, ref, ours, same


def speed(args: argparse.Namespace) -> dict:
    from gpt2_port.eval.score import batched, score_batch
    from gpt2_port.eval.windows import rolling_requests
    from gpt2_port.io.tokenizer import load_tokenizer
    from gpt2_port.model.loss import token_nll

    torch.set_num_threads(args.threads) if args.threads else None
    tmp, ref, ours, same = _models(args.ckpt)
    tok = load_tokenizer(TOKENIZER)
    M = 1024
    ids = tok.encode(SHAKESPEARE.read_text())
    reqs = []
    for r in rolling_requests([ids], tok.eot_id, M):
        reqs.append(r)
        if len(reqs) == args.windows:
            break
    batches = list(batched(reqs, args.batch_size))
    n_tokens = sum(len(r.continuation) for r in reqs)

    def hf_logits(batch: list) -> list[float]:  # transformers the usual way: full logits, then the shared loss
        inputs = [r.model_input(M) for r in batch]
        T = max(len(x) for x in inputs)
        x = torch.full((len(batch), T), tok.eot_id)
        for i, inp in enumerate(inputs):
            x[i, : len(inp)] = torch.tensor(inp)
        with torch.inference_mode():
            logits = ref(x).logits  # (B, T, V)
            out = []
            for i, (r, inp) in enumerate(zip(batch, inputs)):
                n = len(r.continuation)
                rows = logits[i, len(inp) - n : len(inp)]  # (n, V)
                out.append(float(token_nll(rows, torch.tensor(r.continuation)).double().sum()))
        return out

    runners = {
        "gpt2_port": lambda b: score_batch(ours, b, M, tok.eot_id, want_greedy=False)[0],
        "transformers_same_scorer": lambda b: score_batch(same, b, M, tok.eot_id, want_greedy=False)[0],
        "transformers_logits": hf_logits,
    }
    for f in runners.values():  # warm-up: one batch each
        f(batches[0])
    times: dict[str, list[float]] = {k: [] for k in runners}
    nll: dict[str, float] = {}
    for rnd in range(args.rounds):
        order = list(runners) if rnd % 2 == 0 else list(reversed(runners))
        for name in order:
            t0 = time.perf_counter()
            total = sum(sum(runners[name](b)) for b in batches)
            times[name].append(time.perf_counter() - t0)
            nll[name] = total
    tps = {k: [n_tokens / t for t in v] for k, v in times.items()}
    res = {
        "windows": len(reqs),
        "tokens": n_tokens,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "tok_per_s_median": {k: statistics.median(v) for k, v in tps.items()},
        "ratio_vs_same_scorer": statistics.median(
            a / b for a, b in zip(tps["gpt2_port"], tps["transformers_same_scorer"])
        ),
        "ratio_vs_logits": statistics.median(a / b for a, b in zip(tps["gpt2_port"], tps["transformers_logits"])),
        "nll": nll,
        "nll_max_rel_diff": max(abs(v - nll["gpt2_port"]) / abs(nll["gpt2_port"]) for v in nll.values()),
    }
    if tmp is not None:
        tmp.cleanup()
    return res


def memory_one(mode: str, mb: float, ckpt: str) -> dict:
    """In this process: one (mode, size) run; peak RSS before and after the work."""
    from gpt2_port.devices import peak_rss_mb
    from gpt2_port.eval.perplexity import evaluate_text
    from gpt2_port.eval.score import batched, model_scorer
    from gpt2_port.eval.windows import rolling_requests, token_chunks
    from gpt2_port.io.text import read_text_pieces
    from gpt2_port.io.tokenizer import load_tokenizer
    from gpt2_port.model import from_pretrained

    base = SHAKESPEARE.read_bytes()
    with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as f:
        size = int(mb * 1e6)
        while size > 0:
            f.write(base[:size])
            size -= len(base)
        path = f.name
    tok = load_tokenizer(TOKENIZER)
    model = from_pretrained(ckpt)[0] if mode == "full" else None
    before = peak_rss_mb()
    t0 = time.perf_counter()
    if mode == "full":
        tokens = evaluate_text([model_scorer(model)], tok.encode, path, 1024, tok.eot_id, batch_size=8)["gpt2_port"]
        tokens = tokens.tokens
    elif mode == "stream":
        reqs = rolling_requests(token_chunks(read_text_pieces(path), tok.encode), tok.eot_id, 1024)
        tokens = sum(len(r.continuation) for b in batched(reqs, 8) for r in b)
    else:
        reqs = list(rolling_requests([tok.encode(Path(path).read_text())], tok.eot_id, 1024))
        tokens = sum(len(r.continuation) for r in reqs)
    Path(path).unlink()
    return {
        "mode": mode,
        "mb": mb,
        "tokens": tokens,
        "seconds": time.perf_counter() - t0,
        "peak_rss_MB_before": before,
        "peak_rss_MB": peak_rss_mb(),
    }


def memory(args: argparse.Namespace) -> dict:
    from gpt2_port.config import GPT2Config
    from gpt2_port.io.demo import write_demo_checkpoint

    out = []
    with tempfile.TemporaryDirectory(prefix="evalmem-") as tmp:
        cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=1024)
        ckpt = write_demo_checkpoint(Path(tmp) / "m", config=cfg, seed=0, tokenizer_dir=TOKENIZER)
        for mode, sizes in (("stream", args.mb), ("whole", args.mb), ("full", args.full_mb)):
            for mb in sizes:
                r = subprocess.run(
                    [sys.executable, "-m", "benchmarks.eval_speed", "_memory_one", mode, str(mb), str(ckpt)],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=REPO,
                )
                out.append(json.loads(r.stdout.splitlines()[-1]))
                print(json.dumps(out[-1]), file=sys.stderr)
    return {"runs": out}


def passages(n: int, seed: int = 0) -> list[dict]:
    """n LAMBADA-shaped documents ({"text": ...}) cut from tiny shakespeare at random: 15-40, 40-90 or 90-160
    words, a third of each (real LAMBADA passages vary as much: the spread is what batching order meets)."""
    import random

    words = SHAKESPEARE.read_text().split()
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        k = rng.choice([rng.randint(15, 40), rng.randint(40, 90), rng.randint(90, 160)])
        start = rng.randrange(len(words) - k)
        docs.append({"text": " ".join(words[start : start + k]), "_line": i + 1})
    return docs


def order(args: argparse.Namespace) -> dict:
    """LAMBADA batched in file order against longest first (`evaluate_lambada`'s order), for ours and for
    transformers through the same scorer, interleaved rounds in one process."""
    from gpt2_port.eval.score import Scorer, batched, longest_first, score_batch
    from gpt2_port.eval.tasks import lambada_requests
    from gpt2_port.io.tokenizer import load_tokenizer

    tmp, _ref, ours, same = _models(args.ckpt)
    tok = load_tokenizer(TOKENIZER)
    reqs = lambada_requests(passages(args.docs), tok.encode, tok.eot_id, "--lambada")
    M, B = 1024, args.batch_size
    file_order = [list(range(i, min(i + B, len(reqs)))) for i in range(0, len(reqs), B)]
    orders = {"file order": file_order, "longest first": list(longest_first(reqs, M, B))}
    assert [len(b) for b in batched(reqs, B)] == [len(b) for b in file_order]

    def run(scorer: Scorer, batches: list[list[int]]) -> float:
        return sum(sum(score_batch(scorer, [reqs[i] for i in b], M, tok.eot_id, "document", b)[0]) for b in batches)

    runners = {f"{s.name}, {o}": (s, orders[o]) for s in (ours, same) for o in orders}
    times: dict[str, list[float]] = {k: [] for k in runners}
    nll: dict[str, float] = {}
    for rnd in range(args.rounds):
        for name in list(runners) if rnd % 2 == 0 else list(reversed(runners)):
            t0 = time.perf_counter()
            nll[name] = run(*runners[name])
            times[name].append(time.perf_counter() - t0)
            print(f"round {rnd}: {name} {times[name][-1]:.1f} s", file=sys.stderr)
    padded = {o: sum(len(b) * max(len(reqs[i].model_input(M)) for i in b) for b in bs) for o, bs in orders.items()}
    res = {
        "docs": len(reqs),
        "batch_size": B,
        "rounds": args.rounds,
        "input_tokens": sum(len(r.model_input(M)) for r in reqs),
        "padded_tokens": padded,
        "seconds_median": {k: statistics.median(v) for k, v in times.items()},
        "speedup_longest_first": {
            s.name: statistics.median(
                a / b for a, b in zip(times[f"{s.name}, file order"], times[f"{s.name}, longest first"])
            )
            for s in (ours, same)
        },
        "nll": nll,
        "nll_max_rel_diff": max(
            abs(v - nll["gpt2_port, file order"]) / abs(nll["gpt2_port, file order"]) for v in nll.values()
        ),
    }
    if tmp is not None:
        tmp.cleanup()
    return res


def host(args: argparse.Namespace) -> dict:
    """score_batch's host work alone: a stand-in scorer whose forward and head return zeros (and a zero loss), so
    what is timed is building the batch, checking its ids, indexing and summing: what a GPU waits on between
    batches when the host is the slower side."""
    import random

    from gpt2_port.eval import score
    from gpt2_port.eval.windows import Request

    rng = random.Random(0)
    reqs = [Request([50256], [rng.randrange(50257) for _ in range(args.tokens)]) for _ in range(args.batch_size)]
    s = score.Scorer(
        "stand-in",
        lambda ids: torch.zeros(*ids.shape, 4),  # (B, T, 4)
        lambda h: torch.zeros(len(h), 8),  # (N, 8)
        torch.device("cpu"),
        vocab_size=50257,
    )
    real = score.token_nll
    score.token_nll = lambda logits, t: torch.zeros(len(t))
    try:
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            score.score_batch(s, reqs, args.tokens, 50256, want_greedy=False)
            times.append(time.perf_counter() - t0)
    finally:
        score.token_nll = real
    return {"batch": args.batch_size, "tokens": args.tokens, "host_ms_median": 1e3 * statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eval_speed")
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--windows", type=int, default=8)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--batch-size", type=int, default=4)
    s.add_argument("--threads", type=int, default=0)
    s.add_argument("--ckpt", default=None)
    o = sub.add_parser("order")
    o.add_argument("--docs", type=int, default=96)
    o.add_argument("--rounds", type=int, default=2)
    o.add_argument("--batch-size", type=int, default=8)
    o.add_argument("--ckpt", default=None)
    h = sub.add_parser("host")
    h.add_argument("--batch-size", type=int, default=8)
    h.add_argument("--tokens", type=int, default=1024)
    h.add_argument("--rounds", type=int, default=50)
    m = sub.add_parser("memory")
    m.add_argument("--mb", type=float, nargs="+", default=[1.0, 10.0], help="sizes for stream and whole")
    m.add_argument("--full-mb", type=float, nargs="+", default=[0.1, 1.0], help="sizes for the full evaluation")
    one = sub.add_parser("_memory_one")
    one.add_argument("mode", choices=["full", "stream", "whole"])
    one.add_argument("mb", type=float)
    one.add_argument("ckpt")
    args = p.parse_args()
    if args.what == "_memory_one":
        print(json.dumps(memory_one(args.mode, args.mb, args.ckpt)))
        return
    res = {"speed": speed, "order": order, "host": host, "memory": memory}[args.what](args)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
