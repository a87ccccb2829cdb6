"""Generation: sampling, stopping and streaming, the decode loop, CUDA-graph replay, int8 decode on the CPU.

Written against the model's interface (protocol.py), never importing the model, so `GPT2.generate` (mixin.py) calls
into it without an import circle."""

from .loop import Generation, generate, generate_full
from .sampling import SamplingSettings

__all__ = ["Generation", "SamplingSettings", "generate", "generate_full"]
