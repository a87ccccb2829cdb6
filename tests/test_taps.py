"""Reading and editing activations: `model.record` and `model.edit` at every named tap, nested, with gradients on a
frozen model, and the decode shortcuts standing aside while anything (a tap, a module hook) could change a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpt2_port.errors import UsageError
from gpt2_port.generate import generate_full
from gpt2_port.model import from_pretrained
from gpt2_port.model.modules import gelu_new
from gpt2_port.model.taps import MANUAL_ATTENTION_POINTS, tap_names

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration


@pytest.fixture()
def model(tiny_official: Path):  # noqa: ANN201
    m, _ = from_pretrained(tiny_official)
    return m.eval()


def _ids(seed: int, B: int = 2, T: int = 12) -> torch.Tensor:
    return torch.randint(0, 50257, (B, T), generator=torch.Generator().manual_seed(seed))


def test_every_tap_is_recorded_once_in_forward_order(model) -> None:  # noqa: ANN001
    n = model.config.n_layer
    with torch.no_grad(), model.record() as acts:
        model(_ids(0))
    assert list(acts) == tap_names(n)
    assert acts["block.0.attn.scores"].shape == acts["block.0.attn.probs"].shape == (2, model.config.n_head, 12, 12)
    assert acts["block.0.mlp.pre"].shape == acts["block.0.mlp.act"].shape == (2, 12, model.config.d_mlp)


def test_scores_and_pre_activations_are_what_the_next_tap_is_made_of(model) -> None:  # noqa: ANN001
    """probs = softmax(scores), masked keys at the dtype's lowest value (transformers' eager); act = gelu_new(pre)."""
    with torch.no_grad(), model.record(["block.1.attn.", "block.1.mlp."]) as acts:
        model(_ids(1))
    scores = acts["block.1.attn.scores"]
    assert torch.equal(F.softmax(scores, dim=-1), acts["block.1.attn.probs"])
    future = torch.ones(12, 12, dtype=torch.bool).triu(1)
    assert bool((scores[..., future] == torch.finfo(scores.dtype).min).all())
    assert torch.equal(gelu_new(acts["block.1.mlp.pre"]), acts["block.1.mlp.act"])


@pytest.mark.parametrize("point", MANUAL_ATTENTION_POINTS)
def test_recording_changes_no_bit_except_where_it_asks_for_the_manual_attention(model, point: str) -> None:  # noqa: ANN001
    """Every other tap leaves the sdpa model's logits alone; asking for scores or probs runs that layer's attention
    as the manual path does (transformers' eager arithmetic), the logits then those of the manual model."""
    ids = _ids(2)
    with torch.no_grad():
        plain = model(ids)
        with model.record(lambda n: not n.endswith(MANUAL_ATTENTION_POINTS)):
            assert torch.equal(model(ids), plain)
        with model.record([f"block.{i}.{point}" for i in range(model.config.n_layer)]):
            asked = model(ids)
        model.set_attn_impl("manual")
        assert torch.equal(asked, model(ids))


def test_patching_the_residual_stream_gives_the_other_runs_logits(model) -> None:  # noqa: ANN001
    """Activation patching: block 0's output of run A put into run B gives run A's logits, bit for bit (nothing after
    block 0 sees the tokens but through it); patched at one position only, only later positions change."""
    a, b = _ids(3, B=1), _ids(4, B=1)
    with torch.no_grad():
        with model.record("block.0") as clean:
            logits_a = model(a)
        logits_b = model(b)
        with model.edit({"block.0": lambda t: clean["block.0"]}):
            assert torch.equal(model(b), logits_a)

        def patch_pos_5(t: torch.Tensor) -> None:  # in place: the function returns None
            t[:, 5] = clean["block.0"][:, 5]

        with model.edit({"block.0": patch_pos_5}):
            patched = model(b)
    assert torch.equal(patched[:, :5], logits_b[:, :5])
    assert not torch.equal(patched[:, 5:], logits_b[:, 5:])


def test_records_see_the_edited_tensor_and_nest(model) -> None:  # noqa: ANN001
    ids = _ids(5)
    with torch.no_grad(), model.record(["block.0.mlp.act"]) as outer:
        with model.edit({"block.0.mlp.act": torch.zeros_like}), model.record(["block.0.mlp.act", "ln_f"]) as inner:
            model(ids)
        assert not bool(inner["block.0.mlp.act"].any()) and not bool(outer["block.0.mlp.act"].any())
        assert list(inner) == ["block.0.mlp.act", "ln_f"]
        model(ids)  # the edit is gone: the outer recorder sees the model's own act again
        assert bool(outer["block.0.mlp.act"].any())


def test_a_zeroed_head_is_the_model_without_it(model) -> None:  # noqa: ANN001
    """Head ablation through attn.probs: a head that attends nowhere adds only c_proj's bias, as a model whose
    c_proj ignores that head's slice does."""
    ids, h, hs = _ids(6), 1, model.config.head_dim

    def ablate(p: torch.Tensor) -> torch.Tensor:
        p = p.clone()
        p[:, h] = 0
        return p

    with torch.no_grad():
        with model.edit({"block.0.attn.probs": ablate}):
            edited = model(ids)
        model.set_attn_impl("manual")
        model.h[0].attn.c_proj.weight[:, h * hs : (h + 1) * hs] = 0  # (C, C) [out, in]: head h's input columns
        assert torch.allclose(edited, model(ids), rtol=0, atol=1e-5)


def test_activation_gradients_on_a_frozen_model(tiny_official: Path) -> None:
    """keep_graph=True on a model whose parameters need no gradient (as from_pretrained gives it): the graph starts
    at the embeddings, every recorded activation gets the gradient it gets in a model that trains, and no parameter
    gets one."""
    frozen, _ = from_pretrained(tiny_official)
    live, _ = from_pretrained(tiny_official)
    live.requires_grad_(True)
    names = ["embed", "block.0.attn.merged", "block.1", "ln_f", "logits"]
    grads = []
    for m in (frozen, live):
        with m.record(names, keep_graph=True) as acts:
            m(_ids(7))[:, -1].logsumexp(-1).sum().backward()
        grads.append({n: acts[n].grad for n in names})
    assert all(p.grad is None for p in frozen.parameters())
    for n in names:
        assert torch.allclose(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7), n


def test_bad_records_and_edits_are_one_line_errors(model) -> None:  # noqa: ANN001
    cases = [
        (lambda: model.record(["block.0", 3]), r"record: activation names are strings, got 3 \(int\)"),
        (lambda: model.record(lambda n: n == "block.9"), r"record: the predicate matches none of the \d+ activation"),
        (lambda: model.edit({"block.0.atn.q": torch.zeros_like}), r"edit: unknown activation name\(s\) 'block.0.at"),
        (lambda: model.edit({"block.0.": torch.zeros_like}), r"edit: 'block.0.' is a prefix"),
        (lambda: model.edit({"block.0": 0.0}), r"edit: 'block.0' maps to a float, expected a function"),
        (lambda: model.edit(["block.0"]), r"edit: expected a dict of activation name -> function"),
    ]
    for make, match in cases:
        with pytest.raises(UsageError, match=match):
            with make():
                pass
    ids = _ids(8)
    with pytest.raises(UsageError, match=r"edit 'ln_f': the function returned a torch.float32 tensor of shape \(2, 2"):
        with model.edit({"ln_f": lambda t: t[:, :2]}):
            model(ids)
    with pytest.raises(UsageError, match=r"edit 'ln_f': the function returned a int, expected a tensor or None"):
        with model.edit({"ln_f": lambda t: 0}):
            model(ids)


@pytest.mark.parametrize("how", ["hook", "edit"])
def test_generation_goes_through_hooks_and_edits_at_every_step(model, how: str) -> None:  # noqa: ANN001
    """With a module hook or an edit in place, the decode steps run the forward (the fast step, the static step and
    the fast greedy head would pass them by): the tokens are those of `fast_step=False`, and differ from the plain
    model's."""
    ids = _ids(9, B=1, T=4)
    plain = generate_full(model, ids, 16).sequences
    d = torch.randn(model.config.n_embd, generator=torch.Generator().manual_seed(0)) * 3.0
    if how == "hook":
        handle = model.h[0].register_forward_hook(lambda mod, args, out: out + d)
        try:
            steered = generate_full(model, ids, 16).sequences
            slow = generate_full(model, ids, 16, fast_step=False, fast_head=False).sequences
        finally:
            handle.remove()
    else:
        with model.edit({"block.0": lambda t: t + d}):
            steered = generate_full(model, ids, 16).sequences
            slow = generate_full(model, ids, 16, fast_step=False, fast_head=False).sequences
    assert torch.equal(steered, slow)
    assert not torch.equal(steered, plain)
    assert torch.equal(generate_full(model, ids, 16).sequences, plain)  # gone: the shortcuts are back


def test_malformed_masks_and_positions_are_one_line_errors(model) -> None:  # noqa: ANN001
    ids = _ids(10, B=2, T=4)
    cases = [
        ({"attention_mask": torch.ones(2, 5)}, r"attention_mask of shape \(2, 5\) does not fit input_ids \(2, 4\)"),
        ({"attention_mask": torch.ones(4)}, r"attention_mask of shape \(4,\) does not fit input_ids \(2, 4\)"),
        ({"attention_mask": torch.full((2, 4), 0.5)}, r"attention_mask holds 0.5: expected 1 for a token"),
        ({"position_ids": torch.tensor([[0, 1, 2, 2000]] * 2)}, r"position_ids: 2000 is out of range \(expected 0 <="),
        ({"position_ids": torch.arange(5)[None]}, r"position_ids of shape \(1, 5\) does not fit input_ids \(2, 4\)"),
        ({"position_ids": torch.arange(4.0)[None]}, r"position_ids must hold integer positions, got torch.float32"),
    ]
    for kw, match in cases:
        with pytest.raises(UsageError, match=match):
            model(ids, **kw)


def test_the_logits_tap_is_wherever_the_head_runs(model) -> None:  # noqa: ANN001
    """generate and eval call the head apart from the forward: an edit of the logits steers the tokens, and a record
    holds each step's (B, 1, V)."""
    ids = _ids(11, B=1, T=4)

    def force_7(t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, -1e9).index_fill_(-1, torch.tensor([7]), 0.0)

    with model.edit({"logits": force_7}), model.record(["logits"]) as acts:
        g = generate_full(model, ids, 5, eos_token_id=None)
    assert g.new_ids == [[7] * 5] and acts["logits"].shape == (1, 1, model.config.vocab_size)


def test_edits_run_once_a_forward_under_gradient_checkpointing(tiny_official: Path) -> None:
    """While anything records or edits, no block is recomputed: each edit runs once per forward, and a backward after
    the `with` has ended gets the gradients of the edited forward (a recomputation would have run without the edit)."""
    grads, calls = [], []
    for checkpointing in (False, True):
        m, _ = from_pretrained(tiny_official)
        m.train().set_dropout(0.0).requires_grad_(True)
        m.gradient_checkpointing = checkpointing
        ids = _ids(12)
        with m.edit({"block.0.mlp.pre": lambda t: (calls.append(1), t * 0.5)[1]}):
            loss = m(ids, labels=ids).loss
        loss.backward()
        grads.append(m.wte.weight.grad.clone())
    assert len(calls) == 2 and torch.equal(grads[0], grads[1])


def test_records_and_edits_may_end_in_any_order(model) -> None:  # noqa: ANN001
    """Each context removes its own hook: a record that ends first leaves the edit running, and nothing stays."""
    a, b = model.record(["ln_f"]), model.edit({"ln_f": torch.zeros_like})
    acts = a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    with torch.no_grad():
        assert not bool(model(_ids(13)).any())  # the edit is still in force: zero ln_f, zero logits (no head bias)
    b.__exit__(None, None, None)
    assert model.taps.rec is None and not model.intercepted() and list(acts) == []


def test_a_record_holds_one_forward_and_an_edit_broadcasts(model) -> None:  # noqa: ANN001
    """A second forward in the block replaces the first one's records (none of them is left behind); one clean run's
    (1, T, C) activation patches a batch of B."""
    with torch.no_grad():
        with model.record(["ln_f", "logits"]) as acts:
            model(_ids(14, B=1, T=3))
            model(_ids(15, B=1, T=5), hidden_only=True)
        assert list(acts) == ["ln_f"] and acts["ln_f"].shape[1] == 5
        with model.record("block.0") as clean:
            want = model(_ids(16, B=1))
        with model.edit({"block.0": lambda t: clean["block.0"]}):
            got = model(_ids(17, B=3))
    assert torch.equal(got, want.expand(3, -1, -1))
    with pytest.raises(UsageError, match=r"record: no activation names given"):
        with model.record([]):
            pass
