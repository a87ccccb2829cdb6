"""gpt2_port: a from-scratch GPT-2 that loads the official weights and proves it matches transformers."""

from .config import PRESETS, GPT2Config
from .errors import CheckpointError, ConfigError, GPT2PortError, HubError, UsageError
from .generate.cache import KVCache
from .model import GPT2

__version__ = "0.1.0"
__all__ = [
    "GPT2",
    "GPT2Config",
    "KVCache",
    "PRESETS",
    "GPT2PortError",
    "CheckpointError",
    "ConfigError",
    "HubError",
    "UsageError",
    "__version__",
]
