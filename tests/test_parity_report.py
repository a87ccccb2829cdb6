"""Parity reports you can trust: inputs that need no tokenizer, loud non-finite values, one renderer for every
table, --only-failures, outputs to stdout and the paths written, and plot marks that are the tolerances used."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from gpt2_port.cli import main
from gpt2_port.config import GPT2Config
from gpt2_port.io.demo import write_demo_checkpoint
from gpt2_port.io.safetensors_io import SafetensorsFile, write_safetensors
from gpt2_port.io.tokenizer import load_tokenizer
from gpt2_port_checks import render
from gpt2_port_checks.plots import tolerance_marks
from gpt2_port_checks.points import point_names
from gpt2_port_checks.prompts import DEFAULT_PROMPT_IDS, DEFAULT_PROMPTS
from gpt2_port_checks.results import PointResult, Report, Sweep
from gpt2_port_checks.tolerances import VS_FLOAT32_TOLERANCES

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

TINY = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128)
BOX = re.compile("[\u2500-\u257f]")  # box-drawing characters


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint in the official layout with no tokenizer files beside it."""
    d = write_demo_checkpoint(tmp_path_factory.mktemp("no_tok"), config=TINY, seed=4)
    assert not any((d / n).exists() for n in ("vocab.json", "merges.txt", "encoder.json", "vocab.bpe"))
    return d


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network: any attempt to fetch tiktoken's encoding fails the test."""
    import tiktoken

    def refuse(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the network was used")

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_default_prompt_ids_are_the_gpt2_bpe_of_the_default_prompts(tokenizer_dir: Path):
    tok = load_tokenizer(tokenizer_dir)
    assert [tok.encode(p) for p in DEFAULT_PROMPTS] == DEFAULT_PROMPT_IDS


def test_default_run_needs_no_tokenizer_and_no_network(no_tokenizer: Path, offline: None, tmp_path: Path, capsys):
    out = tmp_path / "r.json"
    rc = main(["parity", str(no_tokenizer), "--logit-lens", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    r = json.loads(out.read_text())
    assert r["token_ids"] == DEFAULT_PROMPT_IDS and r["prompts"] == DEFAULT_PROMPTS and r["n_tokens"] == 15
    assert r["logit_lens"][0]["scratch_top1"] is None and "#" in text  # no tokenizer: tokens shown by id


def test_ids_option_and_ids_file(no_tokenizer: Path, offline: None, tmp_path: Path, capsys):
    f = tmp_path / "ids.txt"
    f.write_text("464, 3797 26172\n\n10211\n")
    out = tmp_path / "r.json"
    rc = main(["parity", str(no_tokenizer), "--ids", "464 2444 4721", "--ids-file", str(f), "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    r = json.loads(out.read_text())
    assert r["token_ids"] == [[464, 2444, 4721], [464, 3797, 26172], [10211]]
    assert r["prompts"] == [None, None, None] and r["n_tokens"] == 7


def test_ids_mix_with_text_prompts(tiny_official: Path, tmp_path: Path, capsys):
    out = tmp_path / "r.json"
    assert main(["parity", str(tiny_official), "--prompt", "The cat", "--ids", "464 3797", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["prompts"] == ["The cat", None] and r["token_ids"] == [[464, 3797], [464, 3797]]


def _nan_checkpoint(base: Path, tmp: Path) -> Path:
    d = write_demo_checkpoint(tmp / "nan", config=TINY, seed=5)
    st = SafetensorsFile(d / "model.safetensors")
    tensors = {k: st.get(k).clone() for k in st.keys()}
    del st
    tensors["h.1.mlp.c_proj.weight"][0, 0] = float("nan")
    write_safetensors(
        d / "model.safetensors",
        [(k, tuple(t.shape), t.dtype, lambda t=t: t) for k, t in sorted(tensors.items())],
        metadata={"format": "pt"},
    )
    return d


def test_nan_weights_fail_the_top1_and_logprob_checks(no_tokenizer: Path, tmp_path: Path, capsys):
    """All-NaN logits agree on nothing: top-1 0% FAIL (not the argmax-of-NaN 100%), log-prob NaN FAIL."""
    d = _nan_checkpoint(no_tokenizer, tmp_path)
    out = tmp_path / "r.json"
    rc = main(["parity", str(d), "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    r = json.loads(out.read_text())
    assert r["top1_agreement"] == 0.0 and r["nonfinite_logit_positions"] == 15
    assert r["logprob_max_abs"] != r["logprob_max_abs"]  # NaN
    assert re.search(r"top-1 next-token agreement 0\.0% \(min 100%\)  FAIL; 15 of 15 positions", text), text
    assert re.search(r"log-prob max abs diff nan \(tol 1e-04\)  FAIL", text), text


def test_next_token_counts_a_nonfinite_row_as_disagreement():
    from gpt2_port_checks.metrics import next_token

    y = torch.randn(4, 10)
    x = y.clone()
    x[1, int(y[1].argmax())] = float("inf")  # the same argmax, but not a finite row
    nt = next_token(x, y, 10)
    assert nt.top1_agreement == 0.75 and nt.n_nonfinite == 1 and nt.logprob_max_abs != nt.logprob_max_abs
    nt = next_token(y, y, 10)
    assert nt.top1_agreement == 1.0 and nt.logprob_max_abs == 0.0 and nt.n_nonfinite == 0


def _table_lines(text: str) -> list[str]:
    return [ln.split() for ln in text.splitlines() if ln.startswith("  point ")]


def test_one_renderer_plain_when_piped(tiny_official: Path, capsys):
    """The default table and the detailed one share one layout (the noise floor's columns in both, by default);
    piped, no box characters and no wrapping."""
    assert main(["parity", str(tiny_official), "--device", "cpu"]) == 0
    block = capsys.readouterr().out
    assert main(["parity", str(tiny_official), "--device", "cpu", "--detail", "sublayer"]) == 0
    sub = capsys.readouterr().out
    assert _table_lines(block) == _table_lines(sub) and len(_table_lines(block)) == 1
    assert _table_lines(block)[0][5:8] == ["noise", "floor", "vs"]
    for text in (block, sub):
        assert not BOX.search(text) and "\x1b" not in text
        title = next(ln for ln in text.splitlines() if ln.startswith("float32/cpu: scratch"))
        assert title.endswith("float32, cpu")  # the whole title on one line, however long
    rows = [ln for ln in sub.splitlines() if ln.startswith("  block.1.mlp.act ")]
    assert len(rows) == 1 and rows[0].split()[-1] == "OK"


def _sweep(fail: set[str], dtypes=("float32", "bfloat16")) -> Sweep:
    reports = []
    for dt in dtypes:
        tol = VS_FLOAT32_TOLERANCES[dt]
        r = Report("m", dt, "cpu", "transformers (eager)", "manual", ["x"], 3, token_ids=[[1, 2, 3]])
        for n in point_names(2):
            bad = dt == "bfloat16" and n in fail
            r.points.append(PointResult(n, 0.0, 1.0 if bad else 0.0, 1.0, 0.0, tol.for_point(n), not bad))
        r.top1_agreement, r.top1_tolerance, r.logprob_tolerance = 1.0, tol.top1, tol.logprob_max_abs
        r.reference_dtype, r.reference_device = "float32", "cpu"
        reports.append(r)
    return Sweep("m", reports, "transformers (eager), float32, cpu", is_sweep=len(reports) > 1)


def test_rich_on_a_terminal_shows_the_same_rows():
    s = _sweep({"block.1"})
    rich = render.render_text(s, terminal_width=100)
    plain = render.render_text(s)
    assert "\x1b[" in rich and "\x1b" not in plain
    for text in (rich, plain):
        assert "block.1" in text and "FAIL: first failure in bfloat16/cpu at block.1" in text


def test_only_failures_keeps_the_failing_rows():
    s = _sweep({"block.1", "logits"})
    text = render.render_plain(s, only_failures=True)
    rows = [ln.split()[0] for ln in text.splitlines() if re.match(r"  (embed|block\.\d|ln_f|logits) ", ln)]
    assert rows == ["block.1", "logits"]
    assert "(5 passing row(s) hidden by --only-failures)" in text  # float32/cpu: all 5 hidden
    assert "(3 passing row(s) hidden by --only-failures)" in text  # bfloat16/cpu: 3 of 5 hidden
    full = render.render_plain(s)
    assert len([ln for ln in full.splitlines() if re.match(r"  (embed|block\.\d|ln_f|logits) ", ln)]) == 10
    md = render.render_markdown(s, only_failures=True)
    assert "| **block.1** |" in md and "| embed |" not in md


def test_only_failures_from_the_cli_with_per_head(tiny_official: Path, capsys):
    assert main(["parity", str(tiny_official), "--per-head", "--only-failures"]) == 0
    text = capsys.readouterr().out
    assert "passing row(s) hidden by --only-failures" in text
    assert not [ln for ln in text.splitlines() if ln.rstrip().endswith("  OK") and ln.startswith("  block")]


def test_sweep_json_holds_each_configuration_once():
    d = _sweep({"block.1"}).to_json()
    keys = {"model", "passed", "first_failure", "first_failure_config", "as_close_as_reference", "baseline"}
    assert set(d) == keys | {"configurations"}
    each = [c.get("as_close_as_reference") for c in d["configurations"]]  # the sweep's verdict is theirs together
    assert d["as_close_as_reference"] == (None if None in each else all(each))
    assert [c["config"] for c in d["configurations"]] == ["float32/cpu", "bfloat16/cpu"]
    assert d["first_failure_config"] == "bfloat16/cpu" and d["first_failure"] == "block.1" and d["passed"] is False
    single = Sweep("m", _sweep(set()).reports[:1], "b", is_sweep=False).to_json()
    assert "configurations" not in single and single["dtype"] == "float32" and len(single["points"]) == 5


def test_plot_tolerance_marks_are_the_tolerances_used():
    """Per point, per configuration: bfloat16's embed gate (5e-3) is drawn at embed, its block gate elsewhere."""
    s = _sweep(set(), dtypes=("float32", "bfloat16", "float16"))
    names = point_names(2)
    marks = dict((tuple(labels), tols) for labels, tols in tolerance_marks(s, names))
    for r in s.reports:
        assert marks[("/".join([r.dtype, "cpu"]),)] == [p.tolerance for p in r.points]
    bf = marks[("bfloat16/cpu",)]
    assert bf[0] == VS_FLOAT32_TOLERANCES["bfloat16"].embed != bf[1] == VS_FLOAT32_TOLERANCES["bfloat16"].block


def test_json_and_markdown_to_stdout(tiny_official: Path, capsys):
    assert main(["parity", str(tiny_official), "--json", "-"]) == 0
    out, err = capsys.readouterr()
    r = json.loads(out)  # stdout holds the JSON alone; the table went to stderr
    assert r["passed"] is True and "PASS" in err and not Path("-").exists()
    assert main(["parity", str(tiny_official), "--markdown", "-"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# Parity report") and "point  " in err


def test_paths_written_are_printed_at_the_end(tiny_official: Path, tmp_path: Path, capsys):
    j, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    assert main(["parity", str(tiny_official), "--json", str(j), "--markdown", str(md), "--plot", str(png)]) == 0
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    assert lines[-3:] == [f"wrote {j} (json)", f"wrote {md} (markdown)", f"wrote {png} (plot)"]
    assert j.is_file() and md.is_file() and png.read_bytes()[:4] == b"\x89PNG"


def test_the_report_names_the_gpu_cuda_and_cudnn_of_a_cuda_run(monkeypatch) -> None:
    """A float32 forward is bit-exact on one GPU with one cuBLAS: a CUDA report names the GPU, CUDA and cuDNN it ran
    on (stood in here: CUDA calls answered without a GPU); a CPU report names neither."""
    from gpt2_port_checks.reference import versions

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    on_gpu = versions([torch.device("cpu"), torch.device("cuda", 0)])
    assert on_gpu["gpu"] == "NVIDIA H100 80GB HBM3" and on_gpu["cuda"] == "12.8" and on_gpu["cudnn"] == "91002"
    assert on_gpu["torch"] == torch.__version__ and "transformers" in on_gpu
    assert not {"gpu", "cuda", "cudnn"} & set(versions([torch.device("cpu")]))
