"""Seeded fuzzer for the checkpoint loader: mutate valid safetensors files, load each one, demand a clean outcome.

Each case takes a tiny valid checkpoint (official layout or save_pretrained layout), applies 1-3 random mutations
(header bytes, the 8-byte header length, data_offsets, dtypes, shapes, JSON structure, truncation or extension of
the file), writes it to disk, and runs the whole load path (`read_checkpoint`: locate, header validation, config,
key/shape/mask validation in the adapter) and then reads every converted tensor. The only acceptable outcomes are a
successful load or the project's own `GPT2PortError`. Anything else is a finding:

- `exception`: some other exception escaped (the CLI would report it as an internal error);
- `crash`: the worker process died (segfault, abort, SIGBUS);
- `hang`: a case ran past its time budget;
- `memory`: peak RSS grew by more than 2x the file's size (+ a few MB of slack) during one case.

Crashing inputs are saved under --out (default out/fuzz) with a JSON note. Cases run in a worker subprocess, so a
crash is caught and attributed to its input. The test suite (`tests/test_fuzz.py`) runs a few thousand cases
in-process with the same generator; this script runs as many as you like:

    .venv/bin/python scripts/fuzz_safetensors.py --cases 100000 --seed 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpt2_port.config import GPT2Config
from gpt2_port.errors import GPT2PortError
from gpt2_port.io.adapter import hf_shapes
from gpt2_port.io.safetensors_io import write_safetensors

FUZZ_CONFIG = GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=8, vocab_size=16)
DTYPE_NAMES = [
    "F64",
    "F32",
    "F16",
    "BF16",
    "I64",
    "I32",
    "I16",
    "I8",
    "U8",
    "BOOL",
    "F8_E4M3",
    "F8_E5M2",
    "U16",
    "U32",
    "U64",
    "C64",
    "Q4",
    "",
    "f32",
]
WEIRD_VALUES: list[object] = [
    None,
    True,
    False,
    -1,
    -(2**63),
    2**31,
    2**32,
    2**62,
    2**63,
    2**64,
    2**70,
    10**30,
    1.5,
    1e308,
    float("inf"),
    "8",
    "",
    [],
    [1],
    {},
    {"a": 1},
    0,
]


# -- base files -----------------------------------------------------------------------------------------------------
def base_files(cfg: GPT2Config = FUZZ_CONFIG) -> list[bytes]:
    """Valid checkpoints to mutate: the official layout (float32, mask buffers, metadata) and save_pretrained's
    layout ('transformer.' prefix, float16, no buffers)."""
    g = torch.Generator().manual_seed(0)
    out = []
    with tempfile.TemporaryDirectory() as d:
        shapes = dict(hf_shapes(cfg))
        official = dict(shapes)
        official["h.0.attn.bias"] = (1, 1, cfg.n_positions, cfg.n_positions)
        entries = []
        for k, s in sorted(official.items()):
            t = (
                torch.tril(torch.ones(s[-1], s[-1])).view(s)
                if k.endswith(".attn.bias")
                else torch.randn(s, generator=g)
            )
            entries.append((k, s, torch.float32, lambda t=t: t))
        write_safetensors(Path(d) / "a.safetensors", entries, metadata={"format": "pt"})
        out.append((Path(d) / "a.safetensors").read_bytes())
        entries = [
            ("transformer." + k, s, torch.float16, lambda s=s: torch.randn(s, generator=g).half())
            for k, s in sorted(shapes.items())
        ]
        write_safetensors(Path(d) / "b.safetensors", entries)
        out.append((Path(d) / "b.safetensors").read_bytes())
    return out


# -- mutations ------------------------------------------------------------------------------------------------------
def _split(data: bytes) -> tuple[dict, bytes] | None:
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        return (header, data[8 + n :]) if isinstance(header, dict) else None
    except Exception:
        return None


def _join(header: object, body: bytes, rng: random.Random) -> bytes:
    hb = json.dumps(header, separators=(",", ":")).encode()
    if rng.random() < 0.5:
        hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + body


def _tensor_names(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def m_header_bytes(data: bytes, rng: random.Random) -> bytes:
    """Flip, insert or delete bytes inside the JSON header (the length field is left alone)."""
    (n,) = struct.unpack("<Q", data[:8]) if len(data) >= 8 else (0,)
    n = min(n, max(len(data) - 8, 0))
    if n == 0:
        return data
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = 8 + rng.randrange(n)
        op = rng.random()
        if op < 0.6:
            b[i] = rng.choice([rng.randrange(256), ord('"'), ord("{"), ord("}"), ord(","), ord(":"), ord("["), 0x80])
        elif op < 0.8:
            b[i:i] = bytes([rng.randrange(256)])
        else:
            del b[i]
    return bytes(b)


def m_length(data: bytes, rng: random.Random) -> bytes:
    """Rewrite the 8-byte little-endian header length."""
    (n,) = struct.unpack("<Q", data[:8]) if len(data) >= 8 else (0,)
    new = rng.choice(
        [
            0,
            1,
            2,
            n - 1,
            n + 1,
            n + rng.randint(-64, 64),
            len(data),
            len(data) - 8,
            len(data) - 7,
            2**32,
            2**63,
            2**64 - 1,
            100_000_001,
            rng.randrange(2**64),
        ]
    )
    return struct.pack("<Q", new % 2**64) + data[8:]


def m_offsets(data: bytes, rng: random.Random) -> bytes:
    """Change one tensor's data_offsets: shifted, swapped, out of range, overlapping, or not integers at all."""
    sp = _split(data)
    if sp is None or not _tensor_names(sp[0]):
        return m_header_bytes(data, rng)
    header, body = sp
    names = _tensor_names(header)
    name = rng.choice(names)
    ent = header[name]
    offs = ent.get("data_offsets") if isinstance(ent, dict) else None
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)):
        return m_header_bytes(data, rng)
    b, e = offs
    oth = header[rng.choice(names)]
    other = oth.get("data_offsets") if isinstance(oth, dict) else None
    other = other if isinstance(other, list) else [0, 0]
    ent["data_offsets"] = rng.choice(
        [
            [e, b],
            [b + 1, e + 1],
            [b - 1, e - 1],
            [b, e + rng.randint(1, 64)],
            [b, len(body) + 1],
            [len(body), len(body) + (e - b)],
            [-4, e - b - 4],
            [b, 2**64],
            [2**63, 2**63 + (e - b)],
            list(other),
            [rng.choice(WEIRD_VALUES), e],
            [b, rng.choice(WEIRD_VALUES)],
            [b],
            [b, e, e],
            rng.choice(WEIRD_VALUES),
        ]
    )
    return _join(header, body, rng)


