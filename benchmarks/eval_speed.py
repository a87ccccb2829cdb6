"""Evaluation speed and memory: scored tokens/s of the rolling evaluation of 124M against transformers on the same
windows, and the peak RSS of `evaluate_text` as the text grows (windows are streamed).

    python -m benchmarks.eval_speed speed  [--windows 8] [--rounds 5] [--batch-size 4] [--ckpt DIR]
    python -m benchmarks.eval_speed memory [--mb 1 10]

speed: a random-weight 124M checkpoint in the official layout (written once with write_demo_checkpoint unless --ckpt
is given), the first --windows rolling windows (1024 tokens) of tiny shakespeare, scored in one process, in rounds
that alternate ours and transformers on the same batches (interleaved, so the shared machine's load hits both):
- gpt2_port: the product path (`model_scorer`: hidden states, the head on the scored rows, the shared loss);
- transformers (same scorer): GPT2LMHeadModel's transformer + lm_head through the same batching and loss;
- transformers (logits): GPT2LMHeadModel(ids).logits for the whole batch, then the same loss on the scored rows --
  how a user of transformers scores windows.
Both sdpa attention, float32, CPU. The ratio is the median of per-round ratios.

memory: one fresh process per text size (tiny shakespeare repeated to N MB), the rolling evaluation with a small
random model of GPT-2's vocabulary (1 layer, 16 wide: the streaming is what is measured, not the model), peak RSS
(ru_maxrss) after the run, and the same process's RSS before it started scoring.
"""

from __future__ import annotations

import argparse
import json
import resource
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


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def speed(args: argparse.Namespace) -> dict:
    from transformers import GPT2LMHeadModel

    from gpt2_port.demo import write_demo_checkpoint
    from gpt2_port.evaluate import Scorer, batched, model_scorer, score_batch
    from gpt2_port.load import from_pretrained
    from gpt2_port.loss import token_nll
    from gpt2_port.tokenizer import load_tokenizer
    from gpt2_port.windows import rolling_requests

    torch.set_num_threads(args.threads) if args.threads else None
    tmp = None
    ckpt = args.ckpt
    if ckpt is None:
        tmp = tempfile.TemporaryDirectory(prefix="evalbench-")
        ckpt = write_demo_checkpoint(Path(tmp.name) / "gpt2", size="gpt2", seed=0, tokenizer_dir=TOKENIZER)
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

    ours_model, _ = from_pretrained(ckpt)
    ref = GPT2LMHeadModel.from_pretrained(ckpt, attn_implementation="sdpa").eval()
    ours = model_scorer(ours_model)
    same = Scorer("transformers", lambda x: ref.transformer(input_ids=x).last_hidden_state, ref.lm_head, ours.device)

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
        "gpt2_port": lambda b: score_batch(ours, b, M, tok.eot_id)[0],
        "transformers_same_scorer": lambda b: score_batch(same, b, M, tok.eot_id)[0],
        "transformers_logits": hf_logits,
    }
    for name, f in runners.items():  # warm-up: one batch each
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


def memory_one(mb: float, ckpt: str) -> dict:
    """In this process: score `mb` MB of repeated tiny shakespeare; peak RSS before and after scoring."""
    from gpt2_port.evaluate import evaluate_text, model_scorer
    from gpt2_port.load import from_pretrained
    from gpt2_port.tokenizer import load_tokenizer

    base = SHAKESPEARE.read_bytes()
    with tempfile.NamedTemporaryFile(suffix=".txt", delete=False) as f:
        size = int(mb * 1e6)
        while size > 0:
            f.write(base[:size])
            size -= len(base)
        path = f.name
    model, _ = from_pretrained(ckpt)
    tok = load_tokenizer(TOKENIZER)
    before = _rss_mb()
    t0 = time.perf_counter()
    res = evaluate_text([model_scorer(model)], tok.encode, path, 1024, tok.eot_id, batch_size=8)["gpt2_port"]
    Path(path).unlink()
    return {
        "mb": mb,
        "bytes": res.bytes,
        "tokens": res.tokens,
        "seconds": time.perf_counter() - t0,
        "peak_rss_MB_before_scoring": before,
        "peak_rss_MB": _rss_mb(),
    }


def memory(args: argparse.Namespace) -> dict:
    from gpt2_port.config import GPT2Config
    from gpt2_port.demo import write_demo_checkpoint

    out = []
    with tempfile.TemporaryDirectory(prefix="evalmem-") as tmp:
        cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=1024)
        ckpt = write_demo_checkpoint(Path(tmp) / "m", config=cfg, seed=0, tokenizer_dir=TOKENIZER)
        for mb in args.mb:
            r = subprocess.run(
                [sys.executable, "-m", "benchmarks.eval_speed", "_memory_one", str(mb), str(ckpt)],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
            )
            out.append(json.loads(r.stdout.splitlines()[-1]))
            print(json.dumps(out[-1]), file=sys.stderr)
    return {"runs": out, "peak_ratio_largest_over_smallest": out[-1]["peak_rss_MB"] / out[0]["peak_rss_MB"]}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eval_speed")
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--windows", type=int, default=8)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--batch-size", type=int, default=4)
    s.add_argument("--threads", type=int, default=0)
    s.add_argument("--ckpt", default=None)
    m = sub.add_parser("memory")
    m.add_argument("--mb", type=float, nargs="+", default=[1.0, 10.0])
    one = sub.add_parser("_memory_one")
    one.add_argument("mb", type=float)
    one.add_argument("ckpt")
    args = p.parse_args()
    if args.what == "_memory_one":
        print(json.dumps(memory_one(args.mb, args.ckpt)))
        return
    res = speed(args) if args.what == "speed" else memory(args)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
