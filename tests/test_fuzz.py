"""Seeded fuzzing of the checkpoint loader: every mutated file loads or raises GPT2PortError; no crash, hang or
runaway allocation. The generator and the per-case checks live in scripts/fuzz_safetensors.py (which runs many more
cases, in a worker process that also survives segfaults)."""

from __future__ import annotations

import importlib.util
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
N_CASES = 2500


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_safetensors", REPO / "scripts" / "fuzz_safetensors.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_safetensors"] = mod
    spec.loader.exec_module(mod)
    return mod


fz = _fuzz_module()


def test_base_files_load(tmp_path: Path) -> None:
    """The unmutated bases are valid: the fuzzer starts from files that load."""
    fz.prepare_dir(tmp_path)
    for data in fz.base_files():
        assert fz.run_case(tmp_path, data, with_config=True) == "ok"


def test_each_mutator_breaks_files(tmp_path: Path) -> None:
    """Every mutator (but garbage-in-the-data, which keeps the file valid) makes some files fail to load, so the
    loader's validation is what the fuzz test exercises, not a mutator that does nothing."""
    fz.prepare_dir(tmp_path)
    bases = fz.base_files()
    import random

    for m in fz.MUTATORS:
        rng = random.Random(0)
        outcomes = Counter(fz.run_case(tmp_path, m(bases[i % 2], rng), True) for i in range(40))
        if m is fz.m_data:
            assert outcomes == {"ok": 40}, outcomes
        else:
            assert outcomes["error"] > 0, (m.__name__, outcomes)


@pytest.fixture
def address_space_cap():
    """Cap the address space at (current + 2 GiB) while fuzzing: an allocation sized by a hostile header then fails
    with an exception (a finding) instead of taking the machine down. Restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    vm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                vm = int(line.split()[1]) * 1024
    cap = vm + (2 << 30)
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_fuzz_loader(tmp_path: Path, address_space_cap: None) -> None:
    """2,500 seeded mutations (header bytes, length, offsets, dtypes, shapes, structure, truncation, data): each loads
    or raises GPT2PortError, within 5 s and with peak RSS growing by at most 2x the file size + 8 MiB."""
    fz.prepare_dir(tmp_path)
    bases = fz.base_files()
    counts: Counter[str] = Counter()
    findings = []
    t0 = time.perf_counter()
    for case in range(N_CASES):
        data, with_config, muts = fz.make_case(bases, 2024, case)
        outcome, detail = fz.check_case(tmp_path, data, with_config, budget_s=5.0)
        counts[outcome] += 1
        if outcome not in ("ok", "error"):
            saved = tmp_path / f"case{case}.safetensors"
            saved.write_bytes(data)
            findings.append(f"case {case} {muts}: {outcome}: {detail} (input saved to {saved})")
    dt = time.perf_counter() - t0
    assert not findings, "\n".join(findings[:20])
    assert sum(counts.values()) == N_CASES
    # The mix is meaningful: most cases are rejected, some still load (data-only or harmless mutations).
    assert counts["error"] > N_CASES // 2 and counts["ok"] > 10, counts
    assert dt < 60, f"{N_CASES} cases took {dt:.1f}s"


REGRESSIONS = sorted((REPO / "tests" / "data" / "fuzz_regressions").glob("*.safetensors"))


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_fuzz_regressions(path: Path, tmp_path: Path) -> None:
    """Inputs the fuzzer found escaping as ValueError/TypeError/IndexError (or, for seed2-case826, running away) on
    the spine's loader; each is now a clean GPT2PortError. The .json beside each file says what it found."""
    import json

    meta = json.loads(path.with_suffix(".json").read_text())
    fz.prepare_dir(tmp_path)
    assert fz.check_case(tmp_path, path.read_bytes(), meta["with_config"], budget_s=5.0) == ("error", "")


def test_fuzz_regressions_present() -> None:
    assert len(REGRESSIONS) >= 5
