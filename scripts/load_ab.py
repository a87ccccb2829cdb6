"""Load time of this checkout's gpt2_port against another commit's: fresh processes, alternating, warm page cache.

    python scripts/load_ab.py MODEL_DIR --base COMMIT [--rounds 5]

Each round starts one process per side (the order alternating), which imports the package and calls
`from_pretrained(MODEL_DIR)`; it reports the time from before the import to a ready model, and the load alone.
The other commit's `gpt2_port/` is extracted as `gpt2_port_base` (see decode_ab.py). A tool of the checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_ab import REPO, extract  # noqa: E402

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import importlib
load = importlib.import_module(sys.argv[1] + ".load")
t1 = time.perf_counter()
model, _ = load.from_pretrained(sys.argv[2])
t2 = time.perf_counter()
print(json.dumps({"ready_s": t2 - t0, "load_s": t2 - t1}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--base", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        extract(args.base, Path(tmp))
        env = {**os.environ, "PYTHONPATH": f"{tmp}:{REPO}"}
        got: dict[str, list[dict]] = {"gpt2_port": [], "gpt2_port_base": []}
        for r in range(args.rounds + 1):  # round 0 warms the page cache and is dropped
            order = ["gpt2_port", "gpt2_port_base"] if r % 2 else ["gpt2_port_base", "gpt2_port"]
            for pkg in order:
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, pkg, args.model_dir], env=env, capture_output=True, text=True
                )
                if out.returncode:
                    raise SystemExit(out.stderr)
                if r:
                    got[pkg].append(json.loads(out.stdout))
    for key in ("ready_s", "load_s"):
        new = statistics.median(x[key] for x in got["gpt2_port"])
        base = statistics.median(x[key] for x in got["gpt2_port_base"])
        print(f"{key:8s} this {new:.3f}s  base {args.base} {base:.3f}s  this/base {new / base:.3f}")


if __name__ == "__main__":
    main()