def m_dtype(data: bytes, rng: random.Random) -> bytes:
    sp = _split(data)
    if sp is None or not _tensor_names(sp[0]):
        return m_header_bytes(data, rng)
    header, body = sp
    ent = header[rng.choice(_tensor_names(header))]
    if isinstance(ent, dict):
        ent["dtype"] = rng.choice(DTYPE_NAMES) if rng.random() < 0.8 else rng.choice(WEIRD_VALUES)
    return _join(header, body, rng)


def m_shape(data: bytes, rng: random.Random) -> bytes:
    sp = _split(data)
    if sp is None or not _tensor_names(sp[0]):
        return m_header_bytes(data, rng)
    header, body = sp
    ent = header[rng.choice(_tensor_names(header))]
    if not isinstance(ent, dict) or not isinstance(ent.get("shape"), list):
        return _join(header, body, rng)
    shape = list(ent["shape"])
    op = rng.random()
    if op < 0.3 and shape and type(shape[0]) is int:
        i = 0
        shape[i] = rng.choice([shape[i] + 1, shape[i] - 1, 0, 1, shape[i] * 2, -shape[i], 2**62, 2**63, 2**64, 10**30])
    elif (
        op < 0.45 and shape and all(type(x) is int for x in shape)
    ):  # same element count, another shape (passes the byte check, must fail the model's)
        shape = [int(torch.tensor(shape).prod())] if rng.random() < 0.5 else list(reversed(shape))
    elif op < 0.55:
        shape.append(rng.choice([1, 0, 2**62]))
    elif op < 0.65 and shape:
        shape.pop(rng.randrange(len(shape)))
    elif op < 0.75:  # a zero dim: zero bytes, so any other dim passes the byte check
        shape = [0, rng.choice([2**40, 2**62, 2**63 - 1, 2**63, 2**64, 10**30])]
    elif op < 0.85 and shape:
        shape[rng.randrange(len(shape))] = rng.choice(WEIRD_VALUES)
    else:
        shape = rng.choice(WEIRD_VALUES)
    ent["shape"] = shape
    return _join(header, body, rng)


