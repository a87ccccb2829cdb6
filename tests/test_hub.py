"""The loader's Hub path, against a local fake of the Hub (tests/fakehub.py) and against a cache filled by hand.

Hub ids go through huggingface_hub's `snapshot_download` into the standard HF cache (shared with transformers), only
the files the port needs are fetched, a cached snapshot works offline, and every failure is one line with exit 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fakehub import FakeHub, read_dir

from gpt2_port.cli import main
from gpt2_port.config import GPT2Config
from gpt2_port.io.demo import write_demo_checkpoint
from gpt2_port.io.safetensors_io import SafetensorsFile

REPO = Path(__file__).resolve().parents[1]
HUB_CFG = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=1000)
NEEDED = {"config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt"}
# What the real openai-community/gpt2 repo also holds (several GB there; a few bytes here).
DECOYS = {
    "tf_model.h5": b"\x89HDF\r\n\x1a\n" + b"t" * 4096,
    "flax_model.msgpack": b"f" * 4096,
    "rust_model.ot": b"r" * 4096,
    "onnx/decoder_model.onnx": b"o" * 4096,
    "onnx/decoder_with_past_model.onnx": b"p" * 4096,
    "64-8bits.tflite": b"l" * 4096,
    "64.tflite": b"m" * 4096,
    "pytorch_model.bin": b"PK" + b"b" * 4096,
    "README.md": b"# gpt2\n",
    ".gitattributes": b"*.bin filter=lfs\n",
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
}
GENERATION_CONFIG = json.dumps({"bos_token_id": 50256, "eos_token_id": 50256}).encode()


def _ckpt_files(tmp: Path, tokenizer_dir: Path, seed: int) -> dict[str, bytes]:
    d = write_demo_checkpoint(tmp / f"ck{seed}", config=HUB_CFG, seed=seed, tokenizer_dir=tokenizer_dir)
    return read_dir(d)


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, dict[str, bytes]]:
    """main (seed 0) and v1 (seed 1) of an official-layout tiny GPT-2, plus the decoy files of the real repo."""
    tmp = tmp_path_factory.mktemp("hubrepo")
    out = {}
    for rev, seed in (("main", 0), ("v1", 1)):
        files = _ckpt_files(tmp, tokenizer_dir, seed)
        files["generation_config.json"] = GENERATION_CONFIG
        files.update(DECOYS)
        out[rev] = files
    return out


@pytest.fixture
def hub(repo_files: dict[str, dict[str, bytes]]):
    h = FakeHub()
    h.shas = {
        "v1": h.add_repo("openai-community/gpt2", repo_files["v1"], refs=("v1",)),
        "main": h.add_repo("openai-community/gpt2", repo_files["main"], refs=("main",)),
    }
    with h:
        yield h


class _CurrentStderr:
    """A stream that writes wherever sys.stderr points now."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def _hub_logs_to_current_stderr() -> None:
    """huggingface_hub (and transformers) give their loggers a StreamHandler bound to the sys.stderr of the moment
    they are imported; in a test process that is some earlier test's capture stream, closed since. Make them follow
    sys.stderr, as they do in a real process."""
    import logging

    for name in ("huggingface_hub", "transformers"):
        for h in logging.getLogger(name).handlers:
            if type(h) is logging.StreamHandler:
                h.stream = _CurrentStderr()  # not setStream(): that flushes the old, closed stream


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _error_line(err: str) -> str:
    """The CLI's error line: the last line of stderr (the hub may have logged retries or drawn bars before it)."""
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    assert lines, "nothing on stderr"
    assert "Traceback" not in err
    return lines[-1]


def _snapshot(cache: Path, repo: str = "openai-community/gpt2") -> Path:
    return cache / ("models--" + repo.replace("/", "--")) / "snapshots"


