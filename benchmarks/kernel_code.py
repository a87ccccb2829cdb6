"""What the decode step's Triton kernels compile to for an NVIDIA GPU, read on any machine: nothing runs, no GPU is
needed. Each kernel is compiled through its own launch function (the library's, with the arguments a decode step
gives it at a GPT-2 size's shapes, so triton specialises it as it would on the GPU) by triton's compiler and the
ptxas it ships, for the architecture asked (sm_90: H100/H200; sm_80: A100), and the machine code read back:

- registers a thread, and local memory (register spills: none expected), shared memory;
- the global loads by width (LDG.E.128: 16 bytes a thread, the widest; LDG.E.U16: one 16-bit value);
- the bytes a program asks for before its first barrier (threads x the loads' widths): what is in flight while it
  waits. For the matmuls (`_norm_linear`) beside the program's slice of the weight and one tile of it: a step's
  matmuls are a few microseconds each, so how much of the weight a program asks for before it waits on anything is
  what their time depends on.

    python -m benchmarks.kernel_code [--arch 90] [--sizes gpt2 gpt2-xl] [--dtypes float32 bfloat16 float16]
                                     [--rows 1 4] [--json F] [--plot F.png]

The weights are in the checkpoint's layout (each Linear's weight a transposed view of the [in, out] tensor), the
layout a model loads with on CUDA (io/load.py). Triton's interpreter (TRITON_INTERPRET=1) compiles nothing: refused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import torch

from gpt2_port.config import PRESETS

ARCHS = (80, 90)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WIDTH = {"128": 16, "64": 8, "": 4, "U16": 2, "S16": 2, "U8": 1, "S8": 1}  # an LDG.E's suffix -> bytes a thread


class CompileFor:
    """What triton asks a GPU driver when it compiles, answered for `arch` (nothing is launched: `warmup` only)."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_target(self):  # noqa: ANN201
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return self.arch  # a device per architecture: each kernel keeps its compiled code by device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class Compiled:
    """Stands for a kernel (`module.name`) while a launch function runs: `kernel[grid](...)` compiles it with those
    arguments and keeps the result."""

    def __init__(self, kernel, found: list) -> None:  # noqa: ANN001
        self.kernel, self.found = kernel, found

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def call(*args: object, **kwargs: object) -> None:
            self.found.append(self.kernel.warmup(*args, grid=grid, **kwargs))

        return call


@contextlib.contextmanager
def compiling_for(arch: int) -> Iterator[list]:
    """Inside: each library kernel's launch compiles it for `arch` and appends the CompiledKernel to the list."""
    from triton.runtime.driver import driver

    from gpt2_port.generate import accept_triton, greedy_pick_triton
    from gpt2_port.model import add_norm_triton, decode_attention_triton, norm_linear_triton

    kernels = [
        (norm_linear_triton, "norm_linear_kernel"),
        (norm_linear_triton, "add_norm_kernel"),
        (add_norm_triton, "add_layer_norm_kernel"),
        (decode_attention_triton, "decode_attention_kernel"),
        (decode_attention_triton, "combine_kernel"),
        (greedy_pick_triton, "argmax_finite_kernel"),
        (accept_triton, "accept_kernel"),
    ]
    found: list = []
    saved = driver._active
    driver.set_active(CompileFor(arch))
    kept = [getattr(m, name) for m, name in kernels]
    try:
        for m, name in kernels:
            setattr(m, name, Compiled(getattr(m, name), found))
        yield found
    finally:
        for (m, name), k in zip(kernels, kept, strict=True):
            setattr(m, name, k)
        driver._active = saved


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def read_code(kernel) -> dict:  # noqa: ANN001
    """A CompiledKernel's machine code, summarised (the module docstring's list)."""
    with tempfile.TemporaryDirectory(prefix="gpt2port-sass-") as t:
        cubin = Path(t) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True, check=True
        )
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, check=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage.stdout)
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line: {usage.stdout[:200]!r}")
    threads = kernel.metadata.num_warps * 32
    loads: dict[str, int] = {}
    before_barrier, barrier_seen = 0, False
    for op in re.findall(r"\b(LDG\.E(?:\.(?:128|64|U16|S16|U8|S8))?|BAR\.SYNC)\b", sass.stdout):
        if op == "BAR.SYNC":
            barrier_seen = True
            continue
        loads[op] = loads.get(op, 0) + 1
        if not barrier_seen:
            before_barrier += WIDTH[op[len("LDG.E.") :]] * threads  # "LDG.E" -> "": 4 bytes
    return {
        "kernel": kernel.metadata.name,
        "registers": int(m[1]),
        "local_bytes": int(m[4]),
        "shared_bytes": int(m[3]),
        "threads": threads,
        "loads": loads,
        "asked_before_first_barrier": before_barrier,
    }


