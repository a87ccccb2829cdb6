"""The model trains with transformers' semantics: gradients, loss, dropout, init, checkpointing, save_pretrained."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gpt2_port.config import GPT2Config
from gpt2_port.errors import UsageError
from gpt2_port.io import adapter
from gpt2_port.model import GPT2, from_pretrained

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

# Gradients against transformers' (float32, CPU, manual attention vs eager): worst norm_rel seen 0 (bit-identical),
# sdpa vs sdpa 0 as well on these shapes; the bound leaves room for other BLAS builds.
GRAD_NORM_REL = 1e-5
LOSS_REL = 1e-6  # worst seen: 0 (bit-identical)


def _hf(path: Path, attn: str = "eager", dropout: float = 0.0):
    hf = transformers.GPT2LMHeadModel.from_pretrained(path, attn_implementation=attn)
    for m in hf.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    return hf.train()


def _ours(path: Path, attn: str = "manual", dropout: float = 0.0) -> GPT2:
    m, _ = from_pretrained(path)
    m.set_attn_impl(attn)
    return m.set_dropout(dropout).train().requires_grad_(True)


def _batch(seed: int = 0, B: int = 2, T: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50257, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # an ignored prefix
    return ids, labels


def _norm_rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


@pytest.mark.parametrize("which", ["tiny_official", "tiny_hf_untied"])
@pytest.mark.parametrize("attn", [("manual", "eager"), ("sdpa", "sdpa")])
def test_every_parameter_gets_the_gradient_transformers_computes(which: str, attn, request) -> None:
    """Official layout (tied, un-prefixed, fused c_attn as views) and transformers' layout (untied head, prefix)."""
    path = request.getfixturevalue(which)
    ours, hf = _ours(path, attn[0]), _hf(path, attn[1])
    ids, labels = _batch()
    ours(ids, labels=labels).loss.backward()
    hf(ids, labels=labels, use_cache=False).loss.backward()
    missing = [n for n, p in ours.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    cfg = ours.config
    grads = {n: p.grad for n, p in ours.named_parameters()}
    mapped = adapter.scratch_to_hf(grads, cfg, prefix="transformer.")
    ref = {n: p.grad for n, p in hf.named_parameters()}
    if cfg.tie_word_embeddings:
        assert "lm_head.weight" not in ref or ref["lm_head.weight"] is ref["transformer.wte.weight"]
    for k, g in mapped.items():
        assert _norm_rel(g, ref[k]) <= GRAD_NORM_REL, (k, _norm_rel(g, ref[k]))


def test_loss_equals_transformers_with_ignored_labels_and_padding(tiny_official: Path) -> None:
    ours, hf = _ours(tiny_official).eval(), _hf(tiny_official).eval()
    ids, labels = _batch(1, B=3, T=12)
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0  # right padding, its labels ignored
    labels[2, 8:] = -100
    with torch.no_grad():
        a = ours(ids, attention_mask=mask, labels=labels)
        b = hf(ids, attention_mask=mask, labels=labels, use_cache=False)
    assert a.loss.dtype == torch.float32
    assert abs(a.loss.item() - b.loss.item()) <= LOSS_REL * abs(b.loss.item())
    assert torch.equal(a.logits, ours(ids, attention_mask=mask))  # the plain call still returns logits
    # num_items_in_batch: the summed NLL over a count given by the caller (gradient accumulation), as transformers
    with torch.no_grad():
        c = ours(ids, attention_mask=mask, labels=labels, num_items_in_batch=100)
        d = hf(ids, attention_mask=mask, labels=labels, use_cache=False, num_items_in_batch=100)
    assert abs(c.loss.item() - d.loss.item()) <= LOSS_REL * abs(d.loss.item())
    kept = int((labels[:, 1:] != -100).sum())  # 29 of 100: not the mean
    assert abs(c.loss.item() * 100 / kept - a.loss.item()) <= LOSS_REL * a.loss.item()


def test_dropout_masks_are_transformers_masks_in_train_mode(tiny_official: Path) -> None:
    """Same seed, dropout 0.1 at the four sites: our train-mode logits equal eager transformers' bit for bit,
    which holds only if every site draws its mask in transformers' order and shape."""
    ours, hf = _ours(tiny_official, dropout=0.1), _hf(tiny_official, dropout=0.1)
    ids, _ = _batch(2)
    torch.manual_seed(5)
    a = ours(ids)
    torch.manual_seed(5)
    b = hf(ids, use_cache=False).logits
    assert torch.equal(a, b)
    torch.manual_seed(6)
    assert not torch.equal(ours(ids), a)  # dropout is really on


def test_eval_output_ignores_dropout_rates(tiny_official: Path) -> None:
    m, _ = from_pretrained(tiny_official)
    ids, _ = _batch(3)
    before = m(ids)
    m.set_dropout(0.5)
    assert torch.equal(m(ids), before)
    assert m.config.attn_pdrop == m.config.resid_pdrop == m.config.embd_pdrop == 0.5


def test_dropout_rates_come_from_config_json(tiny_official: Path, tmp_path: Path) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    for f in tiny_official.iterdir():
        (d / f.name).symlink_to(f)
    cfg = json.loads((tiny_official / "config.json").read_text())
    cfg.update(embd_pdrop=0.2, attn_pdrop=0.3, resid_pdrop=0.4)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(cfg))
    m, _ = from_pretrained(d)
    assert m.drop.p == 0.2
    assert m.h[0].attn.attn_dropout.p == 0.3 and m.h[0].attn.resid_dropout.p == 0.4 and m.h[1].mlp.dropout.p == 0.4


