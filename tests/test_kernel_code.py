"""The decode step's Triton kernels compiled for real GPUs on this machine (benchmarks/kernel_code.py: triton's
compiler and the ptxas it ships, through each kernel's own launch function; nothing runs). The tests in
test_gpu_kernels.py run the kernels in triton's interpreter, which compiles nothing: a kernel that the interpreter runs
but the GPU compiler refuses, or that spills registers, would show only on a GPU, where the step would quietly take
torch's ops instead (gpu_kernel.py). Here every kernel the step launches, at the shapes of GPT-2 124M and 1.5B, is
compiled for an H100/H200 (sm_90) and an A100 (sm_80), and its machine code read:

- no local memory (no register spilled);
- each matmul (`_norm_linear`) reads the weight 16 bytes a thread (LDG.E.128), and a program has its first weight tiles
  in flight before its first barrier: `ahead` + 1 tiles where nothing comes first, `ahead` tiles besides the rows its
  norm reads whole where the norm comes first (norm_linear_triton.py's schedule; it had one tile in flight at a time).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="NOT RUN: triton is not installed (pyproject's dev extra brings it)")

REPO = Path(__file__).resolve().parents[1]
# benchmarks.kernel_code.launches: 5 matmuls, 3 norms, the attention over 192 slots and over 1,024 (two kernels where
# it is split), argmax, taking tokens
LAUNCHES_PER_STEP = 12


def surveyed(tmp_path: Path, *args: str) -> list[dict]:
    """benchmarks.kernel_code's rows for these arguments, in a process without triton's interpreter (conftest turns it
    on for this one, and an interpreted kernel compiles nothing)."""
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "benchmarks.kernel_code", *args, "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "arch, size, dtypes, rows",
    [
        ("90", "gpt2", ["float32", "bfloat16"], ["1", "4"]),
        ("90", "gpt2-xl", ["float32", "bfloat16"], ["1"]),
        ("80", "gpt2", ["float16"], ["1"]),
    ],
)
def test_every_decode_kernel_compiles_for_the_gpu_without_spilling_and_reads_its_weight_ahead(
    tmp_path: Path, arch: str, size: str, dtypes: list[str], rows: list[str]
) -> None:
    from gpt2_port.config import PRESETS
    from gpt2_port.model.decode_attention_triton import splits

    found = surveyed(tmp_path, "--arch", arch, "--sizes", size, "--dtypes", *dtypes, "--rows", *rows)
    split = [splits(int(b) * PRESETS[size].n_head, 1024)[0] > 1 for b in rows]  # the combine where split
    assert len(found) == len(dtypes) * sum(LAUNCHES_PER_STEP + s for s in split)
    names = {"_norm_linear", "_add_norm", "_add_layer_norm", "_decode_attention", "_argmax_finite", "_accept"}
    assert {r["kernel"] for r in found} == names | ({"_attention_combine"} if any(split) else set())
    for r in found:
        where = f"{r['arch']} {r['size']} {r['dtype']} x{r['rows']} {r['kernel']} ({r['what']})"
        assert r["local_bytes"] == 0, f"{where}: {r['local_bytes']} bytes of registers spilled"
        if r["kernel"] != "_norm_linear":
            continue
        wide = r["loads"].get("LDG.E.128", 0) * 16 * r["threads"]
        assert wide >= r["weight_slice_bytes"], f"{where}: {wide} bytes read 16 a thread, the weight is more"
        tile, ahead = r["weight_tile_bytes"], r["tiles_ahead"]
        if "norm_rows_bytes" in r:  # the norm's rows, then the tiles asked before them
            want = min(r["weight_slice_bytes"], ahead * tile) + r["norm_rows_bytes"]
        else:
            want = min(r["weight_slice_bytes"], (ahead + 1) * tile)
        assert r["asked_before_first_barrier"] >= want, f"{where}: {r['asked_before_first_barrier']} bytes in flight"


def test_the_token_taking_kernel_compiles_once_for_every_slot(tmp_path: Path) -> None:
    """The kernel that takes the tokens into the sequence feeds the next step's slot, a number that changes every
    token: triton would compile a kernel of its own for a slot of 1 and for a multiple of 16 (mid-generation compiles
    on the GPU); told not to specialise on it, slots 1, 16, 17 and 1000 compile to one kernel for sm_90."""
    script = (
        "import torch\n"
        "from benchmarks.kernel_code import compiling_for, step_inputs\n"
        "from gpt2_port.generate import accept_triton\n"
        "ids = torch.zeros(1, dtype=torch.long)\n"
        "with compiling_for(90) as found:\n"
        "    for at in (1, 16, 17, 1000):\n"
        "        feed = (step_inputs(1, 1024, torch.bfloat16), at)\n"
        "        accept_triton.launch(ids, ids[0], ids > 0, ids, 0, 50256, feed=feed)\n"
        "print(len(found), len({k.hash for k in found}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["4", "1"], done.stdout  # four launches, one compiled kernel
