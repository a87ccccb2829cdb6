"""int8 quantization: the packed layers compute what their dequantized weights say, and the model stays close to
float32 (which is derived, here, from the same model before quantization)."""

from __future__ import annotations

import pytest
import torch

from gpt2_port.errors import UsageError
from gpt2_port.generate.cache import KVCache
from gpt2_port.generate.int8 import Int8Linear, check_trainable, is_quantized, quantize_int8, quantize_rows
from gpt2_port.model import from_pretrained


def test_quantize_rows_roundtrip() -> None:
    w = torch.randn(37, 50) * torch.linspace(0.01, 3, 37)[:, None]  # rows of very different scales
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.shape == (37,)
    assert int(q.abs().max()) == 127  # every row uses the full range
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6).all())  # round to nearest: at most half a step per element


def test_int8_linear_matches_float() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    q = Int8Linear(lin.weight, lin.bias)
    assert q.weight.shape == (48, 64)
    wq, s = quantize_rows(lin.weight)
    assert torch.allclose(q.weight, wq.float() * s[:, None], atol=1e-6)  # the packed weight is the quantized one
    x = torch.randn(3, 5, 64)
    y = q(x)
    assert y.shape == (3, 5, 48)
    ref = lin(x).detach()
    weight_only = x @ q.weight.T + lin.bias.detach()  # what weight-only int8 computes

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    # the residual pass makes the result weight-only int8's, up to the residual's own (7-bit) rounding
    assert rel(y, weight_only) < 2e-3 < rel(weight_only, ref) < 0.02
    one = Int8Linear(lin.weight, lin.bias, exact_activations=False)(x)
    assert rel(y, weight_only) * 4 < rel(one, weight_only) < 0.05  # one pass: 7-bit activations, ~2% error


def test_quantize_model_close_to_float(tiny_official) -> None:  # noqa: ANN001
    model, _ = from_pretrained(tiny_official)
    ids = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(ids)
    assert not is_quantized(model)
    assert quantize_int8(model) is model and is_quantized(model)
    n = sum(isinstance(m, Int8Linear) for m in model.modules())
    assert n == 6 * model.config.n_layer + 1  # q, k, v, c_proj, c_fc, mlp c_proj per block, and the head
    assert isinstance(model.lm_head, Int8Linear) and model.head_weight.shape == model.wte.weight.shape
    with torch.inference_mode():
        got = model(ids)
        # decode with the KV cache
        cache = KVCache(model.config, 2, 12, torch.float32, "cpu")
        a = model(ids[:, :8], cache=cache, last_only=True)
        steps = [model(ids[:, t : t + 1], cache=cache) for t in range(8, 12)]
    assert got.shape == ref.shape
    assert float((got - ref).norm() / ref.norm()) < 0.1

    # activations are quantized per call (one range per input tensor), so cached steps differ from the full pass
    # by quantization noise only
    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x - y).norm() / y.norm())

    assert rel(a[:, 0], got[:, 7]) < 0.05
    assert rel(torch.cat(steps, 1), got[:, 8:]) < 0.05


def test_quantize_refuses_low_precision(tiny_official) -> None:  # noqa: ANN001
    model, _ = from_pretrained(tiny_official, dtype="bfloat16")
    with pytest.raises(UsageError, match="float32"):
        quantize_int8(model)


def test_non_finite_weights_and_activations_are_named_not_crashed_on(tiny_official) -> None:  # noqa: ANN001
    """A NaN weight is refused before quantizing, naming it; an activation that overflows (finite weights) is named at
    the int8 layer it reaches, where torch's dynamic quantizer would fail inside ("min should be less than ...")."""
    model, _ = from_pretrained(tiny_official)
    with torch.no_grad():
        model.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    with pytest.raises(UsageError, match=r"^int8: non-finite weights: h.1.mlp.c_fc.weight \(expected finite values"):
        quantize_int8(model)
    model, _ = from_pretrained(tiny_official)
    with torch.no_grad():
        model.h[0].ln_2.bias.fill_(3e38)  # finite, but the int8 products after it overflow
    quantize_int8(model)
    with torch.no_grad(), pytest.raises(UsageError, match=r"^h\.\d\.\S+ is int8 and its input holds NaN or Inf"):
        model(torch.tensor([[1, 2, 3]]))


