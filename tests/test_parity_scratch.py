"""`parity --scratch MODULE:FUNCTION`: a porter's own change to the model, checked against transformers by the same
report: caught, placed at the sub-layer it is in, judged against the noise, forward and backward."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gpt2_port.cli import main

pytest.importorskip("transformers")
pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

CHANGES = '''
import types

import torch
import torch.nn.functional as F


def nothing(model):
    return None


def erf_gelu_in_block_1(model):
    """A porting bug: the erf GELU in block 1's MLP, its tensors still passed through the taps."""
    mlp = model.h[1].mlp

    def forward(self, x):
        rec = self.taps.rec
        h = self.c_fc(x)
        if rec is not None:
            h = rec(self.tag + ".pre", h)
        h = F.gelu(h)
        if rec is not None:
            h = rec(self.tag + ".act", h)
        y = self.c_proj(h)
        if rec is not None:
            y = rec(self.tag + ".c_proj", y)
        return self.dropout(y)

    mlp.forward = types.MethodType(forward, mlp)


def fused_mlp_without_taps(model):
    mlp = model.h[0].mlp
    mlp.forward = types.MethodType(lambda self, x: self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")), mlp)


def detached_attention_in_block_0(model):
    attn = model.h[0].attn
    inner = attn.forward
    attn.forward = lambda *a, **k: inner(*a, **k).detach()


def handwritten_ln_1_in_block_0(model):
    """The same LayerNorm, written out: rounded otherwise, before the first attention, where the floor is 0."""
    ln = model.h[0].ln_1

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) * torch.rsqrt(var + self.eps) * self.weight + self.bias

    ln.forward = types.MethodType(forward, ln)


def same_in_a_subclass(model):
    """A subclass in place (its methods the porter's to override): the checkpoint's layout kept, nothing else."""
    model.__class__ = type("Mine", (type(model),), {})


def to_bf16(model):
    model.to(torch.bfloat16)


def raising_forward_in_block_0(model):
    def boom(*a, **k):
        raise ValueError("my kernel\\nhas a bug")

    model.h[0].mlp.forward = boom


def not_a_model(model):
    return torch.nn.Linear(2, 2)


def _wrap_forward(model, change):
    inner = model.forward
    model.forward = lambda input_ids, attention_mask=None, position_ids=None, **kw: inner(
        input_ids, **change(input_ids, attention_mask, position_ids), **kw
    )


def positions_that_ignore_the_mask(model):
    """The classic padded-batch bug: positions 0..T-1 in every row, padding counted."""
    _wrap_forward(model, lambda ids, mask, pos: {"attention_mask": mask, "position_ids": pos if mask is None else
                  torch.arange(ids.shape[1], device=ids.device)[None]})


def padding_that_is_attended(model):
    """Positions from the mask, but the mask not given to attention: the padding is attended."""
    _wrap_forward(model, lambda ids, mask, pos: {"attention_mask": None, "position_ids": pos if mask is None else
                  (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]})


def cache_forgets_the_first_key(model):
    """A decode-step bug no forward meets: each cached step attends with the first cached key and value zeroed."""
    make = model.decode_plan

    def plan():
        p = make()
        if p is not None:
            step = p.step

            def forgetful(ids, cache, mask=None):
                for k, v in zip(cache.k, cache.v):
                    k[:, :, 0].zero_()
                    v[:, :, 0].zero_()
                return step(ids, cache, mask)

            p.step = forgetful
        return p

    model.decode_plan = plan


def cache_that_zeroes_the_first_key(model):
    """A KV cache bug: the forward, given a cache, attends with the first cached key zeroed (prefill and steps)."""
    inner = model.forward

    def forward(*args, cache=None, **kw):
        if cache is not None and not hasattr(cache, "planted"):
            update = cache.update

            def zeroing(layer, k, v):
                keys, values = update(layer, k, v)
                keys = keys.clone()
                keys[:, :, 0] = 0
                return keys, values

            cache.update, cache.planted = zeroing, True
        return inner(*args, cache=cache, **kw)

    model.forward = forward


