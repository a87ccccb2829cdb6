"""`gpt2-port parity MODEL --backward [--train-steps N]`: every gradient and every step against transformers."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from gpt2_port.cli import main
from gpt2_port.errors import UsageError
from gpt2_port.io.load import read_checkpoint
from gpt2_port.model import from_pretrained, lowp

transformers = pytest.importorskip("transformers")

from gpt2_port_checks import backward, backward_report, grads, steps, storage, tolerances  # noqa: E402

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

PROMPTS = ["--prompt", "The students opened their books", "--prompt", "The cat chased the mouse"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out + err


def _hf_param_names(path: Path) -> list[str]:
    hf = transformers.GPT2LMHeadModel.from_pretrained(path)
    return [n for n, _ in hf.named_parameters()]


@pytest.fixture(scope="module")
def tied_run(tiny_official: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path]:
    out = tmp_path_factory.mktemp("bw")
    argv = ["parity", str(tiny_official), "--backward", "--train-steps", "4", *PROMPTS]
    argv += ["--json", str(out / "r.json"), "--markdown", str(out / "r.md"), "--plot", str(out / "r.png")]
    rc = main(argv)
    return rc, json.loads((out / "r.json").read_text()), out


def test_every_gradient_and_step_equals_transformers_on_the_official_layout(tied_run, tiny_official: Path) -> None:
    rc, d, _ = tied_run
    assert rc == 0 and d["passed"] and d["kind"] == "backward"
    grads = {p["name"]: p for p in d["points"] if p["name"].startswith("grad.")}
    # one point per transformers parameter (a tied head is wte itself: no separate lm_head)
    assert sorted(grads) == sorted(f"grad.{n}" for n in _hf_param_names(tiny_official))
    assert "grad.lm_head.weight" not in grads
    assert all(p["norm_rel"] <= 1e-5 and p["cosine"] > 0.999999 for p in grads.values())
    acts = [p["name"] for p in d["points"] if p["name"].startswith("act_grad.")]
    assert acts == ["act_grad.embed", "act_grad.block.0", "act_grad.block.1", "act_grad.ln_f", "act_grad.logits"]
    assert d["loss_rel"] <= 1e-6 and d["loss_scratch"] > 0
    # float32: the loss's floor is shown, not judged (a float32 scalar per prompt; two attentions' often round alike)
    assert d["loss_noise_rel"] is not None and d["loss_within_noise"] is None and d["loss_noise_verdict"] is None
    # the noise floor is measured beside every figure: transformers' sdpa gradients are not its eager ones
    assert all(p["noise_norm_rel"] is not None and p["within_noise"] for p in d["points"])
    assert max(p["noise_norm_rel"] for p in d["points"]) > 0
    assert d["as_close_as_reference"] is True and d["first_diverging_layer"] is None
    steps = d["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(abs(s["loss_scratch"] - s["loss_reference"]) <= 1e-5 * s["loss_reference"] for s in steps)
    assert steps[-1]["loss_reference"] < steps[0]["loss_reference"]  # the steps really train
    assert len(d["weights"]) == len(grads) and all(p["norm_rel"] <= 1e-5 for p in d["weights"])
    # the steps' noise floor: transformers' sdpa run taking the same steps, its drift as an envelope. The loss is one
    # float32 scalar, and the two attentions' losses can round to the same value at every step (an Intel Xeon under
    # the second configuration: all four step floors 0.0), so the run is shown to be real by its weights: after the
    # same steps they differ (3.7e-6 there, 4.6e-6 under the default configuration)
    floors = [s["noise_rel"] for s in steps]
    assert all(f is not None for f in floors) and floors == sorted(floors)
    assert all(s["within_noise"] for s in steps) and d["steps_as_close_as_reference"] is True
    assert all(p["noise_norm_rel"] is not None for p in d["weights"])
    assert max(p["noise_norm_rel"] for p in d["weights"]) > 0
    assert [g["layer"] for g in d["layers"]] == ["embed", "h.0", "h.1", "ln_f", "head"]


def test_fast_kernels_are_within_the_references_own_noise(tiny_official: Path, tmp_path: Path) -> None:
    """The fast kernels' gradients are not transformers' bit for bit, but no further from them than transformers'
    sdpa gradients are from its eager ones: three prompts, so the mean over them is not a power of two."""
    js = tmp_path / "fast.json"
    argv = ["parity", str(tiny_official), "--backward", "--kernels", "fast", "--json", str(js)]
    assert main([*argv, *PROMPTS, "--prompt", "A third prompt, longer than the other two of them"]) == 0
    d = json.loads(js.read_text())
    grads = [p for p in d["points"] if p["name"].startswith("grad.")]
    assert any(p["norm_rel"] > 0 for p in grads)  # really another arithmetic (the one-kernel GELU)
    assert d["as_close_as_reference"] is True, [p["name"] for p in d["points"] if not p["within_noise"]]


def test_markdown_and_plot_are_written(tied_run) -> None:
    _, _, out = tied_run
    md = (out / "r.md").read_text()
    assert md.startswith("# Backward parity report") and "grad.transformer.h.1.attn.c_attn.weight" in md
    assert "AdamW steps" in md
    assert (out / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _three_prompts(ckpt: Path) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """transformers (eager, dropout off) on `ckpt`, and three prompts of 5, 2 and 3 ids."""
    hf = backward._dropout_off(transformers.GPT2LMHeadModel.from_pretrained(ckpt, attn_implementation="eager"))
    return hf, [torch.tensor([[464, 2444, 4721, 511, 3835]]), torch.tensor([[464, 3797]]), torch.tensor([[50, 7, 9]])]


def test_the_gradient_of_the_reference_itself_is_what_is_compared(tiny_official: Path) -> None:
    """The runner's reference gradients equal a plain transformers backward (so the report compares the real ones)."""
    hf, ids = _three_prompts(tiny_official)
    # the mean of the prompts' losses, each its summed NLL over 3 x its targets (so each backward starts from 1)
    losses = [hf(input_ids=i, labels=i, use_cache=False, num_items_in_batch=3 * (i.shape[1] - 1)).loss for i in ids]
    torch.stack(losses).sum().backward()
    want = {n: p.grad.clone() for n, p in hf.named_parameters()}
    hf.zero_grad(set_to_none=True)
    g = grads.reference_grads(hf, ids, hf.config.n_layer)
    assert set(g.params) == set(want)
    assert all(torch.equal(g.params[n], want[n]) for n in want)
    assert g.prompt_losses == tuple(x.item() for x in losses) and g.loss == torch.stack(losses).sum().item()