def test_generate_cli_int8(tiny_official, tmp_path, capsys) -> None:  # noqa: ANN001
    """`gpt2-port generate --quantize int8` (and its alias --dtype int8) decodes with the int8 model."""
    import json

    from gpt2_port.cli import main

    outs = []
    for flag in (["--quantize", "int8"], ["--dtype", "int8"], []):
        out = tmp_path / f"g{len(outs)}.json"
        rc = main(["generate", str(tiny_official), "Hello there", "--greedy", "--max-new-tokens", "8", *flag,
                   "--json", str(out)])  # fmt: skip
        assert rc == 0
        outs.append(json.loads(out.read_text()))
    err = capsys.readouterr().err
    assert "cpu int8" in err and "cpu float32" in err
    assert outs[0]["dtype"] == outs[1]["dtype"] == "int8" and outs[2]["dtype"] == "float32"
    assert outs[0]["generated_ids"] == outs[1]["generated_ids"]
    assert len(outs[0]["generated_ids"][0]) == 8
    assert main(["generate", str(tiny_official), "Hi", "--quantize", "int8", "--dtype", "bfloat16"]) == 2
    assert "--dtype bfloat16: --quantize int8 quantizes float32 weights" in capsys.readouterr().err


def test_int8_on_cuda_is_refused_naming_the_flag(tiny_official, monkeypatch, capsys) -> None:  # noqa: ANN001
    """--dtype int8 stands for --quantize int8 from float32: on a GPU the refusal names --device, the flag in
    conflict, not the --dtype it rewrote; a GPU is stood in (torch.cuda's availability) so that --device cuda
    parses."""
    from gpt2_port.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["generate", str(tiny_official), "Hi", "--dtype", "int8", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: int8 runs on the CPU (--device cpu, or leave --device out)" in err, err
    assert "float32" not in err


def test_an_int8_model_cannot_train(tiny_official) -> None:  # noqa: ANN001
    """int8 layers have no float weights and no backward: check_trainable, train mode and a wanted gradient each
    raise UsageError naming the layer; inference still runs, and a float model is trainable."""
    model, _ = from_pretrained(tiny_official)
    check_trainable(model)
    quantize_int8(model)
    n = 6 * model.config.n_layer + 1
    with pytest.raises(UsageError, match=rf"quantized to int8 \({n} layers, e.g. h\.0\.attn\.q_proj\) and cannot be"):
        check_trainable(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    model.train()
    with pytest.raises(UsageError, match=r"h\.0\.attn\.q_proj is int8: int8 layers run inference only"):
        model(ids, labels=ids)
    model.eval()
    model.wte.weight.requires_grad_(True)  # a gradient wanted through the int8 layers
    with pytest.raises(UsageError, match=r"h\.0\.attn\.q_proj is int8"):
        model(ids, labels=ids)
    with torch.no_grad():
        assert model(ids).shape == (1, 4, model.config.vocab_size)


def test_an_int8_model_refuses_a_device_and_a_save_in_one_line(tiny_official, tmp_path) -> None:  # noqa: ANN001
    """`.to()` moves an int8 layer's bias and scale but not its packed weight (a CPU object): an input on another
    device ('meta' stands in for CUDA) is refused naming the layer, not torch's missing-kernel error; and
    save_pretrained refuses the int8 model (its state has no float weights to write) before writing anything."""
    model, _ = from_pretrained(tiny_official)
    quantize_int8(model)
    with pytest.raises(UsageError, match=r"^save_pretrained .*: the model is int8-quantized; save the float32 model$"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    model.to("meta")
    with torch.no_grad(), pytest.raises(UsageError, match=r"h\.0\.attn\.q_proj is int8 and runs on the CPU only"):
        model(torch.tensor([[1, 2, 3]], device="meta"))
