"""GPT-2's initialisation for training from scratch, by parameter name (scratch or checkpoint names alike).

transformers' `GPT2PreTrainedModel._init_weights`, nanoGPT and llm.c agree: Linear (Conv1D) and Embedding weights
N(0, initializer_range), biases 0, LayerNorm weight 1 and bias 0, and every residual projection `c_proj.weight`
N(0, initializer_range / sqrt(2 * n_layer)). The GPT-2 paper: "A modified initialization which accounts for the
accumulation on the residual path with model depth is used. We scale the weights of residual layers at
initialization by a factor of 1/sqrt(N) where N is the number of residual layers" (two per block).
"""

from __future__ import annotations

import math

import torch

from .config import GPT2Config

_LN_WEIGHTS = ("ln_1.weight", "ln_2.weight", "ln_f.weight")


def weight_std(name: str, cfg: GPT2Config) -> float:
    """The std of the normal init of a matrix or embedding `name`: scaled down for the residual projections."""
    if name.endswith("c_proj.weight"):
        return cfg.initializer_range / math.sqrt(2 * cfg.n_layer)
    return cfg.initializer_range


def init_tensor_(name: str, t: torch.Tensor, cfg: GPT2Config, generator: torch.Generator | None = None) -> None:
    """Fill `t` in place with the initial value of parameter `name`."""
    with torch.no_grad():
        if name.endswith(_LN_WEIGHTS):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, weight_std(name, cfg), generator=generator)