def test_init_weights_follows_gpt2s_rule() -> None:
    cfg = GPT2Config(n_layer=6, n_embd=256, n_head=4, n_positions=256, vocab_size=4000)
    m = GPT2(cfg).init_weights(seed=0)
    proj = 0.02 / math.sqrt(2 * cfg.n_layer)
    for name, p in m.named_parameters():
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            want = proj if name.endswith("c_proj.weight") else 0.02
            assert abs(p.mean().item()) < 3 * want / math.sqrt(p.numel()), name
            assert abs(p.std().item() / want - 1) < 0.05, (name, p.std().item(), want)
    again = GPT2(cfg).init_weights(seed=0)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), again.parameters()))


def test_gradient_checkpointing_keeps_the_gradients(tiny_official: Path) -> None:
    """The same gradients with and without checkpointing, and checkpointing does recompute: block 0 starts twice
    (forward, then again in backward) and the blocks keep none of their inner activations for backward."""
    ids, labels = _batch(4)
    grads, counts = [], []
    for ckpt in (False, True):
        m = _ours(tiny_official, "sdpa", dropout=0.1)
        m.gradient_checkpointing = ckpt
        n = {"calls": 0, "saved": 0}
        # a pre-hook: the recomputation stops once it has what backward needs (checkpoint's early stop), before
        # a forward hook would fire
        m.h[0].register_forward_pre_hook(lambda *_, n=n: n.update(calls=n["calls"] + 1))
        torch.manual_seed(7)  # dropout on: checkpointing must replay the same masks
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, n=n: (n.update(saved=n["saved"] + 1), t)[1], lambda t: t
        ):
            loss = m(ids, labels=labels).loss
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in m.named_parameters()})
        counts.append(n)
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k
    assert [c["calls"] for c in counts] == [1, 2]
    assert counts[1]["saved"] < counts[0]["saved"] / 2, counts  # the blocks' inner activations are not kept


def test_fused_qkv_view_is_not_used_when_gradients_are_wanted(tiny_official: Path) -> None:
    """The as_strided c_attn view would route all of c_attn's gradient into q_proj: k and v would get none."""
    m, _ = from_pretrained(tiny_official)
    m.requires_grad_(True)  # eval mode, but autograd on: still no view
    ids, labels = _batch(5)
    m(ids, labels=labels).loss.backward()
    a = m.h[0].attn
    assert a.k_proj.weight.grad is not None and a.v_proj.bias.grad is not None
    assert a.k_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("which", ["tiny_official", "tiny_hf_untied"])
