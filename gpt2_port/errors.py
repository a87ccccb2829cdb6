"""The project's own exception types: the only exceptions library code raises on purpose.

Every message is one line that names the culprit (a file, a tensor key, a config key, an argument or a value) and
says what was expected, e.g.::

    CheckpointError: ckpt/model.safetensors: header length 4096 runs past the end of the 812-byte file (truncated?)
    ConfigError: ckpt/config.json: n_layer=24 contradicts the weights, which hold 12 layers (h.0 to h.11)
    UsageError: --top-p must be in (0, 1] (1: no top-p), got 1.5
    HubError: openai-community/gpt2: not in the local Hugging Face cache and HF_HUB_OFFLINE is set: ...

The CLI (`gpt2_port.cli.main`) prints `gpt2-port COMMAND: error: MESSAGE` on stderr and exits 2 for any of them,
with no traceback, and leaves no partial output file (outputs are written atomically, after an early writability
check). Any other exception escaping is a bug: the CLI prints one line with a hint to report it and exits 3
(`GPT2_PORT_DEBUG=1` shows the traceback). Exit 1 is reserved for a check that ran and failed (parity).

Catch `GPT2PortError` to handle all of them; the subclasses say whose fault it is.
"""

from __future__ import annotations


class GPT2PortError(Exception):
    """Base class of every error this project raises on purpose (bad input, bad files, bad arguments).

    Loading an untrusted file either succeeds or raises a subclass of this; the fuzzer (scripts/fuzz_safetensors.py,
    tests/test_fuzz.py) checks that no other exception, crash, hang or runaway allocation comes out of the loader.
    """


class CheckpointError(GPT2PortError):
    """A weight file or checkpoint directory is missing, unreadable, corrupt, or not GPT-2.

    Raised for: a path that does not exist, a broken symlink or a symlink loop; a directory with no weights; an empty,
    truncated or padded safetensors file; a header length past the end of the file or over 100 MB; a header that is
    not UTF-8 JSON, names a tensor twice, or has entries without exactly dtype/shape/data_offsets; an unsupported
    dtype; a shape that does not match its byte count or could not exist; data_offsets out of range, overlapping or
    leaving holes; a shard index that is malformed or names a missing shard; a tensor in two shards; a `.bin` that is
    not a PyTorch checkpoint, or whose pickle holds more than tensors (it is never unpickled beyond plain tensors:
    `torch.load(weights_only=True)`); a missing, unexpected or wrongly shaped tensor; a non-float weight; a mask buffer
    `h.{i}.attn.bias` that is not a causal mask; NaN/Inf in the weights when asked to check (`inspect --check-finite`).
    """


class ConfigError(GPT2PortError):
    """A config (config.json or arguments) is malformed, unsupported, or contradicts the tensors.

    Raised for: config.json that is not valid JSON or not an object; a missing key or a value of the wrong type or
    range (the message names the key); a model_type other than gpt2 or a setting this port does not implement;
    n_ctx contradicting n_positions; n_layer, n_embd, vocab_size or n_positions contradicting the tensors; no
    config.json and tensors a config cannot be inferred from; an untied lm_head where the config says tied.
    """


class UsageError(GPT2PortError):
    """A bad argument or value given by the caller (prompt, dtype, device, sampling option, path).

    Raised for: an empty prompt, or one as long as the context or longer; token ids outside the vocabulary;
    zero/negative --max-new-tokens or --num-samples; temperature <= 0 when sampling; top-p outside (0, 1]; a negative
    top-k; an unknown dtype or device, or cuda/mps asked for where there is none; an output path (--json, --out) that
    cannot be written; --revision given for a local path.
    """


class DeviceMemoryError(GPT2PortError):
    """The device ran out of memory while the command worked (torch's OutOfMemoryError, or an error raised from one):
    the message names the request torch could not serve and the step it was in; the CLI adds what to change for that
    command (a smaller batch, fewer rows, ...). Not a bug: the inputs asked for more than the device has."""


class HubError(GPT2PortError):
    """The Hugging Face Hub could not provide the model (offline with no cache, unknown id, failed download).

    Raised for: HF_HUB_OFFLINE set and the model not in the cache (the message says to unset it once, or to pass a
    local directory); the Hub unreachable and nothing cached; an unknown (or private/gated) model id; an unknown
    revision; an interrupted or inconsistent download (huggingface_hub downloads to a temporary `.incomplete` file and
    only renames it into the cache once complete and of the announced size, so no partial file is ever cached).
    """