def m_structure(data: bytes, rng: random.Random) -> bytes:
    """JSON-level changes: drop/rename/duplicate tensors, extra fields, odd metadata, deep nesting, huge numbers."""
    sp = _split(data)
    if sp is None:
        return m_header_bytes(data, rng)
    header, body = sp
    names = _tensor_names(header)
    op = rng.randrange(10)
    if op == 0 and names:
        del header[rng.choice(names)]
    elif op == 1 and names:
        k = rng.choice(names)
        header[
            rng.choice(
                [
                    "h.1." + k.split(".", 2)[-1],
                    "model.layers.0.self_attn.q_proj.weight",
                    k + ".x",
                    "",
                    "lm_head.weight",
                    "transformer." + k,
                    "h.99999999999.ln_1.weight",
                    "h.\u00b2.ln_1.weight",
                    "h.0.attn.masked_bias",
                ]
            )
        ] = header.pop(k)
    elif op == 2 and names:
        ent = header[rng.choice(names)]
        if isinstance(ent, dict):
            ent[rng.choice(["extra", "dtype2", "shape "])] = 1
    elif op == 3:
        header["__metadata__"] = rng.choice([{"format": "pt"}, {"format": 1}, [], ["a"], "x", None, {"": ""}, 5])
    elif op == 4:
        hb = json.dumps(header).encode()
        deep = b"[" * rng.choice([100, 10_000, 100_000]) + b"]" * rng.choice([0, 1])
        hb = hb[:-1] + b',"deep":' + deep + b"}"
        return struct.pack("<Q", len(hb)) + hb + body
    elif op == 5:
        hb = json.dumps(header).encode()
        hb = hb[:-1] + b',"big":' + b"9" * rng.choice([100, 5000, 20000]) + b"}"
        return struct.pack("<Q", len(hb)) + hb + body
    elif op == 6 and names:  # a duplicate key in the JSON text
        k = rng.choice(names)
        hb = json.dumps(header).encode()
        hb = hb[:-1] + b"," + json.dumps(k).encode() + b":" + json.dumps(header[k]).encode() + b"}"
        return struct.pack("<Q", len(hb)) + hb + body
    elif op == 7:
        return _join(rng.choice([[], "x", 1, None, [header]]), body, rng)
    elif op == 8 and names:
        ent = header[rng.choice(names)]
        if isinstance(ent, dict):
            ent.pop(rng.choice(["dtype", "shape", "data_offsets"]), None)
    else:
        hb = json.dumps(header).encode()
        return struct.pack("<Q", len(hb)) + hb.replace(b'"', b"'", 1) + body
    return _join(header, body, rng)


def m_truncate(data: bytes, rng: random.Random) -> bytes:
    """Cut the file short (anywhere, often in the data as an interrupted download would) or pad it."""
    op = rng.random()
    if op < 0.7:
        return data[: rng.randrange(len(data))] if data else data
    if op < 0.85:
        return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return data[: len(data) - rng.randint(1, 8)] + b"\0" * rng.randint(0, 8)


def m_data(data: bytes, rng: random.Random) -> bytes:
    """Garbage (NaN, Inf, anything) in a weight's bytes, never in a mask buffer: still a valid file, it must load."""
    sp = _split(data)
    if sp is None:
        return data
    header, _ = sp
    start = len(data) - len(sp[1])
    spans = [
        ent["data_offsets"]
        for k, ent in header.items()
        if k != "__metadata__"
        and isinstance(ent, dict)
        and not k.endswith((".attn.bias", "masked_bias"))
        and isinstance(ent.get("data_offsets"), list)
        and len(ent["data_offsets"]) == 2
        and all(type(o) is int for o in ent["data_offsets"])
        and 0 <= ent["data_offsets"][0] < ent["data_offsets"][1] <= len(sp[1])
    ]
    if not spans:
        return data
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        lo, hi = rng.choice(spans)
        b[start + rng.randrange(lo, hi)] = rng.randrange(256)
    return bytes(b)


MUTATORS = [m_header_bytes, m_length, m_offsets, m_dtype, m_shape, m_structure, m_truncate, m_data]


def make_case(bases: list[bytes], seed: int, case: int) -> tuple[bytes, bool, list[str]]:
    """Case `case` of run `seed`: (file bytes, whether the directory has a config.json, mutations applied)."""
    rng = random.Random(seed * 1_000_003 + case)
    data = rng.choice(bases)
    names = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        m = rng.choice(MUTATORS)
        try:
            data = m(data, rng)
        except Exception:  # a mutator tripped over an already-mangled header: cut the file instead (deterministic)
            data = m_truncate(data, rng)
        names.append(m.__name__)
    return data, rng.random() < 0.8, names


