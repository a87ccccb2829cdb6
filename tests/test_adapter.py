"""The Conv1D-layout adapter: splits, transposes, both layouts, every key accounted for, and the reverse."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gpt2_port import GPT2
from gpt2_port.config import GPT2Config
from gpt2_port.errors import CheckpointError, ConfigError
from gpt2_port.io.adapter import hf_shapes, hf_to_scratch, scratch_to_hf

CFG = GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=100)


def random_hf(cfg: GPT2Config, prefix: str = "", masks: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {prefix + k: torch.randn(s, generator=g) for k, s in hf_shapes(cfg).items()}
    if masks:
        for i in range(cfg.n_layer):
            n = cfg.n_positions
            sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
            sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return sd


def test_split_and_transpose_are_exact_views():
    sd = random_hf(CFG)
    conv = hf_to_scratch(sd, CFG)
    e = CFG.n_embd
    w = sd["h.1.attn.c_attn.weight"]  # (in, 3*out)
    assert torch.equal(conv.state["h.1.attn.q_proj.weight"], w[:, :e].T)
    assert torch.equal(conv.state["h.1.attn.k_proj.weight"], w[:, e : 2 * e].T)
    assert torch.equal(conv.state["h.1.attn.v_proj.weight"], w[:, 2 * e :].T)
    assert torch.equal(conv.state["h.1.attn.v_proj.bias"], sd["h.1.attn.c_attn.bias"][2 * e :])
    assert torch.equal(conv.state["h.0.mlp.c_fc.weight"], sd["h.0.mlp.c_fc.weight"].T)
    assert conv.state["h.0.mlp.c_fc.weight"].shape == (4 * e, e)  # [out, in]
    # no copies: the scratch tensors share the HF tensors' storage
    assert conv.state["h.1.attn.q_proj.weight"].untyped_storage().data_ptr() == w.untyped_storage().data_ptr()


def test_official_layout_masks_checked_and_dropped():
    sd = random_hf(CFG, masks=True)
    conv = hf_to_scratch(sd, CFG)
    assert sorted(conv.dropped) == sorted([f"h.{i}.attn.{b}" for i in range(2) for b in ("bias", "masked_bias")])
    assert "lm_head.weight" not in conv.state
    # every input key is either mapped or dropped
    mapped = {src for src, _, _ in conv.mapping}
    assert mapped | set(conv.dropped) == set(sd)


def test_not_causal_mask_rejected():
    sd = random_hf(CFG, masks=True)
    sd["h.1.attn.bias"] = torch.ones(1, 1, 16, 16)
    with pytest.raises(CheckpointError, match=r"h\.1\.attn\.bias.*not a causal"):
        hf_to_scratch(sd, CFG)
    sd["h.1.attn.bias"] = 2 * torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)  # causal, but not 0/1
    with pytest.raises(CheckpointError, match=r"h\.1\.attn\.bias.*not a causal \(lower-triangular 0/1\)"):
        hf_to_scratch(sd, CFG)


def test_prefixed_layout_and_errors():
    sd = random_hf(CFG, prefix="transformer.")
    assert set(hf_to_scratch(sd, CFG).state) == set(GPT2(CFG).state_dict())
    missing = dict(sd)
    del missing["transformer.h.1.ln_2.bias"]
    with pytest.raises(
        CheckpointError, match=r"missing key 'transformer\.h\.1\.ln_2\.bias' \(expected shape \(32,\)\)"
    ):
        hf_to_scratch(missing, CFG)
    extra = dict(sd) | {"transformer.h.0.attn.rotary.inv_freq": torch.zeros(4)}
    with pytest.raises(CheckpointError, match=r"unexpected key 'transformer\.h\.0\.attn\.rotary\.inv_freq'"):
        hf_to_scratch(extra, CFG)
    bad = dict(sd) | {"transformer.wpe.weight": torch.zeros(8, 32)}
    with pytest.raises(
        CheckpointError, match=r"'transformer\.wpe\.weight': expected shape \(16, 32\), found \(8, 32\)"
    ):
        hf_to_scratch(bad, CFG)


def test_untied_head_and_tied_copy():
    untied = GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=100, tie_word_embeddings=False)
    sd = random_hf(untied, prefix="transformer.")
    sd["lm_head.weight"] = sd.pop("transformer.lm_head.weight")
    conv = hf_to_scratch(sd, untied)
    assert torch.equal(conv.state["lm_head.weight"], sd["lm_head.weight"])
    # tied config with an exact copy of wte stored: accepted and dropped
    tied = random_hf(CFG, prefix="transformer.")
    tied["lm_head.weight"] = tied["transformer.wte.weight"].clone()
    assert "lm_head.weight" in hf_to_scratch(tied, CFG).dropped
    tied["lm_head.weight"] = torch.zeros(100, 32)
    with pytest.raises(ConfigError, match="lm_head.weight differs from wte.weight"):
        hf_to_scratch(tied, CFG)


def test_reverse_is_inverse():
    sd = random_hf(CFG, prefix="transformer.")
    back = scratch_to_hf(hf_to_scratch(sd, CFG).state, CFG)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_qkv_equal_split_of_transformers_c_attn(tiny_hf: Path):
    """The scratch model's q, k, v equal the split of transformers' c_attn output, in every layer."""
    from transformers import GPT2LMHeadModel

    ref = GPT2LMHeadModel.from_pretrained(tiny_hf, attn_implementation="eager").eval()
    model = GPT2.from_pretrained(str(tiny_hf))
    ids = torch.tensor([[464, 2444, 4721, 511, 3835, 13]])
    outs = {}
    hooks = [
        ref.transformer.h[i].attn.c_attn.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o))
        for i in range(model.config.n_layer)
    ]
    with torch.no_grad():
        ref(ids)
    for h in hooks:
        h.remove()
    with torch.no_grad(), model.record(lambda n: n.endswith((".q", ".k", ".v"))) as acts:
        model(ids)
    e, nh = model.config.n_embd, model.config.n_head
    for i, out in outs.items():
        for j, name in enumerate("qkv"):
            want = out[..., j * e : (j + 1) * e].view(1, ids.shape[1], nh, e // nh).transpose(1, 2)
            got = acts[f"block.{i}.attn.{name}"]
            assert got.shape == want.shape == (1, nh, ids.shape[1], e // nh)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_roundtrip_through_transformers(tiny_official: Path, tmp_path: Path):
    """scratch -> HF layout -> transformers loads it and computes the same logits."""
    from transformers import GPT2LMHeadModel

    model = GPT2.from_pretrained(str(tiny_official))
    model.set_attn_impl("manual")
    hf_sd = scratch_to_hf(model.state_dict(), model.config)
    assert all(k.startswith("transformer.") for k in hf_sd) and not any(
        k.endswith((".attn.bias", ".masked_bias")) for k in hf_sd
    )
    save_file(hf_sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((tiny_official / "config.json").read_text())
    ref = GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, rtol=1e-6, atol=1e-6)
        # and the weights transformers loaded are ours, tensor for tensor (head tied to wte in both)
        assert torch.equal(ref.lm_head.weight, model.wte.weight)
        assert ref.lm_head.weight.data_ptr() == ref.transformer.wte.weight.data_ptr()
