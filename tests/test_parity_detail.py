"""The parity report that explains divergence: sub-layer points, the noise floor, the dtype sweep, the logit lens,
and the JSON / Markdown / PNG outputs. Tiny checkpoints only (the 124M run is the spine's, in test_parity.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from gpt2_port.cli import main
from gpt2_port_checks.forward import run_detailed
from gpt2_port_checks.metrics import rel
from gpt2_port_checks.noise import NOISE_MARGIN, closeness, spread, verdict
from gpt2_port_checks.points import SUBLAYER_KINDS, point_names
from gpt2_port_checks.tolerances import TOLERANCES, VS_FLOAT32_TOLERANCES

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

PROMPTS = ["The students opened their books", "Hello world"]
N_LAYER, N_HEAD = 2, 4  # conftest.TINY


def test_sublayer_points_bit_exact_and_noise_floor_measured(tiny_official: Path):
    """Every sub-layer point is compared; manual attention against eager is bit-exact, the floor (eager vs sdpa)
    is zero up to the first attention and non-zero after it, so every figure is 'within noise'."""
    s = run_detailed(str(tiny_official), PROMPTS, detail="sublayer", per_head=True, noise_floor=True, logit_lens=True)
    r = s.reports[0]
    names = [p.name for p in r.points]
    alone = point_names(N_LAYER, "sublayer", True, N_HEAD)
    decode = ["decode.logits", "decode.forward_steps.logits"]
    assert names == alone + [f"batch.{n}" for n in alone] + decode  # the padded batch, the cached paths
    for kind in SUBLAYER_KINDS:
        assert f"block.1.{kind}" in names and f"batch.block.1.{kind}" in names
    assert "block.0.attn.v.h3" in names and names[-3:] == ["batch.logits", *decode]
    assert r.passed and all(p.norm_rel == 0.0 for p in r.points if not p.name.startswith("decode."))
    floor = {p.name: p.noise_norm_rel for p in r.points}
    assert floor["embed"] == floor["block.0.attn.q"] == 0.0  # eager and sdpa agree before any attention
    assert floor["block.0.attn.merged"] > 0.0 and floor["logits"] > 0.0
    assert floor["batch.block.0.attn.q"] == 0.0 and floor["batch.logits"] > 0.0
    assert r.as_close_as_reference is True and r.first_above_noise is None
    assert [e["layer"] for e in r.logit_lens] == [0, 1]
    assert all(e["agreement"] == 1.0 and e["scratch_id"] == e["reference_id"] for e in r.logit_lens)


def test_scratch_sdpa_is_within_the_reference_noise(tiny_hf: Path):
    """The port's sdpa path against eager transformers lands where transformers' own sdpa does."""
    r = run_detailed(str(tiny_hf), PROMPTS, detail="sublayer", noise_floor=True, attn="sdpa").reports[0]
    nonzero = [p for p in r.points if p.norm_rel > 0]
    assert nonzero, "sdpa vs eager should differ somewhere in float32"
    assert all(p.within_noise for p in r.points), [(p.name, p.noise_verdict) for p in r.points if not p.within_noise]


def _break_mlp_of_block_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """A porting bug inside block 1's MLP (erf GELU instead of tanh GELU, in that block only)."""
    import gpt2_port.model.modules as model_mod

    orig = model_mod.MLP.forward

    def forward(self, x):
        if self.tag != "block.1.mlp":
            return orig(self, x)
        rec = self.taps.rec
        h = self.c_fc(x)
        if rec is not None:
            h = rec(f"{self.tag}.pre", h)
        h = torch.nn.functional.gelu(h)
        if rec is not None:
            h = rec(f"{self.tag}.act", h)
        y = self.c_proj(h)
        if rec is not None:
            y = rec(f"{self.tag}.c_proj", y)
        return self.dropout(y)

    monkeypatch.setattr(model_mod.MLP, "forward", forward)