# -- running one case -----------------------------------------------------------------------------------------------
def prepare_dir(d: Path, cfg: GPT2Config = FUZZ_CONFIG) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (d / "noconfig").mkdir(exist_ok=True)


def run_case(d: Path, data: bytes, with_config: bool) -> str:
    """Load one mutated file. Returns "ok" or "error" (a GPT2PortError); anything else propagates."""
    from gpt2_port.io.load import nonfinite_tensors, read_checkpoint

    where = d if with_config else d / "noconfig"
    f = where / "model.safetensors"
    f.write_bytes(data)
    try:
        _, rep = read_checkpoint(where)
        for t in rep.conversion.state.values():  # read every byte that was mapped
            t.sum()
        nonfinite_tensors(rep.conversion.state)
        return "ok"
    except GPT2PortError:
        return "error"
    finally:
        f.unlink()


def maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


class CaseTimeout(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise CaseTimeout()


def check_case(
    d: Path, data: bytes, with_config: bool, budget_s: float = 5.0, slack_bytes: int = 8 << 20
) -> tuple[str, str]:
    """Run a case with a time budget and a peak-memory budget. Returns (outcome, detail); outcome is ok, error,
    exception, hang or memory."""
    old = signal.signal(signal.SIGALRM, _alarm)
    rss0 = maxrss_bytes()
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    try:
        outcome, detail = run_case(d, data, with_config), ""
    except CaseTimeout:
        outcome, detail = "hang", f"ran past {budget_s}s"
    except Exception as e:  # noqa: BLE001 - this is what the fuzzer looks for
        outcome, detail = "exception", f"{e.__class__.__name__}: {str(e)[:300]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    grew = maxrss_bytes() - rss0
    if outcome in ("ok", "error") and grew > 2 * len(data) + slack_bytes:
        outcome, detail = "memory", f"peak RSS grew {grew} bytes for a {len(data)}-byte file"
    return outcome, detail


# -- the long run: cases in a worker process, so a crash is caught and attributed ------------------------------------
def _worker(conn, seed: int, workdir: str) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    bases = base_files()
    d = Path(workdir)
    prepare_dir(d)
    while True:
        case = conn.recv()
        if case is None:
            return
        data, with_config, _ = make_case(bases, seed, case)
        conn.send(check_case(d, data, with_config))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first case index (to resume or replay)")
    ap.add_argument("--out", default="out/fuzz", help="where crashing inputs are saved")
    ap.add_argument("--case-timeout", type=float, default=10.0, help="seconds before a case counts as a hang")
    args = ap.parse_args(argv)

    out = Path(args.out)
    bases = base_files()
    counts: dict[str, int] = {}
    findings = 0
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="gpt2port-fuzz-")

    def start():  # type: ignore[no-untyped-def]
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, args.seed, workdir), daemon=True)
        p.start()
        return p, parent

    proc, conn = start()
    for case in range(args.start, args.start + args.cases):
        conn.send(case)
        if conn.poll(args.case_timeout):
            try:
                outcome, detail = conn.recv()
            except EOFError:
                outcome, detail = "crash", f"worker died (exit code {proc.exitcode})"
        else:
            outcome, detail = (
                ("crash", f"worker died (exit code {proc.exitcode})")
                if not proc.is_alive()
                else ("hang", f"no answer in {args.case_timeout}s")
            )
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome not in ("ok", "error"):
            findings += 1
            data, with_config, muts = make_case(bases, args.seed, case)
            out.mkdir(parents=True, exist_ok=True)
            stem = out / f"seed{args.seed}-case{case}-{outcome}"
            stem.with_suffix(".safetensors").write_bytes(data)
            stem.with_suffix(".json").write_text(
                json.dumps(
                    {
                        "seed": args.seed,
                        "case": case,
                        "outcome": outcome,
                        "detail": detail,
                        "with_config": with_config,
                        "mutations": muts,
                    },
                    indent=2,
                )
                + "\n"
            )
            print(f"case {case}: {outcome}: {detail} -> {stem}.safetensors", flush=True)
            if outcome in ("crash", "hang"):
                proc.kill()
                proc.join()
                proc, conn = start()
        done = case - args.start + 1
        if done % 10_000 == 0:
            print(f"{done} cases, {time.perf_counter() - t0:.0f}s: {counts}", flush=True)
    conn.send(None)
    proc.join(10)
    dt = time.perf_counter() - t0
    print(
        f"seed {args.seed}: {args.cases} cases in {dt:.0f}s ({args.cases / dt:.0f}/s): {counts}; "
        f"{findings} finding(s){' saved under ' + str(out) if findings else ''}"
    )
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
