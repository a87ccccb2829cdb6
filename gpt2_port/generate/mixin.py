"""`model.generate(...)`, transformers' spelling, for any model that fits protocol.py."""

from __future__ import annotations

import torch

from .loop import generate


class GenerationMixin:
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **options: object) -> torch.Tensor:
        """LongTensor (B, T + new) as transformers' generate returns; the options: gpt2_port.generate.generate_full."""
        return generate(self, input_ids, max_new_tokens, **options)  # type: ignore[arg-type]