def _run_cli(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    full.update(env)
    full["PYTHONPATH"] = str(REPO) + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "gpt2_port", *args], env=full, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def test_alias_downloads_only_needed_files_then_works_offline(hub: FakeHub, tmp_path: Path) -> None:
    """`gpt2` -> openai-community/gpt2 via HF_ENDPOINT/HF_HOME (a real subprocess): only the five needed files are
    fetched (no TF/Flax/ONNX/rust/tflite/.bin), progress bars show, the files land in the standard cache layout;
    then with the server gone and HF_HUB_OFFLINE=1 the same command works from the cache."""
    home = tmp_path / "hfhome"
    report = tmp_path / "r.json"
    r = _run_cli(["inspect", "gpt2", "--json", str(report)], hub.env(home))
    assert r.returncode == 0, r.stderr
    assert hub.downloads("openai-community/gpt2") == NEEDED
    touched = {p for _, p in hub.requests}
    for decoy in DECOYS:
        assert not any(decoy in p for p in touched), f"{decoy} was requested"
    assert "Fetching" in r.stderr or "Download" in r.stderr, "huggingface_hub's progress bars should show"

    sha = hub.shas["main"]
    repo_dir = home / "hub" / "models--openai-community--gpt2"
    snap = repo_dir / "snapshots" / sha
    assert (repo_dir / "refs" / "main").read_text() == sha
    assert json.loads(report.read_text())["root"] == str(snap)
    assert {p.name for p in snap.iterdir()} == NEEDED
    st = snap / "model.safetensors"
    assert st.is_symlink()  # -> ../../blobs/<sha256>, as transformers expects and shares
    blob = st.resolve()
    assert blob.parent == (repo_dir / "blobs").resolve()
    data = hub.repos["openai-community/gpt2"].commits[sha]["model.safetensors"]
    assert blob.name == hashlib.sha256(data).hexdigest() and blob.read_bytes() == data

    hub.stop()
    report.unlink()
    r = _run_cli(
        ["inspect", "gpt2", "--json", str(report)], hub.env(home, offline=True) | {"HF_ENDPOINT": "http://127.0.0.1:9"}
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(report.read_text())["root"] == str(snap)


def test_revision_pinning(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, repo_files: dict[str, dict[str, bytes]]
) -> None:
    from gpt2_port.io.load import read_checkpoint

    cache = tmp_path / "cache"
    hub.patch(monkeypatch, cache)
    for rev in ("v1", hub.shas["v1"], None):
        sd, rep = read_checkpoint("openai-community/gpt2", revision=rev)
        want = "v1" if rev else "main"
        assert rep.checkpoint.root == _snapshot(cache) / hub.shas[want]
        (tmp_path / "ref.safetensors").write_bytes(repo_files[want]["model.safetensors"])
        ref = SafetensorsFile(tmp_path / "ref.safetensors")
        assert torch.equal(sd["wte.weight"], ref.get("wte.weight"))
    assert (cache / "models--openai-community--gpt2" / "refs" / "v1").read_text() == hub.shas["v1"]


def test_unknown_revision_and_unknown_id(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.patch(monkeypatch, tmp_path / "cache")
    rc, _, err = _cli(capsys, "inspect", "gpt2", "--revision", "no-such-branch")
    line = _error_line(err)
    assert rc == 2 and "no-such-branch" in line and "not found" in line
    rc, _, err = _cli(capsys, "inspect", "nobody/not-a-model")
    line = _error_line(err)
    assert rc == 2 and "nobody/not-a-model" in line and "no such model" in line
    assert not any((tmp_path / "cache").rglob("*.safetensors"))


def test_offline_with_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    FakeHub().patch(monkeypatch, tmp_path / "cache", offline=True)
    rc, out, err = _cli(capsys, "inspect", "gpt2")
    line = _error_line(err)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1, err
    assert "openai-community/gpt2" in line and "HF_HUB_OFFLINE" in line and "unset HF_HUB_OFFLINE" in line


def test_unreachable_hub_with_no_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    FakeHub().patch(monkeypatch, tmp_path / "cache", offline=False)  # not started: endpoint is a closed port
    rc, _, err = _cli(capsys, "inspect", "gpt2-medium")
    line = _error_line(err)
    assert rc == 2
    assert "openai-community/gpt2-medium" in line and "cannot reach" in line and "local checkpoint" in line
    assert "local directory" not in line  # gpt2-medium: no folder it could have meant


def test_an_owner_name_that_is_no_folder_here_says_so_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`runs/shakespeare` before `runs/` exists (a run not written yet) is asked of the Hub as owner/name; its error
    also says no such local directory exists, since that is the likelier meaning."""
    FakeHub().patch(monkeypatch, tmp_path / "cache", offline=False)
    monkeypatch.chdir(tmp_path)
    rc, _, err = _cli(capsys, "inspect", "runs/shakespeare")
    line = _error_line(err)
    assert rc == 2 and err.count("\n") == 1, err
    assert "runs/shakespeare" in line and "cannot reach" in line
    assert line.endswith("(nor is there a local directory runs/shakespeare here)"), line


def _cache_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file() or p.is_symlink()]


def test_interrupted_download_leaves_no_valid_looking_file(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The connection drops half-way through model.safetensors and the resume fails: exit 2, one line; the cache keeps
    no partial file under a real name (so a later offline run fails instead of loading it); a retry then succeeds."""
    cache = tmp_path / "cache"
    hub.patch(monkeypatch, cache)
    hub.faults[("openai-community/gpt2", "model.safetensors")] = "drop"
    rc, _, err = _cli(capsys, "inspect", "gpt2")
    line = _error_line(err)
    assert rc == 2 and "openai-community/gpt2" in line and "download failed" in line
    sha = hub.shas["main"]
    full = hub.repos["openai-community/gpt2"].commits[sha]["model.safetensors"]
    assert not (_snapshot(cache) / sha / "model.safetensors").exists()
    for p in _cache_files(cache):
        assert not p.name.endswith(".incomplete"), p
        if p.is_file() and "blobs" in p.parts:
            assert len(p.read_bytes()) != len(full) // 2, f"{p} holds the partial body"

    hub.patch(monkeypatch, cache, offline=True)
    rc, _, err = _cli(capsys, "inspect", "gpt2")
    assert rc == 2 and "HF_HUB_OFFLINE" in _error_line(err)

    hub.faults.clear()
    hub.patch(monkeypatch, cache)
    rc, out, err = _cli(capsys, "inspect", "gpt2")
    assert rc == 0, err
    assert (_snapshot(cache) / sha / "model.safetensors").read_bytes() == full


def test_dropped_connection_resumes_to_identical_bytes(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpt2_port.io.load import read_checkpoint

    cache = tmp_path / "cache"
    hub.patch(monkeypatch, cache)
    hub.faults[("openai-community/gpt2", "model.safetensors")] = "drop_once"
    _, rep = read_checkpoint("gpt2")
    sha = hub.shas["main"]
    full = hub.repos["openai-community/gpt2"].commits[sha]["model.safetensors"]
    assert rep.checkpoint.weight_files[0].read_bytes() == full
    gets = [p for m, p in hub.requests if m == "GET" and p.endswith("/model.safetensors")]
    assert len(gets) == 2  # the cut-off GET and the Range resume


def test_killed_download_leaves_no_valid_looking_file(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL mid-download (no cleanup code runs at all): nothing under a real name in the cache."""
    home = tmp_path / "hfhome"
    hub.faults[("openai-community/gpt2", "model.safetensors")] = "stall"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    full.update(hub.env(home))
    full["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpt2_port", "inspect", "gpt2"],
        env=full,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        assert hub.stalled.wait(90), "the download never started"
        time.sleep(0.3)  # let the client write what it received
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    sha = hub.shas["main"]
    cache = home / "hub"
    assert not (_snapshot(cache) / sha / "model.safetensors").exists()
    blobs = [p for p in (cache / "models--openai-community--gpt2" / "blobs").iterdir()]
    partial = [p for p in blobs if p.name.endswith(".incomplete")]
    assert partial, "expected the partial download under a temporary .incomplete name"
    data = hub.repos["openai-community/gpt2"].commits[sha]["model.safetensors"]
    assert not (cache / "models--openai-community--gpt2" / "blobs" / hashlib.sha256(data).hexdigest()).exists()

    hub.release.set()
    hub.faults.clear()
    hub.patch(monkeypatch, cache, offline=True)
    rc, _, err = _cli(capsys, "inspect", "gpt2")
    assert rc == 2 and "HF_HUB_OFFLINE" in _error_line(err)
    hub.patch(monkeypatch, cache)
    rc, _, err = _cli(capsys, "inspect", "gpt2")
    assert rc == 0, err
    assert (_snapshot(cache) / sha / "model.safetensors").read_bytes() == data


@pytest.fixture
def finetune_files(tmp_path: Path, tokenizer_dir: Path) -> dict[str, bytes]:
    """A fine-tune that ships only pytorch_model.bin (save_pretrained keys: 'transformer.' prefix, no buffers)."""
    d = write_demo_checkpoint(tmp_path / "ft", config=HUB_CFG, seed=5, tokenizer_dir=tokenizer_dir)
    st = SafetensorsFile(d / "model.safetensors")
    sd = {"transformer." + k: st.get(k).clone() for k in st.keys() if not k.endswith(".attn.bias")}
    torch.save(sd, d / "pytorch_model.bin")
    files = read_dir(d)
    del files["model.safetensors"]
    files["tf_model.h5"] = DECOYS["tf_model.h5"]
    return files


def test_finetune_with_only_pytorch_model_bin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finetune_files: dict[str, bytes]
) -> None:
    """The loader falls back to pytorch_model.bin and reads it with torch.load(weights_only=True)."""
    from gpt2_port.model import from_pretrained

    calls = []
    real_load = torch.load

    def spy(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append(kw.get("weights_only"))
        return real_load(*a, **kw)

    monkeypatch.setattr(torch, "load", spy)
    with FakeHub() as hub:
        hub.add_repo("someone/gpt2-finetuned", finetune_files)
        hub.patch(monkeypatch, tmp_path / "cache")
        model, rep = from_pretrained("someone/gpt2-finetuned")
        assert hub.downloads() == {"config.json", "vocab.json", "merges.txt", "pytorch_model.bin"}
    assert calls and all(c is True for c in calls)
    assert rep.checkpoint.fmt == "bin"
    (tmp_path / "x.bin").write_bytes(finetune_files["pytorch_model.bin"])
    ref = real_load(tmp_path / "x.bin", weights_only=True)
    assert torch.equal(model.wte.weight, ref["transformer.wte.weight"])


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_hub_pickle_that_runs_code_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    finetune_files: dict[str, bytes],
) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.bin"
    torch.save({"transformer.wte.weight": _RunsCode(marker)}, evil)
    files = dict(finetune_files, **{"pytorch_model.bin": evil.read_bytes()})
    with FakeHub() as hub:
        hub.add_repo("mallory/gpt2-evil", files)
        hub.patch(monkeypatch, tmp_path / "cache")
        rc, _, err = _cli(capsys, "inspect", "mallory/gpt2-evil")
    line = _error_line(err)
    assert rc == 2 and "pytorch_model.bin" in line and "refused to unpickle" in line
    assert not marker.exists()


def test_prefilled_cache_offline_and_shared_with_transformers(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    repo_files: dict[str, dict[str, bytes]],
) -> None:
    """A cache laid out by hand as huggingface_hub lays it out (blobs/, snapshots/<sha>/ symlinks, refs/main) serves
    `gpt2` with HF_HUB_OFFLINE=1 and no server; transformers loads the very same files from it."""
    cache = tmp_path / "cache"
    repo_dir = cache / "models--openai-community--gpt2"
    sha = "0123456789abcdef0123456789abcdef01234567"
    snap = repo_dir / "snapshots" / sha
    snap.mkdir(parents=True)
    (repo_dir / "blobs").mkdir()
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(sha)
    for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt"):
        data = repo_files["main"][name]
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    FakeHub().patch(monkeypatch, cache, offline=True)
    report = tmp_path / "r.json"
    rc, out, err = _cli(capsys, "inspect", "gpt2", "--json", str(report))
    assert rc == 0, err
    assert json.loads(report.read_text())["root"] == str(snap)

    from transformers import GPT2LMHeadModel

    from gpt2_port.model import from_pretrained

    ref = GPT2LMHeadModel.from_pretrained("openai-community/gpt2", cache_dir=str(cache), local_files_only=True)
    ours, _ = from_pretrained("gpt2")
    assert torch.equal(ref.transformer.wte.weight, ours.wte.weight)
    assert torch.equal(ref.transformer.h[1].mlp.c_fc.weight.t(), ours.h[1].mlp.c_fc.weight)


# -- names that are not what the user meant: a path typo is a missing path, a close name gets a "did you mean" ------


def test_path_typo_is_a_missing_path_not_a_hub_failure(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`weights/gpt2-randon` looks like a Hub id (owner/name), but `weights` exists here: it is a path, reported as
    missing with the directory beside it suggested, and the Hub is never asked."""
    hub.patch(monkeypatch, tmp_path / "cache")
    (tmp_path / "weights" / "gpt2-random").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for name in ("weights/gpt2-randon", "./weights/gpt2-randon", "weights/gpt2-randon/model.safetensors"):
        rc, _, err = _cli(capsys, "inspect", name)
        line = _error_line(err)
        assert rc == 2 and f"{name}: no such file or directory" in line and "looks like a path" in line, line
        assert "cannot reach" not in line and "Hugging Face" not in line
    rc, _, err = _cli(capsys, "inspect", "weights/gpt2-randon")
    assert _error_line(err).endswith("did you mean weights/gpt2-random?")
    assert hub.requests == []


def test_did_you_mean_official_ids(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.patch(monkeypatch, tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    rc, _, err = _cli(capsys, "inspect", "gpt2-smal")
    line = _error_line(err)
    assert rc == 2 and "gpt2-smal: no such file or directory, and not a Hub model id" in line
    assert line.endswith("; did you mean gpt2?"), line  # "gpt2-small" is what papers call the 124M `gpt2`
    assert hub.requests == []  # not an id the Hub could hold: never asked
    rc, _, err = _cli(capsys, "inspect", "openai-community/gpt2-mediun")
    line = _error_line(err)
    assert rc == 2 and "no such model on the Hugging Face Hub" in line
    assert "did you mean openai-community/gpt2-medium?" in line, line


def test_offline_and_unreachable_errors_name_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    FakeHub().patch(monkeypatch, cache, offline=True)
    rc, _, err = _cli(capsys, "inspect", "gpt2")
    assert rc == 2 and f"not in the local Hugging Face cache ({cache})" in _error_line(err)
    FakeHub().patch(monkeypatch, cache, offline=False)  # not started: a closed port
    rc, _, err = _cli(capsys, "inspect", "gpt2")
    assert rc == 2 and f"not cached locally in {cache}" in _error_line(err)
