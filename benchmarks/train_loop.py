"""Training-loop speed and memory: `gpt2-port train`'s step against the same loop in transformers, on 124M.

Both loops take the same batches (one GlobalBatchSampler, same seed) from the same .bin, start from the same
random official-layout checkpoint, and run AdamW (weight decay on 2+-dim weights, same lr) with gradient clipping
at 1.0 in float32 with dropout off. Ours is `Trainer.step` (the exact code `gpt2-port train` runs); transformers' is
`GPT2LMHeadModel` (sdpa attention) + `torch.optim.AdamW` + `clip_grad_norm_`, the loss from its logits by the same
float32 cross-entropy. The steps are interleaved in one process (ours, theirs, ours, ...) so that the load of a
shared machine falls on both alike; the ratio is theirs / ours of the median step time.

Peak RSS is measured in fresh processes (one per implementation, same steps). DDP: `torchrun --nproc_per_node 2`
of `gpt2-port train` against one process with `--grad-accum 2` (same global batch), their tokens/s and whether the
losses agree.

    python -m benchmarks.train_loop --steps 6 --batch-size 4 --block-size 128 --json benchmarks/results-train.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
TOKENIZER = REPO.parent / "shared" / "gpt2-tokenizer"
LR, WD, BETAS, EPS, CLIP = 6e-4, 0.1, (0.9, 0.95), 1e-8, 1.0


def prepare(work: Path) -> tuple[Path, Path]:
    """A random 124M checkpoint in the official layout and tiny shakespeare as train.bin (90% of the text)."""
    from gpt2_port.io.demo import write_demo_checkpoint
    from gpt2_port.io.tokenizer import load_tokenizer

    ck = work / "ck"
    if not (ck / "model.safetensors").exists():
        write_demo_checkpoint(ck, size="gpt2", seed=0, tokenizer_dir=TOKENIZER)
    data = work / "data"
    if not (data / "train.bin").exists():
        data.mkdir(parents=True, exist_ok=True)
        text = CORPUS.read_text()
        enc = load_tokenizer(TOKENIZER).enc
        n = int(len(text) * 0.9)
        np.array(enc.encode_ordinary(text[:n]), dtype="<u2").tofile(data / "train.bin")
        np.array(enc.encode_ordinary(text[n:]), dtype="<u2").tofile(data / "val.bin")
    return ck, data


class Ours:
    def __init__(self, ck: Path, data: Path, batch: int, block: int, steps: int) -> None:
        from gpt2_port.model import from_pretrained
        from gpt2_port.train import TrainArgs, Trainer, prepare_model
        from gpt2_port.train.data import TokenFile

        args = TrainArgs(steps=steps, batch_size=batch, block_size=block, lr=LR, min_lr=LR, schedule="constant")
        args.weight_decay, args.clip, args.dropout, args.eval_every = WD, CLIP, 0.0, 0
        model, _ = from_pretrained(ck)
        prepare_model(model, args, torch.device("cpu"))
        self.trainer = Trainer(model, args, TokenFile(data / "train.bin", 50257), None, tempfile.mkdtemp())
        self.i = 0

    def step(self) -> float:
        r = self.trainer.step(self.i)
        self.i += 1
        return r["train_loss"]


class Theirs:
    def __init__(self, ck: Path, data: Path, batch: int, block: int, steps: int) -> None:
        import transformers

        from gpt2_port.train.data import GlobalBatchSampler, TokenFile

        self.model = transformers.GPT2LMHeadModel.from_pretrained(ck, attn_implementation="sdpa")
        for m in self.model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)  # as `train` runs it
        self.data = TokenFile(data / "train.bin", 50257)
        self.sampler = GlobalBatchSampler(len(self.data), block, batch, 1, 1, 1337)
        self.block = block

    def step(self) -> float:
        offsets = self.sampler.next_step(0)
        x, y = self.data.windows(offsets[0], self.block)
        logits = self.model(input_ids=x).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss)


IMPLS = {"ours": Ours, "transformers": Theirs}


def interleaved(ck: Path, data: Path, batch: int, block: int, steps: int) -> dict:
    loops = {name: cls(ck, data, batch, block, steps + 1) for name, cls in IMPLS.items()}
    times: dict[str, list[float]] = {n: [] for n in loops}
    losses: dict[str, list[float]] = {n: [] for n in loops}
    for i in range(steps + 1):  # the first step of each warms up (allocator, kernels) and is not timed
        for name, loop in loops.items():
            t0 = time.perf_counter()
            losses[name].append(loop.step())
            if i:
                times[name].append(time.perf_counter() - t0)
    tokens = batch * block
    out = {
        n: {
            "median_step_s": statistics.median(t),
            "steps_per_s": 1 / statistics.median(t),
            "tokens_per_s": tokens / statistics.median(t),
            "times_s": t,
            "losses": losses[n],
        }
        for n, t in times.items()
    }
    out["ratio_speed_ours_over_transformers"] = out["transformers"]["median_step_s"] / out["ours"]["median_step_s"]
    out["first_loss_abs_diff"] = abs(losses["ours"][0] - losses["transformers"][0])
    return out


def rss_child(impl: str, ck: str, data: str, batch: int, block: int, steps: int) -> None:
    from gpt2_port.devices import peak_rss_mb

    loop = IMPLS[impl](Path(ck), Path(data), batch, block, steps)
    for _ in range(steps):
        loop.step()
    print(json.dumps({"peak_rss_mb": peak_rss_mb()}))


def peak_rss(ck: Path, data: Path, batch: int, block: int, steps: int) -> dict:
    out = {}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for impl in IMPLS:
        code = (
            f"from benchmarks.train_loop import rss_child; "
            f"rss_child({impl!r}, {str(ck)!r}, {str(data)!r}, {batch}, {block}, {steps})"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
        if r.returncode:
            raise RuntimeError(r.stderr[-2000:])
        out[impl] = json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    out["ratio_rss_ours_over_transformers"] = out["ours"] / out["transformers"]
    return out


def ddp(ck: Path, data: Path, work: Path, batch: int, block: int, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    common = [
        "train",
        "--init",
        str(ck),
        "--data",
        str(data),
        "--steps",
        str(steps),
        "--batch-size",
        str(batch),
        "--block-size",
        str(block),
        "--dropout",
        "0",
        "--eval-every",
        "0",
        "--no-plot",
        "--device",
        "cpu",
        "--no-memory-check",
    ]
    runs = {
        "ddp_2_processes": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "gpt2_port",
            *common,
            "--out",
            str(work / "ddp2"),
            "--json",
            str(work / "ddp2.json"),
        ],
        "1_process_grad_accum_2": [
            sys.executable,
            "-m",
            "gpt2_port",
            *common,
            "--grad-accum",
            "2",
            "--out",
            str(work / "ddp1"),
            "--json",
            str(work / "ddp1.json"),
        ],
    }
    for d in ("ddp2", "ddp1"):
        shutil.rmtree(work / d, ignore_errors=True)
    out = {}
    for name, cmd in runs.items():
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if r.returncode:
            raise RuntimeError(r.stderr[-2000:])
        js = work / ("ddp2.json" if name.startswith("ddp") else "ddp1.json")
        s = json.loads(js.read_text())
        logf = work / ("ddp2" if name.startswith("ddp") else "ddp1") / "log.jsonl"
        recs = [json.loads(line) for line in logf.read_text().splitlines()]
        rates = [r["tokens_per_s"] for r in recs[1:]] or [recs[-1]["tokens_per_s"]]
        out[name] = {
            "wall_s": time.perf_counter() - t0,
            "median_tokens_per_s": statistics.median(rates),
            "losses": [r["train_loss"] for r in recs],
            "elapsed_s": s["elapsed_s"],
        }
    a, b = out["ddp_2_processes"]["losses"], out["1_process_grad_accum_2"]["losses"]
    out["max_loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--work", default=str(REPO / "weights" / "bench-train"))
    p.add_argument("--skip", nargs="*", default=[], choices=["speed", "rss", "ddp"])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ck, data = prepare(work)
    res: dict = {
        "config": {
            "model": "gpt2 (124M, random weights)",
            "batch_size": a.batch_size,
            "block_size": a.block_size,
            "steps": a.steps,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "device": "cpu",
        }
    }
    if "speed" not in a.skip:
        res["interleaved"] = interleaved(ck, data, a.batch_size, a.block_size, a.steps)
        i = res["interleaved"]
        print(
            f"step: ours {i['ours']['median_step_s']:.2f}s ({i['ours']['tokens_per_s']:.0f} tok/s), transformers "
            f"{i['transformers']['median_step_s']:.2f}s ({i['transformers']['tokens_per_s']:.0f} tok/s): "
            f"ours {i['ratio_speed_ours_over_transformers']:.2f}x"
        )
    if "rss" not in a.skip:
        res["peak_rss_mb"] = peak_rss(ck, data, a.batch_size, a.block_size, 3)
        r = res["peak_rss_mb"]
        print(
            f"peak RSS: ours {r['ours']:.0f} MB, transformers {r['transformers']:.0f} MB "
            f"({r['ratio_rss_ours_over_transformers']:.2f}x)"
        )
    if "ddp" not in a.skip:
        res["ddp"] = ddp(ck, data, work, 2, 64, 4)
        dd = res["ddp"]
        print(
            f"DDP 2 processes: {dd['ddp_2_processes']['median_tokens_per_s']:.0f} tok/s; 1 process grad-accum 2: "
            f"{dd['1_process_grad_accum_2']['median_tokens_per_s']:.0f} tok/s; losses agree to "
            f"{dd['max_loss_rel_diff']:.1e}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