def test_first_diverging_sublayer_point_is_named(
    tiny_official: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
):
    """The sub-layer report localises a bug to the MLP hidden of block 1 (the block report only says block.1),
    marks it far above the noise floor, exits 1 and writes every output."""
    _break_mlp_of_block_1(monkeypatch)
    out, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    rc = main(
        [
            "parity",
            str(tiny_official),
            "--detail",
            "sublayer",
            "--logit-lens",
            "--json",
            str(out),
            "--markdown",
            str(md),
            "--plot",
            str(png),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 1
    r = json.loads(out.read_text())
    assert r["passed"] is False and r["first_failure"] == "block.1.mlp.act"
    assert r["first_above_noise"] == "block.1.mlp.act" and r["as_close_as_reference"] is False
    pts = {p["name"]: p for p in r["points"]}
    assert pts["block.1.ln_2"]["norm_rel"] == 0.0 and pts["block.1.ln_2"]["within_noise"] is True
    assert pts["block.1.mlp.pre"]["norm_rel"] == 0.0  # c_fc's output still agrees: the GELU is the culprit
    assert pts["block.1.mlp.act"]["noise_verdict"].startswith("above")
    # the spine's schema is still there, extended
    assert {"model", "dtype", "device", "passed", "first_failure", "top1_agreement", "points"} <= set(r)
    assert all({"name", "max_abs", "norm_rel", "cosine", "elementwise_rel"} <= set(p) for p in r["points"])
    assert "block.1.mlp.act" in text and "FAIL" in text and "NO" in text
    m = md.read_text()
    assert m.startswith("# Parity report") and "first diverging point block.1.mlp.act" in m and "logit lens" in m
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dtype_sweep_against_float32_reference(tiny_official: Path, tmp_path: Path, capsys):
    """float32,bfloat16 in one go: each against the float32 reference, under its own tolerance; reduced precision
    is judged against transformers' own error in that dtype."""
    out = tmp_path / "sweep.json"
    argv = ["parity", str(tiny_official), "--device", "cpu", "--dtype", "float32,bfloat16", "--prompt", PROMPTS[0]]
    rc = main([*argv, "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    r = json.loads(out.read_text())
    confs = r["configurations"]
    assert [c["config"] for c in confs] == ["float32/cpu", "bfloat16/cpu"]
    assert all(c["reference_dtype"] == "float32" for c in confs)
    bf = confs[1]
    blocks = [p for p in bf["points"] if p["name"].startswith("block.")]
    assert all(p["tolerance"] == VS_FLOAT32_TOLERANCES["bfloat16"].block for p in blocks)
    assert 1e-4 < max(p["norm_rel"] for p in blocks) <= VS_FLOAT32_TOLERANCES["bfloat16"].block
    assert all(p["noise_norm_rel"] > 0 for p in bf["points"])  # bfloat16 rounding shows even at the embeddings
    assert r["passed"] is True and r["first_failure"] is None and r["first_failure_config"] is None
    # the first configuration's report lives in `configurations` only, not repeated at the top level
    assert "points" not in r and "dtype" not in r and "top1_agreement" not in r
    assert confs[0]["dtype"] == "float32" and [p["name"] for p in confs[0]["points"]][:2] == ["embed", "block.0"]
    assert "sweep" in text and "bfloat16/cpu" in text


def test_tolerance_tables_cover_every_dtype():
    assert set(VS_FLOAT32_TOLERANCES) == set(TOLERANCES)
    for name in ("bfloat16", "float16"):  # against float32 nothing can be tighter than against the same dtype
        assert VS_FLOAT32_TOLERANCES[name].block >= TOLERANCES[name].block


def test_verdict_rules():
    assert verdict(0.0, 0.0).within and verdict(0.0, 0.0).text == "within noise"
    v = verdict(1e-7, 0.0)
    assert not v.within and v.ratio is None and "exact" in v.text
    assert verdict(NOISE_MARGIN * 1e-7, 1e-7).within
    v = verdict(30e-7, 1e-7)
    assert not v.within and v.text == "above x30"


def test_scalar_differences_and_a_totals_spread():
    """The loss, a total NLL, a perplexity: |a - b| / |b|, 0 where equal and inf where only b is 0 (as norm_rel); a
    total's floor sums the items' distances, where the signed sum would let them cancel."""
    assert rel(1.5, 1.0) == 0.5 and rel(-1.0, -2.0) == 0.5
    assert rel(0.0, 0.0) == 0.0 and rel(1e-9, 0.0) == math.inf and math.isnan(rel(math.nan, 1.0))
    assert spread([1.0, 2.0, 3.5], [1.5, 1.0, 3.5]) == 1.5  # 0.5 + 1.0 (signed: -0.5 + 1.0 = 0.5)
    with pytest.raises(ValueError):
        spread([1.0], [1.0, 2.0])  # the floor scored other items


def test_the_noise_sentence():
    """The one YES/NO sentence of the parity report and of eval --check, over (name, error, verdict) figures."""
    head = "cfg: as close to eager transformers as its sdpa kernel is"
    exact = [("embed", 0.0, verdict(0.0, 0.0)), ("block.0", 0.0, verdict(0.0, 1e-7))]
    assert closeness(head, exact, "point") == f"{head}: YES (bit-exact at every point)"
    near = [*exact, ("block.1", 1.5e-7, verdict(1.5e-7, 1e-7)), ("ln_f", 1e-7, verdict(1e-7, 1e-7))]
    assert closeness(head, near, "point") == f"{head}: YES (every point within 2x the floor; worst x1.5 at block.1)"
    far = [*near, ("logits", 3e-7, verdict(3e-7, 1e-7)), ("x", 1e-9, verdict(1e-9, 0.0))]
    assert closeness(head, far, "point") == f"{head}: NO (2 of 6 points above the floor; first at logits, above x3)"
    alone = [("x", 1e-9, verdict(1e-9, 0.0)), ("y", float("nan"), verdict(float("nan"), 1e-7))]
    assert closeness(head, alone, "figure") == (
        f"{head}: NO (2 of 2 figures above the floor; first at x, above (reference exact here))"
    )


def test_cuda_in_the_sweep_is_a_usage_error(tiny_official: Path, capsys):
    assert main(["parity", str(tiny_official), "--device", "cpu,cuda"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("opt", ["--plot", "--markdown"])
def test_unwritable_output_fails_before_any_work(tiny_official: Path, tmp_path: Path, opt: str, capsys):
    assert main(["parity", str(tiny_official), "--detail", "sublayer", opt, str(tmp_path / "no" / "x")]) == 2
    assert f"{opt} " in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(tiny_official: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["parity", str(tiny_official), "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'gpt2-port[plot]'" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "p.png").exists()