def test_save_pretrained_writes_the_official_layout(which: str, request, tmp_path: Path, tokenizer_dir: Path) -> None:
    src = request.getfixturevalue(which)
    m, _ = from_pretrained(src)
    with torch.no_grad():
        m.h[0].attn.k_proj.bias.add_(1.0)  # a change that must survive the round trip through c_attn
    m.set_dropout(0.0)
    out = m.save_pretrained(tmp_path / "saved", tokenizer_dir=tokenizer_dir)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["attn_pdrop"] == cfg["embd_pdrop"] == cfg["resid_pdrop"] == 0.0 and cfg["initializer_range"] == 0.02
    assert (out / "vocab.json").read_bytes() == (tokenizer_dir / "encoder.json").read_bytes()
    assert (out / "merges.txt").read_bytes() == (tokenizer_dir / "vocab.bpe").read_bytes()
    from gpt2_port.io.safetensors_io import SafetensorsFile

    keys = set(SafetensorsFile(out / "model.safetensors").keys())
    if m.config.tie_word_embeddings:
        assert "h.0.attn.c_attn.weight" in keys and "lm_head.weight" not in keys
        assert SafetensorsFile(out / "model.safetensors").shapes()["h.0.mlp.c_fc.weight"] == (64, 256)  # [in, out]
    else:
        assert "transformer.h.0.attn.c_attn.weight" in keys and "lm_head.weight" in keys
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    back, _ = from_pretrained(out)
    for (n, a), b in zip(m.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), n
    ids, _ = _batch(6)
    hf.eval()
    with torch.no_grad():
        assert _norm_rel(m.eval()(ids), hf(ids).logits) < 1e-5


def test_labels_of_the_wrong_shape_or_range_are_usage_errors(tiny_official: Path) -> None:
    m, _ = from_pretrained(tiny_official)
    ids, labels = _batch(7)
    with pytest.raises(UsageError, match=r"labels of shape \(2, 15\)"):
        m(ids, labels=labels[:, 1:])
    bad = labels.clone()
    bad[1, 3] = 50257
    with pytest.raises(UsageError, match="labels: token id 50257 is out of range"):
        m(ids, labels=bad)
    with pytest.raises(UsageError, match="integer token ids"):
        m(ids, labels=labels.float())
    with pytest.raises(UsageError, match="num_items_in_batch must be a positive count of targets, got 0"):
        m(ids, labels=labels, num_items_in_batch=0)
    with pytest.raises(UsageError, match="num_items_in_batch divides a loss"):
        m(ids, num_items_in_batch=4)


def test_record_rejects_unknown_names(tiny_official: Path) -> None:
    m, _ = from_pretrained(tiny_official)
    with pytest.raises(UsageError, match=r"unknown activation name\(s\) 'block.3.atn.q'.*block.\{0..1\}"):
        with m.record(["block.3.atn.q"]):
            pass
    with m.record(["block.1.", "ln_f"]) as acts:  # prefixes and exact names still work
        m(torch.tensor([[1, 2, 3]]))
    assert "block.1.attn.q" in acts and "ln_f" in acts


def test_activation_gradients_with_keep_graph(tiny_official: Path) -> None:
    m = _ours(tiny_official)
    ids, labels = _batch(8)
    with m.record(["block.0", "ln_f"], keep_graph=True) as acts:
        m(ids, labels=labels).loss.backward()
    assert acts["block.0"].grad is not None and acts["ln_f"].grad.shape == acts["ln_f"].shape


def test_record_with_keep_graph_keeps_gradients_under_gradient_checkpointing(tiny_official: Path) -> None:
    """A backward inside the record block with gradient checkpointing on: the activations recorded inside blocks
    keep their gradients (a recomputation would have replaced them with tensors that never get one). One name may be
    a string."""
    m = _ours(tiny_official)
    m.gradient_checkpointing = True
    ids, labels = _batch(3)
    with m.record(["block.0.ln_1", "block.1.mlp.act", "ln_f"], keep_graph=True) as acts:
        m(ids, labels=labels).loss.backward()
    assert all(acts[n].grad is not None for n in ("block.0.ln_1", "block.1.mlp.act", "ln_f"))
    with m.record("ln_f") as acts:
        m(ids)
    assert list(acts) == ["ln_f"]


def test_ids_on_another_device_than_the_model_are_a_usage_error(tiny_official: Path) -> None:
    """input_ids must be on the model's device ('meta' stands in for a GPU): one line saying so, not torch's error
    from inside the embedding."""
    m = _ours(tiny_official).to("meta")
    with pytest.raises(UsageError, match=r"input_ids are on cpu, the model on meta: pass input_ids.to\(model.device\)"):
        m(torch.tensor([[1, 2, 3]]))


def test_an_unknown_layout_is_a_usage_error_before_the_checkpoint_is_read(tmp_path: Path) -> None:
    """Refused first: the checkpoint named here does not exist (a Hub id would be downloaded before a later check)."""
    with pytest.raises(UsageError, match=r"layout 'contigous': expected one of 'auto', 'checkpoint', 'contiguous'"):
        from_pretrained(tmp_path / "missing", layout="contigous")  # type: ignore[arg-type]
