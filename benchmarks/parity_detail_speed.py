"""Wall time of `gpt2-port parity` at sub-layer detail (with its noise floor) against the spine's block-level report
without one (`--no-noise-floor`: the report the budget was set against; the default block report measures the floor
too).

The issue's budget: the sub-layer report for 124M on CPU in float32 takes no more than 3x the block-level one.
Runs alternate so that a busy machine slows both alike; the best of each is compared.

    python benchmarks/parity_detail_speed.py CHECKPOINT_DIR [--repeat 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="checkpoint directory (e.g. a 124M demo checkpoint)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("gpt2-port"))
    runs = {
        "block": [exe, "parity", args.model, "--no-noise-floor"],
        "sublayer": [exe, "parity", args.model, "--detail", "sublayer"],
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeat):
        for k, cmd in runs.items():
            times[k].append(wall(cmd))
    for k, ts in times.items():
        print(f"{k:<9} best {min(ts):6.2f}s  all {', '.join(f'{t:.2f}' for t in ts)}  ({' '.join(runs[k][1:])})")
    print(f"ratio sublayer / block: {min(times['sublayer']) / min(times['block']):.2f} (budget 3.0)")


if __name__ == "__main__":
    main()
