"""The parity checker at block level: full-size 124M in the official layout, both layouts, and real failures."""

import json
from pathlib import Path

import pytest
import torch

from gpt2_port.cli import main
from gpt2_port_checks.forward import run_parity
from gpt2_port_checks.metrics import metrics
from gpt2_port_checks.prompts import DEFAULT_PROMPTS
from gpt2_port_checks.tolerances import TOLERANCES

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration


def test_124m_official_layout_float32(ckpt124: Path, tmp_path: Path, capsys):
    """The target: norm-relative error <= 1e-6 at every point, top-1 agreement 100%, exit 0, JSON schema."""
    out = tmp_path / "parity.json"
    rc = main(["parity", str(ckpt124), "--device", "cpu", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    r = json.loads(out.read_text())
    names = ["embed", *(f"block.{i}" for i in range(12)), "ln_f", "logits"]
    names += [f"batch.{n}" for n in names]  # the prompts again as one left-padded batch, with a long row
    names += ["decode.logits", "decode.forward_steps.logits"]  # and generate's cached paths, tokens fed
    assert [p["name"] for p in r["points"]] == names
    for p in r["points"]:
        assert set(p) >= {"name", "max_abs", "norm_rel", "cosine", "elementwise_rel"}
        assert p["norm_rel"] <= 1e-6 and p["cosine"] > 1 - 1e-9, p
    assert r["passed"] is True and r["first_failure"] is None
    assert r["top1_agreement"] == 1.0
    assert r["model"] == str(ckpt124) and r["dtype"] == "float32" and r["device"] == "cpu"
    assert "block.11" in text and "PASS" in text and text.count(" OK") >= len(names)
    # the reference's own noise beside every figure, by default: transformers' sdpa against its eager reference
    assert r["noise_floor"].startswith("transformers sdpa float32 cpu against the reference (eager float32 cpu)")
    floor = [p["noise_norm_rel"] for p in r["points"]]
    assert floor[0] == 0 and max(floor) > 0 and all(p["within_noise"] for p in r["points"])  # embed: no attention
    assert r["as_close_as_reference"] is True and "as transformers' own sdpa kernel is: YES" in text
    assert "noise floor" in text  # the words the run without a floor leaves out (below)


def test_no_noise_floor_leaves_the_floor_out(tiny_official: Path, tmp_path: Path, capsys):
    out = tmp_path / "parity.json"
    assert main(["parity", str(tiny_official), "--device", "cpu", "--json", str(out), "--no-noise-floor"]) == 0
    r = json.loads(out.read_text())
    assert r["noise_floor"] is None and "as_close_as_reference" not in r and r["passed"]
    assert all(p["noise_norm_rel"] is None for p in r["points"]) and "noise floor" not in capsys.readouterr().out


def test_scratch_sdpa_against_eager_within_float32_tolerance(tiny_hf: Path):
    r = run_parity(str(tiny_hf), DEFAULT_PROMPTS, attn="sdpa")
    assert r.passed, [(p.name, p.norm_rel) for p in r.points]
    assert r.scratch_attn == "sdpa" and "eager" in r.reference
    assert max(p.norm_rel for p in r.points) < 1e-6


def test_reference_sdpa(tiny_official: Path):
    r = run_parity(str(tiny_official), ["Hello world"], reference_attn="sdpa")
    assert r.passed and r.scratch_attn == "sdpa" and "(sdpa)" in r.reference


def test_erf_gelu_is_caught_at_block_0(tiny_official: Path, monkeypatch, tmp_path: Path, capsys):
    """The classic porting bug (erf GELU instead of tanh) fails at the first block, with exit code 1."""
    import gpt2_port.model.modules as model_mod

    monkeypatch.setattr(model_mod, "gelu_new", lambda x: torch.nn.functional.gelu(x))
    out = tmp_path / "r.json"
    rc = main(["parity", str(tiny_official), "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    r = json.loads(out.read_text())
    assert r["passed"] is False and r["first_failure"] == "block.0"
    assert r["points"][0]["norm_rel"] == 0.0  # the embeddings still agree
    assert "FAIL: first failure at block.0" in text


def test_wrong_layernorm_eps_is_caught(tiny_official: Path, tmp_path: Path):
    """LayerNorm eps 1e-12 instead of 1e-5 is a divergence the float32 gate must see."""
    import shutil

    d = tmp_path / "eps"
    shutil.copytree(tiny_official, d)
    r = run_parity(str(d), DEFAULT_PROMPTS)
    assert r.passed
    from gpt2_port.model.modules import LayerNorm

    orig = LayerNorm.forward

    def bad(self, x):
        self.eps = 1e-12
        return orig(self, x)

    LayerNorm.forward = bad
    try:
        r = run_parity(str(d), DEFAULT_PROMPTS)
    finally:
        LayerNorm.forward = orig
    assert not r.passed and r.first_failure == "block.0"


def test_metrics_definitions():
    y = torch.tensor([1.0, -2.0, 0.0, 4.0], dtype=torch.float64)
    x = y + torch.tensor([0.0, 0.0, 1e-3, -1e-3], dtype=torch.float64)
    max_abs, norm_rel, cos, elem = metrics(x, y)
    assert max_abs == pytest.approx(1e-3, rel=1e-6)
    assert norm_rel == pytest.approx((2e-6) ** 0.5 / 21**0.5, rel=1e-6)
    assert elem == pytest.approx(1.0)  # 1e-3 / (1e-3 + 0): the near-zero blow-up, reported but never the gate
    assert cos == pytest.approx(float(x @ y) / float(x.norm() * y.norm()))
    assert all(v != v for v in metrics(torch.tensor([float("nan")]), torch.tensor([1.0]))[:2])  # NaN propagates


def test_tolerances_named_per_dtype():
    assert set(TOLERANCES) == {"float32", "bfloat16", "float16"}
    assert TOLERANCES["float32"].block == 1e-6 and TOLERANCES["float32"].top1 == 1.0


def test_prompt_options(tiny_official: Path, tmp_path: Path, capsys):
    pf = tmp_path / "prompts.txt"
    pf.write_text("First line\n\nSecond line\n")
    out = tmp_path / "r.json"
    assert main(["parity", str(tiny_official), "--prompt", "Zero", "--prompt-file", str(pf), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["prompts"] == ["Zero", "First line", "Second line"]
    capsys.readouterr()
    assert main(["parity", str(tiny_official), "--prompt", ""]) == 2
    assert "empty prompt" in capsys.readouterr().err


def test_exact_matmuls_turns_tf32_off_and_puts_every_setting_back() -> None:
    """After `train` turned TF32 on (set_tf32 on a CUDA device; only flags are set, so it runs anywhere), a parity
    check runs its float32 matmuls in float32 and then leaves every precision setting as it found it: oneDNN's CPU
    matmul setting must not come back as TF32."""
    from gpt2_port.train.setup import set_tf32
    from gpt2_port_checks.reference import exact_matmuls, precision_settings

    def state() -> list:
        fine = [o.fp32_precision for o in precision_settings()]
        return fine or [torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()]

    start = [(o, o.fp32_precision) for o in precision_settings()]
    try:
        set_tf32(torch.device("cuda"), True)
        before = state()
        assert torch.backends.cuda.matmul.allow_tf32 is True
        legacy = [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32]
        legacy.append(torch.get_float32_matmul_precision())
        with exact_matmuls():
            assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
            assert torch.get_float32_matmul_precision() == "highest"
        assert state() == before
        # the legacy flags stay readable (a mix of the two APIs makes torch raise on reading them) and as they were
        assert legacy == [True, True, "high"]
        assert [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32] == legacy[:2]
        assert torch.get_float32_matmul_precision() == legacy[2]
    finally:
        _put_back(start)


def _put_back(start: list) -> None:
    """The precision settings as they were at `start`, through the legacy flags first (so they stay readable for
    the tests after) and then every backend's own value."""
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # torch's defaults
    torch.set_float32_matmul_precision("highest")
    for o, value in start:
        o.fp32_precision = value


def test_exact_matmuls_runs_in_a_process_that_mixed_the_two_apis() -> None:
    """A process that set TF32 through the per-backend API and the legacy flags both cannot read the legacy flags
    (torch raises): the check still runs in float32 and puts every backend's own setting back."""
    from gpt2_port_checks.reference import exact_matmuls, precision_settings

    start = [(o, o.fp32_precision) for o in precision_settings()]
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
        mixed = [o.fp32_precision for o in precision_settings()]
        with pytest.raises(RuntimeError):
            torch.backends.cudnn.allow_tf32  # noqa: B018
        with exact_matmuls():
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
            assert torch.backends.cudnn.conv.fp32_precision != "tf32"
        assert [o.fp32_precision for o in precision_settings()] == mixed
    finally:
        _put_back(start)
