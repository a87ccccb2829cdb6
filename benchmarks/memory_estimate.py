"""The training memory estimate against the real peak: `gpt2-port train` in a fresh process per configuration, its
printed estimate beside its peak RSS (VmHWM), as a ratio.

    python -m benchmarks.memory_estimate [--sizes gpt2 gpt2-large] [--steps 2] [--json PATH]

Each size trains a random official-layout checkpoint (written once under weights/<size>-random unless it is there)
for --steps steps on tiny shakespeare (prepared once), evaluation at the last step and the save at the end included:
- gpt2: 4 x 256, with and without gradient checkpointing, reference and fast kernels, float32 and bf16 autocast;
- the larger sizes: 1 x 1024 with gradient checkpointing (how gpt2-large fine-tunes on a 24 GiB machine).
The estimate must stay above the peak (ratio peak / estimate <= 1): a run it accepts then fits.
Not a test: minutes per configuration (gpt2-large: ~5 minutes and 15 GiB on the 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def configs(size: str) -> list[list[str]]:
    if size == "gpt2":
        base = ["--batch-size", "4", "--block-size", "256"]
        bf16 = [*base, "--dtype", "bf16"]
        return [
            base,
            [*base, "--grad-checkpointing"],
            [*base, "--kernels", "fast"],
            [*bf16, "--kernels", "reference"],
            [*bf16, "--kernels", "fast"],
        ]
    return [["--batch-size", "1", "--block-size", "1024", "--grad-checkpointing"]]


def run_one(ckpt: Path, data: Path, extra: list[str], steps: int, tmp: Path) -> dict:
    out, js = tmp / "out", tmp / "summary.json"
    cmd = [sys.executable, "-m", "gpt2_port", "train", "--init", str(ckpt), "--data", str(data), "--out", str(out)]
    cmd += ["--steps", str(steps), "--dropout", "0.0", "--eval-every", str(steps), "--eval-batches", "1"]
    cmd += ["--no-plot", "--json", str(js), *extra]
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL)
    s = json.loads(js.read_text())
    return {
        "options": " ".join(extra),
        "estimate_mb": s["memory_estimate_mb"],
        "peak_rss_mb": s["peak_rss_mb"],
        "peak_over_estimate": s["peak_rss_mb"] / s["memory_estimate_mb"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["gpt2"], choices=["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from gpt2_port.io.demo import write_demo_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="gpt2port-memest-") as t:
        data = Path(t) / "data"
        subprocess.run(
            [sys.executable, "-m", "gpt2_port", "prepare", str(SHAKESPEARE), "--out", str(data)],
            check=True,
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=subprocess.DEVNULL,
        )
        for size in a.sizes:
            ckpt = REPO / "weights" / f"{size}-random"
            if not (ckpt / "model.safetensors").is_file():
                write_demo_checkpoint(ckpt, size=size, seed=0)
            for k, extra in enumerate(configs(size)):
                run_dir = Path(t) / f"{size}-{k}"
                run_dir.mkdir()
                r = {"size": size, **run_one(ckpt, data, extra, a.steps, run_dir)}
                print(json.dumps(r), file=sys.stderr)
                rows.append(r)
    text = json.dumps(rows, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
