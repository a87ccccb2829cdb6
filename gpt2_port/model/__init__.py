"""The model: its modules, the loss, the kernels (reference and fast), taps, masks, init, the decode step, and GPT2."""

from .gpt2 import GPT2, CausalLMOutput, from_pretrained

__all__ = ["GPT2", "CausalLMOutput", "from_pretrained"]
