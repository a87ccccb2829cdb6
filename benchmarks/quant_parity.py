"""Parity of the low-precision options (int8, bfloat16, float16) against the float32 transformers reference.

For each option: norm-relative error at every block output (and embed, ln_f, logits), top-1 next-token agreement
and the largest log-prob difference, on the parity prompts. The reference is transformers' GPT2LMHeadModel in
float32 (eager attention), captured once; our model is loaded once per option.

    python -m benchmarks.quant_parity weights/bench/gpt2 --options int8,bfloat16,float16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from gpt2_port.generate.int8 import quantize_int8
from gpt2_port.io.checkpoint import locate
from gpt2_port.io.tokenizer import load_tokenizer
from gpt2_port.model import from_pretrained
from gpt2_port_checks.metrics import metrics, next_token
from gpt2_port_checks.points import block_points, capture_scratch
from gpt2_port_checks.prompts import DEFAULT_PROMPT_IDS, DEFAULT_PROMPTS
from gpt2_port_checks.reference import capture_reference, load_reference, reference_hooks

OPTION_DTYPES = {
    "int8": torch.float32,
    "int8-fast": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def load_option(ckpt: str, option: str) -> torch.nn.Module:
    model, _ = from_pretrained(ckpt, dtype=OPTION_DTYPES[option])
    if option.startswith("int8"):
        quantize_int8(model, exact_activations=option == "int8")
    return model


def quant_parity(ckpt: str, options: list[str], prompts: list[str] | None = None) -> dict:
    """{option: {points: {name: norm_rel}, worst_block_norm_rel, top1_agreement, logprob_max_abs, n_positions}}."""
    base, rep = from_pretrained(ckpt)  # config and tokenizer; freed before the options load
    cfg = rep.config
    if prompts:
        tok = load_tokenizer(rep.checkpoint.root if rep.checkpoint.tokenizer_files() else None)
        ids_list = [torch.tensor([tok.encode(p)]) for p in prompts]
    else:  # the parity defaults, stored as token ids: no tokenizer needed
        prompts = list(DEFAULT_PROMPTS)
        ids_list = [torch.tensor([ids]) for ids in DEFAULT_PROMPT_IDS]
    del base
    names = block_points(cfg.n_layer)
    ref = load_reference(locate(ckpt), cfg, torch.float32, torch.device("cpu"), "eager")
    hooks = reference_hooks(cfg.n_layer)
    want = [capture_reference(ref, ids, hooks) for ids in ids_list]
    del ref
    out: dict = {"prompts": prompts, "reference": "transformers GPT2LMHeadModel float32 eager", "options": {}}
    for opt in options:
        model = load_option(ckpt, opt)
        got = [capture_scratch(model, ids, names) for ids in ids_list]
        pts = {}
        for n in names:
            x = torch.cat([g[n].float().flatten() for g in got])
            y = torch.cat([w[n].float().flatten() for w in want])
            pts[n] = metrics(x, y)[1]
        gx = torch.cat([g["logits"][0] for g in got]).double()  # (N positions of all prompts, V)
        wy = torch.cat([w["logits"][0] for w in want]).double()
        nt = next_token(gx, wy, cfg.vocab_size)
        same = gx.argmax(-1) == wy.argmax(-1)
        top2 = wy.topk(2, dim=-1).values  # (N, 2): how close the reference's own top two were, where we differ
        margins = (top2[:, 0] - top2[:, 1])[~same].tolist()
        out["options"][opt] = {
            "points": pts,
            "worst_block_norm_rel": max(v for k, v in pts.items() if k.startswith("block.")),
            "logits_norm_rel": pts["logits"],
            "top1_agreement": nt.top1_agreement,
            "n_positions": nt.n_positions,
            "logprob_max_abs": nt.logprob_max_abs,
            "disagreement_ref_margins": margins,  # reference top-1 minus top-2 logit at each disagreement
            "ref_median_margin": float(
                torch.cat([(w["logits"][0].topk(2, -1).values.double().diff(dim=-1).abs()) for w in want]).median()
            ),
        }
        del model, got
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quant_parity")
    p.add_argument("ckpt")
    p.add_argument("--options", default="int8,int8-fast,bfloat16,float16")
    p.add_argument("--prompt", action="append", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    res = quant_parity(a.ckpt, [o for o in a.options.split(",") if o], a.prompt)
    text = json.dumps(res, indent=2)
    if a.json:
        from gpt2_port.files import atomic_write_text

        atomic_write_text(a.json, text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
