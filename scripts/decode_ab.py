"""Decode speed of this checkout's gpt2_port against another commit's, in one process, runs interleaved.

    python scripts/decode_ab.py MODEL_DIR --base COMMIT [--dtype float32] [--new-tokens 128] [--prompt-len 16]
        [--rounds 5]

The other commit's `gpt2_port/` is extracted with `git archive` into a temporary directory under the name
`gpt2_port_base` (the package imports itself only relatively) and both load the same checkpoint. Each round times,
for each side in turn: `generate_full` greedy (DecodePlan steps and the fast greedy head), sampled (DecodePlan steps,
the full head and the logits processors), and a bare loop of `DecodePlan.step` calls. Reports the median decode
tok/s per side and the ratio this/base, and which greedy head each side used (None: the exact logits). A tool of the
checkout: the package never imports it.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def extract(commit: str, into: Path) -> None:
    """`git archive COMMIT gpt2_port` unpacked as into/gpt2_port_base."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", commit, "gpt2_port"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
    (into / "gpt2_port").rename(into / "gpt2_port_base")


def first_module(pkg: str, names: list[str], attr: str):  # noqa: ANN201
    """The first of `pkg.<name>` that exists and has `attr`: the package's layout changed over the commits (flat files
    before the folders: load.py, generate.py, decode.py, kv_cache.py)."""
    for name in names:
        try:
            mod = importlib.import_module(f"{pkg}.{name}")
        except ModuleNotFoundError:
            continue
        if hasattr(mod, attr):
            return mod
    raise SystemExit(f"{pkg}: none of {names} defines {attr}")


def runners(pkg: str, model_dir: str, prompt: torch.Tensor, new_tokens: int, dtype: torch.dtype) -> tuple[dict, str]:
    load = first_module(pkg, ["model", "load"], "from_pretrained")
    gen = first_module(pkg, ["generate.loop", "generate"], "generate_full")
    decode = first_module(pkg, ["model.decode", "decode"], "DecodePlan")
    kv = first_module(pkg, ["generate.cache", "kv_cache", "model"], "KVCache")
    model, _ = load.from_pretrained(model_dir, dtype=dtype)
    head = gen.generate_full(model, prompt, 2, eos_token_id=None).extra.get("fast_head_kind")

    def greedy() -> float:
        g = gen.generate_full(model, prompt, new_tokens, eos_token_id=None)
        assert g.extra["fast_step"] and (g.extra["fast_head"] or dtype != torch.float32)
        return g.decode_tok_per_s

    def sampled() -> float:
        g = gen.generate_full(model, prompt, new_tokens, do_sample=True, top_k=50, seed=0, eos_token_id=None)
        assert g.extra["fast_step"]
        return g.decode_tok_per_s

    @torch.no_grad()
    def plan_steps() -> float:
        B, T = prompt.shape
        cache = kv.KVCache(model.config, B, T + new_tokens, model.dtype, "cpu")
        model(prompt, cache=cache, hidden_only=True)
        plan = decode.DecodePlan.for_model(model)
        tok = prompt[:, -1:]
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            plan.step(tok, cache)
        return new_tokens / (time.perf_counter() - t0)

    return {"generate greedy": greedy, "generate sampled": sampled, "DecodePlan.step": plan_steps}, str(head)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="checkpoint directory (e.g. one written by `gpt2-port demo-checkpoint`)")
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. main)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="decode_ab_"))
    extract(args.base, tmp)
    sys.path.insert(0, str(tmp))
    prompt = torch.randint(0, 50257, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    sides, heads = {}, {}
    dtype = getattr(torch, args.dtype)
    for name, pkg in (("base", "gpt2_port_base"), ("this", "gpt2_port")):
        sides[name], heads[name] = runners(pkg, args.model, prompt, args.new_tokens, dtype)
    rates: dict[tuple[str, str], list[float]] = {}
    for fn in sides["base"].values():  # warm-up: the fast head's copy, allocator, MKL
        fn()
    for fn in sides["this"].values():
        fn()
    for r in range(args.rounds):
        order = ("base", "this") if r % 2 == 0 else ("this", "base")
        for task in sides["base"]:
            for side in order:
                rates.setdefault((task, side), []).append(sides[side][task]())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, base {args.base}, {args.rounds} rounds")
    print(f"{args.dtype}; greedy head: base {heads['base']}, this {heads['this']}")
    print(f"{'task':<18} {'base tok/s':>12} {'this tok/s':>12} {'this/base':>10}   (median; min-max)")
    for task in sides["base"]:
        b, t = rates[(task, "base")], rates[(task, "this")]
        mb, mt = statistics.median(b), statistics.median(t)
        print(
            f"{task:<18} {mb:12.1f} {mt:12.1f} {mt / mb:10.3f}   "
            f"(base {min(b):.1f}-{max(b):.1f}; this {min(t):.1f}-{max(t):.1f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