def step_inputs(rows: int, slots: int, dtype: torch.dtype) -> SimpleNamespace:
    """A StaticKVCache's step inputs alone (its keys and values, which the token-taking kernel does not touch, would
    be gigabytes at 1.5B): what accept_triton.launch feeds."""
    ints = [torch.zeros(rows, 1, dtype=torch.long) for _ in range(3)]
    bias = torch.zeros(rows, slots, dtype=dtype)
    return SimpleNamespace(tok=ints[0], origin=ints[1], pos=ints[2], slot=torch.zeros(1, dtype=torch.long), bias=bias)


def launches(size: str, dtype: torch.dtype, rows: int) -> list[tuple[str, Callable[[], object], dict]]:
    """(what, the launch, the weight's bytes: a program's slice and one tile) for each kernel a decode step of `rows`
    rows runs at `size` (norm_linear's weights only)."""
    import triton

    from gpt2_port.generate import accept_triton as ac
    from gpt2_port.generate import greedy_pick_triton as gp
    from gpt2_port.model import add_norm_triton as an
    from gpt2_port.model import decode_attention_triton as da
    from gpt2_port.model import norm_linear_triton as nl

    cfg = PRESETS[size]
    C, nh, L = cfg.n_embd, cfg.n_head, cfg.n_positions
    hs = C // nh
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    def weight(k: int, n: int) -> torch.Tensor:
        return r(k, n).t()  # (n, k): a view of the checkpoint's [in, out] tensor

    norm, eps, x, d = (r(C), r(C)), 1e-5, r(rows, C), r(rows, C)
    ids = torch.zeros(rows, dtype=torch.long)
    wte, wpe = r(cfg.vocab_size, C), r(L, C)
    c_attn, c_proj, c_fc, mlp_proj = weight(C, 3 * C), weight(C, C), weight(C, 4 * C), weight(4 * C, C)
    splits = nl.split_of(C, C, rows)[0]
    parts = torch.randn(splits, rows, C, generator=g)

    def sizes(w: torch.Tensor, split: bool = False, *whole: int) -> dict:
        """The weight's bytes a program reads (its slice) and a tile of them; `whole`: the bytes a value of each row
        the norm reads whole before its first wait (x and d, or x, each partial sum)."""
        bb, bk = nl._blocks(rows)
        k = w.shape[1]
        ks = nl.split_of(k, w.shape[0], rows)[1] if split else bk * -(-k // bk)
        e = w.element_size()
        out = {"weight_slice_bytes": min(ks, k) * nl.BN * e, "weight_tile_bytes": bk * nl.BN * e}
        out["tiles_ahead"] = nl.ahead(w)
        if whole:  # (BB, KB) of each: the norm's loads, masked lanes included
            out["norm_rows_bytes"] = bb * triton.next_power_of_2(k) * sum(whole)
        return out

    e, p4 = x.element_size(), parts.shape[0] * 4
    q = r(rows, 1, nh, hs).transpose(1, 2)  # (B, nh, 1, hs)
    kv = r(2, rows, 1, nh, hs).transpose(2, 3)  # (2, B, nh, 1, hs)
    cache, bias, slot = r(2, rows, nh, L, hs), r(rows, L), torch.zeros(1, dtype=torch.long)
    # the benchmark's generation (16 + 128 tokens: 192 slots), and a full context's
    short = (cache[..., :192, :].contiguous(), bias[:, :192].contiguous(), slot, hs**-0.5)
    attend_long = lambda: da.launch(q, kv, cache, bias, slot, hs**-0.5)  # noqa: E731

    taken = (ids, slot[0], ids > 0, ids, 0, 50256)  # choice, status, running rows, column, padding, EOS
    fed = (step_inputs(rows, L, dtype), 17)  # a static cache's step inputs, and the slot to feed

    def matmul(what: str, w: torch.Tensor, mode: int, *whole: int, gelu: bool = False) -> tuple:
        """A `_norm_linear` launch as the step makes it: mode 3 from the embeddings' rows, 2 from x and the partials
        (then the norm), 0 from rows alone into partials."""
        n, k = w.shape
        given = {3: (wte, wpe, None, None, (ids, ids)), 2: (x, None, parts, r(C), None)}
        args = given.get(mode, (r(rows, k), None, None, None, None))
        launch = lambda: nl.launch(mode, *args, norm if mode else None, eps, w, r(n), gelu, mode == 0)  # noqa: E731
        return what, launch, sizes(w, mode == 0, *whole)

    out = [
        matmul("c_attn, the embeddings' lookup and ln_1 before it", c_attn, 3, e, e),
        matmul("c_attn, the partials' add and ln_1 before it", c_attn, 2, e, p4),
        matmul("attn.c_proj, into partials", c_proj, 0),
        matmul("mlp.c_fc and GELU, the add and ln_2 before it", c_fc, 2, e, p4, gelu=True),
        matmul("mlp.c_proj, into partials", mlp_proj, 0),
        ("ln_f, the partials' add before it", lambda: nl.launch_add_norm(x, parts, r(C), norm, eps), {}),
        ("add and layer norm", lambda: an.launch(x, d, *norm, eps), {}),
        ("add and layer norm, the embeddings' lookup", lambda: an.launch_gather(ids, ids, wte, wpe, *norm, eps), {}),
        ("cache write and attention, 192 slots", lambda: da.launch(q, kv, *short), {}),
        ("cache write and attention, 1,024 slots (split when few rows and heads)", attend_long, {}),
        ("argmax and finite check", lambda: gp.launch(r(rows, cfg.vocab_size)), {}),
        ("the tokens taken into the sequence, the next step fed", lambda: ac.launch(*taken, feed=fed), {}),
    ]
    return out


def survey(arch: int, sizes: list[str], dtypes: list[str], rows: list[int]) -> list[dict]:
    found_rows = []
    with compiling_for(arch) as found:
        for size in sizes:
            for name in dtypes:
                for b in rows:
                    for what, launch, weights in launches(size, DTYPES[name], b):
                        found.clear()
                        launch()
                        for kernel in found:  # a split attention launches two
                            row = {"arch": f"sm_{arch}", "size": size, "dtype": name, "rows": b, "what": what}
                            row.update(read_code(kernel), **weights)
                            print(json.dumps(row), file=sys.stderr, flush=True)
                            found_rows.append(row)
    return found_rows


def table(rows: list[dict]) -> str:
    head = (
        "| arch | size | dtype | rows | kernel | what | registers | spilled | loads | asked before its first barrier |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        loads = ", ".join(f"{k.removeprefix('LDG.E') or '.32'} {v}" for k, v in sorted(r["loads"].items()))
        asked = f"{r['asked_before_first_barrier'] / 1024:.1f} KiB"
        if "weight_slice_bytes" in r:
            asked += f" (weight: {r['weight_slice_bytes'] / 1024:.1f} KiB a program, tiles of {r['weight_tile_bytes'] / 1024:.1f})"  # noqa: E501
        lines.append(
            f"| {r['arch']} | {r['size']} | {r['dtype']} | {r['rows']} | `{r['kernel']}` | {r['what']} | "
            f"{r['registers']} | {r['local_bytes']} B | {loads} | {asked} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    from gpt2_port.plots import pyplot, save_png

    mm = [r for r in rows if "weight_slice_bytes" in r]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(mm) + 1.5))
    labels = [f"{r['arch']} {r['size']} {r['dtype']} x{r['rows']}: {r['what'][:44]}" for r in mm]
    ys = range(len(mm))
    ax.barh(ys, [r["weight_slice_bytes"] / 1024 for r in mm], color="#ccc", label="the program's weight slice")
    label = "asked for before its first wait (the norm's rows too)"
    ax.barh(ys, [r["asked_before_first_barrier"] / 1024 for r in mm], height=0.5, label=label)
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("KiB a program")
    ax.set_title("_norm_linear: reads in flight before a program's first barrier")
    ax.legend(fontsize=8)
    save_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90], choices=ARCHS)
    p.add_argument("--sizes", nargs="+", default=["gpt2", "gpt2-xl"], choices=list(PRESETS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4], choices=[1, 2, 3, 4])
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of the matmuls' reads in flight here")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("error: TRITON_INTERPRET is set: triton's interpreter compiles nothing; run without it", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("error: triton is not installed (pyproject's dev extra brings it): nothing to compile", file=sys.stderr)
        return 2
    if not Path(_tool("cuobjdump")).is_file():
        print(f"error: triton {triton.__version__} ships no cuobjdump ({_tool('cuobjdump')})", file=sys.stderr)
        return 2
    rows = [r for arch in a.arch for r in survey(arch, a.sizes, a.dtypes, a.rows)]
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