def test_the_loss_floor_sums_the_prompts_distances(tiny_official: Path) -> None:
    """The loss sums the prompts' losses, so its floor is transformers' distance at each prompt, summed over the
    reference's loss: the distance of the two sums would cancel by chance (measured on 3 prompts of tiny shakespeare,
    bf16 autocast, 8 seeds x 2 kernel sets: a floor of 1.8e-6 where the others were 1.1e-5 to 3.1e-5 made one run
    "above x3.76"). Here the floor's run is float32 transformers itself, and the reference it is measured against
    moves each prompt's loss by a known amount, two of them with opposite signs."""
    hf, ids = _three_prompts(tiny_official)
    g = grads.reference_grads(hf, ids, hf.config.n_layer)
    moved = [x + d for x, d in zip(g.prompt_losses, (1e-3, -1e-3, 2e-3), strict=True)]  # signed 2e-3, distances 4e-3
    want = dataclasses.replace(g, loss=sum(moved), prompt_losses=tuple(moved))
    floor = backward._floor_of(hf, "eager", ids, hf.config.n_layer, want, torch.float32)
    assert floor["loss"][0] == pytest.approx(4e-3 / sum(moved), rel=1e-6)


def test_untied_head_gets_its_own_gradient_point(
    tiny_hf_untied: Path, tokenizer_dir: Path, capsys, tmp_path: Path
) -> None:
    rc, out = _run(
        ["parity", str(tiny_hf_untied), "--backward", "--no-noise-floor", *PROMPTS, "--tokenizer", str(tokenizer_dir)]
        + ["--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert (tmp_path / "r.json").is_file(), out
    d = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and d["passed"], out
    names = [p["name"] for p in d["points"]]
    assert "grad.lm_head.weight" in names and "grad.transformer.wte.weight" in names
    head = next(g for g in d["layers"] if g["layer"] == "head")
    assert head["worst_noise_norm_rel"] is None  # floor off
    assert "first diverging layer: none" in out


def test_a_wrong_gradient_is_caught_and_its_layer_named(
    tiny_official: Path, capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backward bug in one parameter (its gradient scaled by 1.001) fails the report at that parameter, names its
    layer, and is above transformers' own noise; everything else stays equal."""

    def broken(*a, **k):
        m, rep = from_pretrained(*a, **k)
        m.requires_grad_(True)
        m.h[1].mlp.c_fc.weight.register_hook(lambda g: g * 1.001)
        return m, rep

    monkeypatch.setattr(backward, "from_pretrained", broken)
    rc, out = _run(["parity", str(tiny_official), "--backward", *PROMPTS, "--json", str(tmp_path / "r.json")], capsys)
    assert (tmp_path / "r.json").is_file(), out
    d = json.loads((tmp_path / "r.json").read_text())
    assert rc == 1 and not d["passed"]
    assert d["first_failure"] == "grad.transformer.h.1.mlp.c_fc.weight"
    assert d["first_diverging_layer"] == "h.1"
    bad = [p["name"] for p in d["points"] if not p["passed"]]
    assert bad == ["grad.transformer.h.1.mlp.c_fc.weight"]
    assert d["first_above_noise"] == "grad.transformer.h.1.mlp.c_fc.weight"
    assert "FAIL" in out


def test_a_wrong_optimizer_step_is_caught(
    tiny_official: Path, capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decaying every parameter on our side only (biases and LayerNorm too) moves the losses after step 0 and the
    weights: the step and weight checks see what the gradient check cannot."""
    real = backward.hf_name_of_scratch
    monkeypatch.setattr(backward, "hf_name_of_scratch", lambda cfg: dict.fromkeys(real(cfg), "transformer.wte.weight"))
    rc, out = _run(
        ["parity", str(tiny_official), "--train-steps", "3", "--no-noise-floor", "--lr", "1e-2", *PROMPTS]
        + ["--weight-decay", "0.5", "--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert (tmp_path / "r.json").is_file(), out
    d = json.loads((tmp_path / "r.json").read_text())
    assert rc == 1
    assert all(p["passed"] for p in d["points"])  # the gradients before any step still agree
    assert d["first_failure"].startswith(("steps[", "weight."))
    assert any(not p["passed"] for p in d["weights"])
    assert "steps_as_close_as_reference" not in d and d["steps"][0]["noise_rel"] is None  # --no-noise-floor


def test_steps_that_drift_further_than_transformers_own_are_marked(
    tiny_official: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our side taking a slightly different step (a learning rate 1% off) drifts further than transformers' own
    eager and sdpa runs drift apart on the same steps: the steps' verdict says so."""
    real = backward.train_steps

    def off(model, *a, **k):  # noqa: ANN001, ANN202
        if model.__class__.__module__.startswith("gpt2_port"):
            tc = a[4]
            a = (*a[:4], dataclasses.replace(tc, lr=tc.lr * 1.01), *a[5:])
        return real(model, *a, **k)

    monkeypatch.setattr(backward, "train_steps", off)
    js = tmp_path / "r.json"
    main(["parity", str(tiny_official), "--train-steps", "3", *PROMPTS, "--json", str(js)])
    d = json.loads(js.read_text())
    assert d["steps_as_close_as_reference"] is False
    assert d["steps"][0]["within_noise"] is True  # before any update the losses are the same
    assert any(s["within_noise"] is False for s in d["steps"][1:])


def test_a_steps_floor_sums_the_prompts_distances_and_keeps_the_largest_so_far() -> None:
    """Step 0's totals are equal (each prompt 0.1 off, in opposite directions): its floor is 0.2 over the loss, not
    0; steps 1 and 2 meet again to the bit, and keep step 0's floor."""
    S = steps.StepLoss
    floor = [S(3.0, (1.0, 2.0)), S(2.9, (1.0, 1.9)), S(2.8, (1.4, 1.4))]
    ref = [S(3.0, (1.1, 1.9)), S(2.9, (1.0, 1.9)), S(2.8, (1.4, 1.4))]
    assert backward.step_floors(floor, ref) == pytest.approx([0.2 / 3.0] * 3, rel=1e-12)
    assert backward.step_floors(ref, ref) == [0.0] * 3
    # over the reference's loss, not the floor run's
    assert backward.step_floors([S(2.0, (1.0, 1.0))], [S(4.0, (2.0, 2.0))]) == [0.5]


def test_a_steps_loss_is_the_float32_sum_of_its_prompts_shares(tiny_official: Path) -> None:
    """Step 0 (before any update) reads what the gradients' run reads: the total as the float32 sum's own value,
    bit for bit, and each prompt's share."""
    hf, ids = _three_prompts(tiny_official)
    g = grads.reference_grads(hf, ids, hf.config.n_layer)
    names = {n: n for n, _ in hf.named_parameters()}
    cfg = read_checkpoint(str(tiny_official))[1].config  # the port's config: the decay groups are decided on it
    out = steps.train_steps(hf, names, cfg, steps._ref_loss, ids, steps.TrainConfig(steps=1))
    assert out == [(g.loss, g.prompt_losses)]  # (on the AMD EPYC a float64 sum of the shares differs in the last bit)


def test_reduced_dtype_sweep_against_one_float32_reference(tiny_official: Path, capsys, tmp_path: Path) -> None:
    rc, out = _run(
        ["parity", str(tiny_official), "--backward", "--device", "cpu", "--dtype", "float32,bfloat16", *PROMPTS]
        + ["--json", str(tmp_path / "r.json")],
        capsys,
    )
    assert (tmp_path / "r.json").is_file(), out
    d = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0, out
    assert "points" not in d and "steps" not in d  # a sweep repeats no configuration at the top
    confs = {c["config"]: c for c in d["configurations"]}
    assert set(confs) == {"float32/cpu", "bfloat16/cpu"}
    bf = confs["bfloat16/cpu"]
    assert bf["reference_dtype"] == "float32"
    worst = max(p["norm_rel"] for p in bf["points"])
    assert 1e-4 < worst <= tolerances.BACKWARD_TOLERANCES["bfloat16"].grad  # bfloat16 really ran
    assert bf["as_close_as_reference"] is True  # as far from float32 as transformers itself in bfloat16


# 20 tokens: more rows than lowp's threshold, so that a CPU without bf16 units runs the float32 products
BF16_PROMPT = "The students opened their books, and the teacher began to read the first chapter of the story aloud."


@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize("units", ["none", "amx"], ids=["float32-products", "bf16-kernels"])
def test_a_bf16_autocast_step_lies_within_transformers_own_bf16_distance(
    tiny_official: Path, kernels: str, units: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `gpt2-port train --dtype bf16` runs (float32 weights, forward and backward under bf16 autocast, AdamW on
    the float32 weights), with either kernel set: its loss and every gradient are no further from the float32
    reference than transformers under the same autocast is from itself in float32; so are its optimizer steps. Both
    ways our matmuls run under CPU autocast: as float32 products of the cast operands (a CPU without bf16 units,
    lowp.autocast_upcast) and as autocast's bf16 kernels (with AMX); transformers runs autocast's kernels."""
    monkeypatch.setattr(lowp, "cpu_features", lambda: frozenset() if units == "none" else frozenset({"amx_bf16"}))
    tc = steps.TrainConfig(steps=2)
    r = backward.run_backward(str(tiny_official), [BF16_PROMPT], dtypes="bfloat16", kernels=kernels, train=tc).reports[
        0
    ]
    assert r.precision == "bfloat16 autocast" and r.kernels == kernels
    assert "autocast" in r.noise_floor
    assert 1e-4 < max(p.norm_rel for p in r.points)  # bf16 really ran
    assert r.as_close_as_reference is True, [(p.name, p.noise_ratio) for p in r.points if not p.within_noise]
    assert r.loss_rel <= r.loss_tolerance and r.passed
    assert all(s.passed for s in r.steps)
    # the loss, judged against transformers' own bf16 distance too (a real distance: bf16 ran on both sides)
    assert r.loss_noise_rel > 0 and r.loss_within_noise is True and r.loss_noise_verdict == "within noise"
    lines = backward_report.summary(backward.BackwardSweep("m", [r], "transformers"))
    n = len(r.points) + 1
    assert "bfloat16/cpu: the loss and every gradient within the reference's own noise: YES" in lines
    r.loss_within_noise = False  # a loss further off than transformers' own, every gradient within: not as close
    assert r.as_close_as_reference is False and r.to_json()["first_above_noise"] == "loss"
    lines = backward_report.summary(backward.BackwardSweep("m", [r], "transformers"))
    verdict = "bfloat16/cpu: the loss and every gradient within the reference's own noise:"
    assert f"{verdict} NO (1 of {n} above it)" in lines


def test_optimizer_groups_are_decided_on_transformers_names(tiny_official: Path) -> None:
    m, rep = from_pretrained(tiny_official)
    cfg = rep.config
    names = grads.hf_name_of_scratch(cfg)
    assert set(names) == {n for n, _ in m.named_parameters()}
    hf = transformers.GPT2LMHeadModel.from_pretrained(tiny_official)
    ours_decay = sum(p.numel() for n, p in m.named_parameters() if grads.decays(names[n], cfg))
    ref_decay = sum(p.numel() for n, p in hf.named_parameters() if grads.decays(n, cfg))
    assert ours_decay == ref_decay == sum(p.numel() for p in hf.parameters() if p.ndim >= 2)
    assert not grads.decays("transformer.h.0.ln_1.weight", cfg) and grads.decays("transformer.wpe.weight", cfg)


def test_spilled_reference_gradients_give_the_same_report(tiny_official: Path) -> None:
    """Large models keep the reference's gradients on disk (SpilledTensors); the figures must not change."""
    prompts = ["The students opened their books"]
    kept = backward.run_backward(str(tiny_official), prompts, spill_bytes=None)
    spilled = backward.run_backward(str(tiny_official), prompts, spill_bytes=0)
    a, b = kept.reports[0], spilled.reports[0]
    assert b.passed and [p.name for p in a.points] == [p.name for p in b.points]
    assert [(p.norm_rel, p.noise_norm_rel) for p in a.points] == [(p.norm_rel, p.noise_norm_rel) for p in b.points]
    assert max(p.noise_norm_rel for p in b.points) > 0


def test_only_host_tensors_spill(tmp_path: Path) -> None:
    """The spill saves host memory: tensors on an accelerator (here `meta`, which holds no data, standing in for CUDA)
    stay where they are whatever their size (writing them would need their bytes on the host: 1.5B's backward on CUDA
    failed there), host tensors above the limit go to disk and read back equal."""
    big = {"w": torch.empty(1 << 20, 1 << 12, device="meta")}  # 16 GiB declared, nothing allocated
    assert not storage.spills(big, 0) and not storage.spills(big, None)
    host = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    assert storage.spills(host, 0) and not storage.spills(host, 1 << 20) and not storage.spills(host, None)
    want = {k: v.clone() for k, v in host.items()}
    spilled = storage.SpilledTensors(host, tmp_path / "s.safetensors")
    assert all(torch.equal(spilled[k], v) and spilled[k].dtype == v.dtype for k, v in want.items())


def test_both_sides_step_with_single_tensor_adamw(tiny_official: Path, monkeypatch) -> None:
    """Both sides' AdamW is torch's single-tensor loop on every device: on CUDA torch's default (foreach) runs our
    strided q/k/v views and transformers' dense weights through different kernels. The report names the optimizer."""
    made = []
    real = torch.optim.AdamW

    class Spy(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw) -> None:
            made.append({k: kw.get(k) for k in ("foreach", "fused")})
            super().__init__(*a, **kw)

    monkeypatch.setattr(steps.torch.optim, "AdamW", Spy)
    r = backward.run_backward(
        str(tiny_official), ["The students opened their books"], train=steps.TrainConfig(steps=1), noise_floor=False
    )
    assert made == [{"foreach": False, "fused": False}] * 2  # the reference, then ours
    assert r.reports[0].passed and "single-tensor" in r.reports[0].train["optimizer"]


def test_moments_on_disk_and_spilled_weights_give_the_same_steps(tiny_official: Path) -> None:
    """1.5B's training state does not fit this machine: AdamW's moments then live in file-backed mappings and the
    reference's trained weights on disk. Every step's losses and every weight figure must be what they are in
    memory, and the moments must really have been in the mapped files (not a fresh state made by torch)."""
    prompts = ["The students opened their books"]
    tc = steps.TrainConfig(steps=3)
    mem = backward.run_backward(str(tiny_official), prompts, train=tc, noise_floor=False, disk_moments=False)
    disk = backward.run_backward(
        str(tiny_official), prompts, train=tc, noise_floor=False, disk_moments=True, spill_bytes=0
    )
    a, b = mem.reports[0], disk.reports[0]
    assert a.passed and b.passed
    assert [(s.loss_scratch, s.loss_reference) for s in a.steps] == [
        (s.loss_scratch, s.loss_reference) for s in b.steps
    ]
    assert [(p.name, p.max_abs) for p in a.weights] == [(p.name, p.max_abs) for p in b.weights]


def test_moments_on_disk_hold_adamws_state(tiny_official: Path, tmp_path: Path, monkeypatch) -> None:
    from gpt2_port.model import from_pretrained

    model, rep = from_pretrained(str(tiny_official))
    model.train().requires_grad_(True)
    names = grads.hf_name_of_scratch(rep.config)
    ids = [torch.tensor([[464, 2444, 4721, 511]])]
    tc = steps.TrainConfig(steps=2)
    seen = []

    def inspect_then_remove(path, **kw):  # the moments as the steps left them
        files = sorted(Path(path).glob("*.bin"))
        seen.append(len(files) == 2 * len(list(model.parameters())) and all(f.stat().st_size > 0 for f in files))
        seen.append(any(torch.from_file(str(f), size=f.stat().st_size // 4).abs().sum() > 0 for f in files))
        real_rmtree(path, **kw)

    real_rmtree = steps.shutil.rmtree
    monkeypatch.setattr(steps.shutil, "rmtree", inspect_then_remove)
    moments = tmp_path / "m"
    moments.mkdir()
    out = steps.train_steps(model, names, rep.config, steps._scratch_loss, ids, tc, moments)
    assert seen == [True, True] and not moments.exists()  # written, then removed for the next run's moments
    assert [len(x.prompts) for x in out] == [1, 1] and all(x.prompts == (x.total,) for x in out)  # one prompt
    # not enough disk for them: refused before the first step, naming the directory
    full = shutil.disk_usage(tmp_path)._replace(free=1024)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda _p: full)
    moments.mkdir()
    with pytest.raises(UsageError, match=r"moments on disk need .* GiB in .*m, 0\.0 GiB free"):
        steps.train_steps(model, names, rep.config, steps._scratch_loss, ids, tc, moments)


def test_train_steps_clip_on_transformers_layout_so_steps_are_bit_identical(tiny_official: Path) -> None:
    """Gradients bit-identical, the clip norm summed over transformers' tensors on both sides: every step's loss and
    every weight after the steps equal exactly. The clip clips (the tiny model's norm is far above 0.01), and eps=1
    makes AdamW's update proportional to the clipped gradient instead of invariant to its scale, so a clip factor one
    bit off would show in the weights."""
    tc = steps.TrainConfig(steps=4, lr=1e-2, clip=0.01, eps=1.0)
    r = backward.run_backward(str(tiny_official), ["The students opened their books"], train=tc, noise_floor=False)
    rep = r.reports[0]
    assert [s.rel for s in rep.steps] == [0.0] * 4
    assert len({s.loss_scratch for s in rep.steps}) == 4  # it trained
    assert all(p.max_abs == 0.0 for p in rep.weights), max(rep.weights, key=lambda p: p.max_abs)


def test_a_weight_past_its_tolerance_within_the_references_own_drift_passes(tmp_path: Path, capsys) -> None:
    """Zero biases (init_weights): the key bias's true gradient is ~0, so AdamW turns rounding into steps of about lr
    and the sdpa path's key bias lands 3e-4 from eager transformers', as far as transformers' own sdpa run does: the
    weight passes (it failed the run before), and the report says it passed by the floor."""
    from gpt2_port import GPT2, GPT2Config

    GPT2(GPT2Config(n_layer=2, n_embd=64, n_head=2)).init_weights(seed=0).save_pretrained(tmp_path / "m")
    rc, out = _run(
        ["parity", str(tmp_path / "m"), "--train-steps", "2", "--attn", "sdpa", "--json", str(tmp_path / "r.json")],
        capsys,
    )
    d = json.loads((tmp_path / "r.json").read_text())
    over = [w for w in d["weights"] if w["norm_rel"] > w["tolerance"]]
    assert rc == 0 and over and all(w["passed"] and w["within_noise"] for w in over)
    assert "past it but within transformers' own drift, which passes" in out


def test_fail_above_noise_gates_the_step_losses_too() -> None:
    """A run whose gradients and steps pass their tolerances but whose step 1 drifted further than transformers' own
    run: exit 0 by default, 1 under --fail-above-noise, naming that step."""
    from gpt2_port_checks.backward_results import BackwardReport, BackwardSweep, StepResult

    r = BackwardReport("m", "float32", "cpu", "ref", "float32", "cpu", "manual", ["p"], 3, loss_rel=0.0)
    r.loss_tolerance = 1e-6
    r.steps = [
        StepResult(0, 1.0, 1.0, 0.0, 1e-5, True, 0.0, True),
        StepResult(1, 1.0, 1.0, 1e-6, 1e-5, True, 0.0, False),
    ]
    sweep = BackwardSweep("m", [r], "ref")
    assert sweep.passed and sweep.exit_code(False) == 0
    assert sweep.exit_code(True) == 1 and sweep.noise_failure() == "float32/cpu the loss of step 1"
