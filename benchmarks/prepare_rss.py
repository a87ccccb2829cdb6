"""Peak memory of `gpt2-port prepare` as the corpus grows, beside nanoGPT's in-memory prepare.py on the same text.

Builds tiny shakespeare repeated N times (N = 1, 10 and --repeat), runs `python -m gpt2_port prepare` on each in a child
process, and reads the child's peak RSS (wait4's ru_maxrss). Beside it, nanoGPT's data/shakespeare/prepare.py recipe
(read the whole file, split at 90% of the characters, encode_ordinary each part, np.uint16 tofile), run in a child on
the large corpus, and its .bin files compared byte for byte with ours.

    PYTHONPATH=$PWD python benchmarks/prepare_rss.py --repeat 100 --json /tmp/prepare_rss.json

Streamed, the peak RSS should not grow with the corpus; the in-memory recipe grows with it (the text, then a Python
list of ids). The machine is shared, so the seconds are noisy; the RSS figures are not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

NANOGPT_RECIPE = """
import sys, numpy as np
from gpt2_port.io.tokenizer import load_tokenizer
src, out, tok = sys.argv[1:4]
enc = load_tokenizer(tok).enc
with open(src, "r", encoding="utf-8") as f:
    data = f.read()
n = len(data)
np.array(enc.encode_ordinary(data[: int(n * 0.9)]), dtype=np.uint16).tofile(out + "/train.bin")
np.array(enc.encode_ordinary(data[int(n * 0.9) :]), dtype=np.uint16).tofile(out + "/val.bin")
"""


def run_child(argv: list[str]) -> tuple[float, float]:
    """Run argv; return (seconds, peak RSS in MB) of that child alone."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {p.returncode}")
    return time.perf_counter() - t0, usage.ru_maxrss / 1024  # Linux: ru_maxrss in KiB


def corpus(src: Path, repeat: int, dst: Path) -> Path:
    with open(dst, "wb") as f:
        for _ in range(repeat):
            with open(src, "rb") as s:
                shutil.copyfileobj(s, f)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=100, help="copies of tiny shakespeare in the large corpus")
    ap.add_argument("--text", default=str(SHARED / "data" / "tinyshakespeare" / "input.txt"))
    ap.add_argument("--tokenizer", default=str(SHARED / "gpt2-tokenizer"))
    ap.add_argument("--no-reference", action="store_true", help="skip nanoGPT's in-memory recipe")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="prepare_rss.") as tmp:
        for repeat in (1, 10, args.repeat):
            text = corpus(Path(args.text), repeat, Path(tmp) / f"x{repeat}.txt")
            out = Path(tmp) / f"ours{repeat}"
            cmd = [sys.executable, "-m", "gpt2_port", "prepare", str(text), "--out", str(out)]
            secs, rss = run_child([*cmd, "--tokenizer", args.tokenizer])
            meta = json.loads((out / "meta.json").read_text())
            mb = text.stat().st_size / 1e6
            rows.append({"impl": "gpt2-port prepare (streamed)", "corpus_mb": mb, "peak_rss_mb": rss, "seconds": secs,
                         "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"]})  # fmt: skip
        if not args.no_reference:
            ref = Path(tmp) / "ref"
            ref.mkdir()
            secs, rss = run_child([sys.executable, "-c", NANOGPT_RECIPE, str(text), str(ref), args.tokenizer])
            same = all((ref / n).read_bytes() == (out / n).read_bytes() for n in ("train.bin", "val.bin"))
            rows.append({"impl": "nanoGPT prepare.py recipe (in memory)", "corpus_mb": mb, "peak_rss_mb": rss,
                         "seconds": secs, "same_bin_files": same})  # fmt: skip
    print(f"{'implementation':<40}{'corpus MB':>10}{'peak RSS MB':>13}{'seconds':>9}")
    for r in rows:
        print(f"{r['impl']:<40}{r['corpus_mb']:>10.1f}{r['peak_rss_mb']:>13.0f}{r['seconds']:>9.1f}")
    if not args.no_reference:
        print(f"ours / nanoGPT peak RSS on {mb:.0f} MB: {rows[-2]['peak_rss_mb'] / rows[-1]['peak_rss_mb']:.3f}; "
              f"same .bin files: {rows[-1]['same_bin_files']}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
