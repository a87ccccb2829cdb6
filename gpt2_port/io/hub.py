"""The Hugging Face Hub: the official ids, the files the port needs, and downloads into the shared HF cache.

huggingface_hub does the downloading (to a temporary `.incomplete` file, renamed into the cache only once complete),
with its own timeouts (HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT); this module maps its exceptions to HubError
messages that say what to do, and name the cache directory searched.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path

from ..errors import HubError

log = logging.getLogger(__name__)

HUB_ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
# The names a "did you mean" offers: the short aliases and the repos they stand for; "gpt2-small", the name the
# papers give the 124M model, is matched too and offered as the id that holds it.
OFFICIAL_IDS = [*HUB_ALIASES, *HUB_ALIASES.values(), "gpt2-small", "openai-community/gpt2-small"]
_MEANT = {"gpt2-small": "gpt2", "openai-community/gpt2-small": "openai-community/gpt2"}
# Only what the port needs; the gpt2 repos also hold TF, Flax, ONNX, rust and tflite weights (several GB).
HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
]
HUB_PATTERNS_BIN = ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*-of-*.bin"]


def looks_like_hub_id(s: str) -> bool:
    """An alias (gpt2, gpt2-xl...) or `owner/name`, with nothing that makes it a path."""
    if s in HUB_ALIASES:
        return True
    parts = s.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not s.startswith((".", "/", "~"))
        and not s.endswith((".safetensors", ".bin"))
    )


def did_you_mean(word: str, candidates: list[str]) -> str:
    """ "; did you mean X?" naming the closest candidates (those about as close as the best one), or ""."""
    scored = []
    for c in set(candidates):
        m = difflib.SequenceMatcher(None, word, c)
        if m.real_quick_ratio() >= 0.6 and m.quick_ratio() >= 0.6 and m.ratio() >= 0.6:
            scored.append((m.ratio(), c))
    if not scored:
        return ""
    best = max(r for r, _ in scored)
    close = [_MEANT.get(c, c) for r, c in sorted(scored, key=lambda rc: (-rc[0], rc[1])) if r >= best - 0.05]
    close = list(dict.fromkeys(close))[:3]
    return f"; did you mean {' or '.join(close)}?"


def is_offline() -> bool:
    """HF_HUB_OFFLINE set (in the environment, or as huggingface_hub read it at import)."""
    from huggingface_hub import constants as hf_constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(getattr(hf_constants, "HF_HUB_OFFLINE", False))


def cache_dir() -> str:
    """The hub cache huggingface_hub searches and fills (HF_HUB_CACHE, by default $HF_HOME/hub)."""
    from huggingface_hub import constants as hf_constants

    return str(hf_constants.HF_HUB_CACHE)


def download(model_id: str, revision: str | None, patterns: list[str]) -> Path:
    """The snapshot directory of `model_id` (an alias or owner/name) holding the files matching `patterns`.

    Served from the cache when it holds them; HubError with what to do otherwise.
    """
    import huggingface_hub as hf
    from huggingface_hub import errors as hf_errors

    repo = HUB_ALIASES.get(model_id, model_id)
    where = f"{repo}" + (f"@{revision}" if revision else "")
    cache = cache_dir()
    try:
        log.info("resolving %s through the Hugging Face cache (%s)", where, cache)
        return Path(hf.snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except hf_errors.RepositoryNotFoundError:
        raise HubError(
            f"{model_id}: no such model on the Hugging Face Hub (or it is private/gated: run `hf auth login`)"
            f"{did_you_mean(model_id, OFFICIAL_IDS)}"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise HubError(f"{model_id}: revision {revision!r} not found on the Hub") from None
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled) as e:
        if is_offline():
            raise HubError(
                f"{where}: not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set: run once with "
                f"network access (unset HF_HUB_OFFLINE) to download it, or pass a local directory"
            ) from None
        raise HubError(
            f"{where}: cannot reach the Hugging Face Hub and it is not cached locally in {cache} "
            f"({first_line(e)}): connect to the network once, or pass a local checkpoint directory"
        ) from None
    except hf_errors.HfHubHTTPError as e:
        raise HubError(f"{where}: download failed ({first_line(e)})") from None
    except (OSError, ValueError) as e:
        raise HubError(f"{where}: download failed ({e.__class__.__name__}: {first_line(e)})") from None


def first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else e.__class__.__name__
