"""What generation asks of a model. generate/ is written against this interface (as transformers' GenerationMixin
is written against its models), so the model can offer `generate` as a method without generate/ importing it."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ..config import GPT2Config


class CausalLM(Protocol):
    config: GPT2Config
    lm_head: nn.Module | None
    training: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def head_weight(self) -> torch.Tensor: ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        last_only: bool = False,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        """(B, T) ids -> (B, T|1, C) final hidden states with hidden_only (the cache filled)."""
        ...

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """(..., C) final hidden states -> (..., V) logits."""
        ...

    def decode_plan(self) -> Any:
        """The one-token step without module dispatch (model/decode.py's DecodePlan), or None where the forward must
        run (train mode, gradients wanted, activations recorded, edited or hooked, the manual attention)."""
        ...

    def intercepted(self) -> bool:
        """True while a record, an edit or a module's forward hook may read or change an activation: no shortcut
        that passes the modules by then."""
        ...

    def wants_grad(self) -> bool:
        """True in train mode or when a gradient is wanted: no inference shortcuts then."""
        ...

    def named_parameters(self) -> Any: ...

    def named_buffers(self) -> Any: ...
