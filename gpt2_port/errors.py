"""The project's own exception types.

Library code raises these; the CLI turns them into one-line messages and exit code 2.
Anything else that escapes is an internal error (exit 3, with a hint to report it).
"""

from __future__ import annotations


class GPT2PortError(Exception):
    """Base class of every error this project raises on purpose (bad input, bad files, bad arguments)."""


class CheckpointError(GPT2PortError):
    """A weight file or checkpoint directory is missing, unreadable, corrupt, or not GPT-2."""


class ConfigError(GPT2PortError):
    """A config (config.json or arguments) is malformed, unsupported, or contradicts the tensors."""


class UsageError(GPT2PortError):
    """A bad argument or value given by the caller (prompt, dtype, device, sampling option, path)."""


class HubError(GPT2PortError):
    """The Hugging Face Hub could not provide the model (offline with no cache, unknown id, failed download)."""