def positions_clamped_at_40(model):
    """A position table cut short: wrong only past position 40, which no prompt reaches."""
    wpe = model.wpe
    wpe.forward = types.MethodType(lambda self, p: F.embedding(p.clamp(max=40), self.weight), wpe)
'''


@pytest.fixture()
def changes(tmp_path: Path) -> Path:
    (tmp_path / "changes.py").write_text(CHANGES)
    return tmp_path / "changes.py"


def _parity(tiny_official: Path, tmp_path: Path, capsys, *extra: str) -> tuple[int, dict, str]:  # noqa: ANN001
    (tmp_path / "r.json").unlink(missing_ok=True)
    rc = main(["parity", str(tiny_official), *extra, "--json", str(tmp_path / "r.json")])
    said = capsys.readouterr()
    report = json.loads((tmp_path / "r.json").read_text()) if (tmp_path / "r.json").is_file() else {}
    return rc, report, said.out + said.err


def test_a_planted_bug_is_found_at_its_sub_layer(tiny_official: Path, tmp_path: Path, changes: Path, capsys) -> None:
    rc, r, _ = _parity(tiny_official, tmp_path, capsys, "--scratch", f"{changes}:nothing")
    assert rc == 0 and r["passed"] is True
    rc, r, _ = _parity(
        tiny_official, tmp_path, capsys, "--detail", "sublayer", "--scratch", f"{changes}:erf_gelu_in_block_1"
    )
    assert rc == 1 and r["first_failure"] == "block.1.mlp.act" and r["first_above_noise"] == "block.1.mlp.act"
    pts = {p["name"]: p for p in r["points"]}
    assert pts["block.1.mlp.pre"]["norm_rel"] == 0.0 and pts["block.0"]["norm_rel"] == 0.0


@pytest.mark.parametrize(
    ("change", "first"),
    [
        ("positions_that_ignore_the_mask", "batch.embed"),
        ("padding_that_is_attended", "batch.block.0"),
        ("positions_clamped_at_40", "batch.embed"),
    ],
)
def test_a_bug_of_padded_batches_or_long_inputs_is_found_in_the_batch(
    tiny_official: Path, tmp_path: Path, changes: Path, capsys, change: str, first: str
) -> None:
    """Each prompt alone runs unpadded and short, where these bugs change nothing; the padded batch with its long row
    (left padding, an attention mask, positions up to the context) finds each at the point it is in."""
    rc, r, _ = _parity(tiny_official, tmp_path, capsys, "--scratch", f"{changes}:{change}")
    assert rc == 1 and r["first_failure"] == first
    pts = {p["name"]: p for p in r["points"]}
    assert all(p["norm_rel"] == 0.0 for n, p in pts.items() if not n.startswith(("batch.", "decode.")))
    assert len(r["batch_ids"]) == 4 and len(r["batch_ids"][0]) == 127  # the long row: the context (128) less one
    assert [sum(m) for m in r["batch_mask"]] == [5, 4, 3, 127]


def test_a_bug_of_the_cached_decoding_is_found_there_alone(
    tiny_official: Path, tmp_path: Path, changes: Path, capsys
) -> None:
    """generate's cached path (the decode plan here), fed the same tokens as transformers with its cache: a step
    that loses a cached key fails decode.logits while every forward point stays 0."""
    rc, r, out = _parity(tiny_official, tmp_path, capsys)
    assert rc == 0 and r["decode_path"] == "plan" and r["decode_prompt_len"] == 5
    assert [len(x) for x in r["decode_ids"]] == [21, 21, 21]  # 5 prompt tokens, 16 fed
    assert [row[:2] for row in r["decode_ids"]][1:] == [[0, 464], [0, 0]]  # prompts cut by 1 and 2: left-padded
    assert "decode.logits   3 rows, a prefill of 5 tokens, 16 decode steps (plan steps)" in out
    rc, r, _ = _parity(tiny_official, tmp_path, capsys, "--scratch", f"{changes}:cache_forgets_the_first_key")
    assert rc == 1 and r["first_failure"] == "decode.logits"
    pts = {p["name"]: p for p in r["points"]}
    assert all(p["norm_rel"] == 0.0 for n, p in pts.items() if not n.startswith("decode."))
    assert pts["decode.forward_steps.logits"]["passed"]  # generate's other cached path: the forward's, unchanged
    rc, r, _ = _parity(tiny_official, tmp_path, capsys, "--scratch", f"{changes}:cache_that_zeroes_the_first_key")
    pts = {p["name"]: p for p in r["points"]}
    assert rc == 1 and r["first_failure"] == "decode.logits" and not pts["decode.forward_steps.logits"]["passed"]
    assert all(p["norm_rel"] == 0.0 for n, p in pts.items() if not n.startswith("decode."))  # no cache there


def test_a_module_on_the_path_and_a_file_of_any_python_work(
    tiny_official: Path, tmp_path: Path, changes: Path, capsys, monkeypatch
) -> None:  # noqa: ANN001
    """MODULE:FUNCTION through an ordinary import (here PYTHONPATH's folder); FILE.py runs as a module of its own (a
    dataclass in it needs its module registered); a subclass in place keeps every bit; the JSON names the change."""
    (tmp_path / "porter_change_mod.py").write_text(CHANGES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "porter_change_mod", raising=False)
    rc, r, _ = _parity(tiny_official, tmp_path, capsys, "--scratch", "porter_change_mod:erf_gelu_in_block_1")
    assert rc == 1 and r["first_failure"] == "block.1" and r["scratch"] == "porter_change_mod:erf_gelu_in_block_1"
    sys.modules.pop("porter_change_mod", None)
    dc = tmp_path / "dc.py"
    dc.write_text(
        "from __future__ import annotations\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass Cfg:\n"
        "    scale: float = 1.0\n\n\ndef patch(model):\n    return None\n"
    )
    rc, r, _ = _parity(tiny_official, tmp_path, capsys, "--scratch", f"{dc}:patch")
    assert rc == 0
    rc, r, out = _parity(tiny_official, tmp_path, capsys, "--scratch", f"{changes}:same_in_a_subclass")
    plain = _parity(tiny_official, tmp_path, capsys)[1]
    assert rc == 0 and [p["norm_rel"] for p in r["points"]] == [p["norm_rel"] for p in plain["points"]]
    assert all(p["norm_rel"] == 0.0 for p in r["points"] if not p["name"].startswith("decode."))


def test_train_steps_run_with_a_detached_branch(tiny_official: Path, tmp_path: Path, changes: Path, capsys) -> None:
    """AdamW steps too: the cut parameters' gradients count as zeros in the clip norm; the report fails, no crash."""
    rc, r, _ = _parity(
        tiny_official, tmp_path, capsys, "--train-steps", "2", "--scratch", f"{changes}:detached_attention_in_block_0"
    )
    assert rc == 1 and r["passed"] is False and len(r["steps"]) == 2


def test_the_backward_reports_a_detached_branch(
    tiny_official: Path, tmp_path: Path, changes: Path, capsys, caplog
) -> None:  # noqa: ANN001
    """Gradients that never reach block 0's attention (a detach) are compared as zeros: a FAIL there, with a warning
    naming them, not an internal error."""
    rc, r, _ = _parity(
        tiny_official, tmp_path, capsys, "--backward", "--scratch", f"{changes}:detached_attention_in_block_0"
    )
    assert rc == 1 and r["passed"] is False and r["first_diverging_layer"] == "h.0"
    assert r["first_failure"].startswith("grad.transformer.h.0.attn.c_proj.")  # backprop order: where it enters
    assert "no gradient reached h.0.ln_1.weight" in caplog.text and "compared as zeros" in caplog.text


def test_the_backward_names_a_forward_bug_as_one(tiny_official: Path, tmp_path: Path, changes: Path, capsys) -> None:
    """The erf GELU in block 1 spoils the loss and every gradient, first seen (in backprop order) far from block 1:
    the forward's own activations, compared too, place it in the forward at block 1."""
    rc, r, out = _parity(tiny_official, tmp_path, capsys, "--backward", "--scratch", f"{changes}:erf_gelu_in_block_1")
    assert rc == 1 and r["first_failure"] == "act.block.1" and r["first_diverging_layer"] == "h.1 (in the forward)"
    pts = {p["name"]: p for p in r["points"]}
    assert pts["act.block.0"]["norm_rel"] == 0.0 and pts["act.embed"]["passed"]
    assert "first diverging layer h.1 (in the forward)" in out
    rc, r, _ = _parity(tiny_official, tmp_path, capsys, "--backward")
    assert rc == 0 and all(p["norm_rel"] == 0.0 for p in r["points"] if p["name"].startswith("act."))


def test_fail_above_noise_makes_a_passing_figure_above_the_floor_fail(
    tiny_official: Path, tmp_path: Path, changes: Path, capsys
) -> None:  # noqa: ANN001
    """A LayerNorm written out passes its tolerances, but rounds otherwise where transformers is exact against itself:
    exit 0 by default, 1 with --fail-above-noise (for CI), and the JSON says which."""
    spec = f"{changes}:handwritten_ln_1_in_block_0"
    rc, r, _ = _parity(tiny_official, tmp_path, capsys, "--detail", "sublayer", "--scratch", spec)
    assert rc == 0 and r["passed"] is True and r["as_close_as_reference"] is False
    assert r["first_above_noise"] == "block.0.ln_1"
    rc, r, out = _parity(
        tiny_official, tmp_path, capsys, "--detail", "sublayer", "--scratch", spec, "--fail-above-noise"
    )
    assert rc == 1 and r["passed"] is True
    assert "FAIL (--fail-above-noise): in float32/cpu block.0.ln_1 lies above the reference's own noise" in out
    rc, _, err = _parity(tiny_official, tmp_path, capsys, "--fail-above-noise", "--no-noise-floor")
    assert rc == 2 and "not with --no-noise-floor" in err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "expected MODULE:FUNCTION or FILE.py:FUNCTION"),
        ("{dir}/missing.py:f", "no file"),
        ("no_such_module_here:f", "no module 'no_such_module_here'"),
        ("{changes}:nope", "has no function 'nope'"),
        ("{changes}:not_a_model", "the scratch transform returned a Linear: expected a GPT2"),
        ("{changes}:to_bf16", "the scratch transform left a model in torch.bfloat16 on cpu: this configuration runs"),
        ("{changes}:raising_forward_in_block_0", "with --scratch"),
        ("{changes}:fused_mlp_without_taps", "the scratch model recorded no 'block.0.mlp.pre'"),
    ],
)
def test_bad_scratch_options_are_one_line_errors(
    tiny_official: Path, tmp_path: Path, changes: Path, capsys, spec: str, message: str
) -> None:
    spec = spec.format(dir=tmp_path, changes=changes)
    rc, _, err = _parity(tiny_official, tmp_path, capsys, "--detail", "sublayer", "--scratch", spec)
    assert rc == 2 and message in err and err.count("\n") == 1, err


def test_the_readme_example_change_runs_as_written(tiny_official: Path, tmp_path: Path, capsys) -> None:
    """The README's my_change.py, as written: a planted erf GELU, found at block.1.mlp.act."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("### Checking your own change", 1)[1].split("\n### ", 1)[0]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my_change.py").write_text(code)
    rc, r, out = _parity(
        tiny_official, tmp_path, capsys, "--detail", "sublayer", "--scratch", f"{tmp_path}/my_change.py:patch"
    )
    assert rc == 1 and r["first_failure"] == "block.1.mlp.act", out
