"""GPT-2's initialisation for training from scratch, by parameter name (scratch or checkpoint names alike).

transformers' `GPT2PreTrainedModel._init_weights`, nanoGPT and llm.c agree: Linear (Conv1D) and Embedding weights
N(0, initializer_range), biases 0, LayerNorm weight 1 and bias 0, and every residual projection `c_proj.weight`
N(0, initializer_range / sqrt(2 * n_layer)) (the std rule is `GPT2Config.init_std`, shared with the random demo
checkpoints).
"""

from __future__ import annotations

import torch

from ..config import GPT2Config

_LN_WEIGHTS = ("ln_1.weight", "ln_2.weight", "ln_f.weight")


def init_tensor_(name: str, t: torch.Tensor, cfg: GPT2Config, generator: torch.Generator | None = None) -> None:
    """Fill `t` in place with the initial value of parameter `name`."""
    with torch.no_grad():
        if name.endswith(_LN_WEIGHTS):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, cfg.init_std(name), generator=generator)
