"""Where a Hugging Face model directory comes from, and the architecture its config.json states.

`resolve_model_dir(spec)` takes a local directory as it is, or a Hub repo id (`Qwen/Qwen3-0.6B`)
through `huggingface_hub.snapshot_download` into the Hugging Face cache (`HF_HUB_CACHE`, else
`HF_HOME/hub`); with `HF_HUB_OFFLINE=1` only the cache is read, and a repo that is not there is
a one-line error. `checkpoint_config` reads its config.json and checks a preset and explicit
model fields against it. Both read the environment at call time (huggingface_hub reads its own
constants once, at import). Not here: the tensors (`hf_import`), the tokenizer files
(`rollout.tokenizers.load_tokenizer` resolves a Hub id through this module too).
"""

from __future__ import annotations

import os
from typing import Any

from dvp_jax.errors import ConfigError
from dvp_jax.model.config import ModelConfig, check_matches_checkpoint

# What a run reads from a model repo: its config, weights and tokenizer (not *.bin, *.pth or
# GGUF copies of the same weights).
HUB_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def hub_cache_dir() -> str:
    """The Hugging Face cache as huggingface_hub would pick it from the environment now."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return constants.HF_HUB_CACHE


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is set now, or was at import."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or flag.strip().upper() in ("1", "ON", "YES", "TRUE")


def is_repo_id(spec: str) -> bool:
    """`org/name` with the Hub's allowed characters (a path-like string is not one)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if spec.count("/") != 1 or spec.startswith((".", "~")) or os.path.exists(spec):
        return False
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def resolve_model_dir(spec: str, field: str = "config.model.hf_path") -> str:
    """A local model directory for `spec`: a directory as given, or a Hub repo id's snapshot.

    Raises:
      ConfigError: one line naming `field` and `spec`: no such directory, or a repo id that is
        not in the cache with `HF_HUB_OFFLINE=1`, or one the Hub does not serve.
    """
    spec = os.fspath(spec)
    if os.path.isdir(os.path.expanduser(spec)):
        return os.path.expanduser(spec)
    if not is_repo_id(spec):
        raise ConfigError(
            f"{field}={spec!r} is neither a local Hugging Face model directory nor a Hub repo "
            "id ('org/name', e.g. 'Qwen/Qwen3-0.6B')"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub import utils as errors  # (also where huggingface_hub 0.23 has them)

    cache, offline = hub_cache_dir(), hub_offline()
    try:
        return snapshot_download(
            spec, cache_dir=cache, local_files_only=offline, allow_patterns=list(HUB_FILES)
        )
    except errors.LocalEntryNotFoundError as e:
        if offline:
            reason = "HF_HUB_OFFLINE=1: nothing is downloaded"
        else:
            reason = f"the Hub could not be reached: {type(e.__cause__ or e).__name__}"
        raise ConfigError(
            f"{field}={spec!r}: no such local directory, and that Hub repo is not in the Hugging "
            f"Face cache {cache} ({reason}); download it where the network is reachable (`hf "
            f"download {spec}`, HF_HUB_CACHE or HF_HOME naming this cache) or pass a directory"
        ) from e
    except errors.RepositoryNotFoundError as e:  # also GatedRepoError
        raise ConfigError(
            f"{field}={spec!r}: no such local directory, and the Hub has no such model repo, or "
            f"it is gated or private (log in with `hf auth login`): {type(e).__name__}"
        ) from e
    except errors.HfHubHTTPError as e:
        raise ConfigError(f"{field}={spec!r}: {' '.join(str(e).split())}") from e


def checkpoint_config(
    directory: str, preset: str | None = None, given: dict[str, Any] | None = None
) -> ModelConfig:
    """The architecture of `directory/config.json`, with `preset` and `given` checked against it
    (`model.config.check_matches_checkpoint`); `given`'s fields are not applied here.

    Raises:
      ConfigError: one line: no config.json, another architecture, or a disagreeing field.
    """
    from dvp_jax.model.hf_import import load_hf_config

    try:
        found = load_hf_config(directory)
    except (OSError, ValueError) as e:  # no or unreadable config.json, another architecture
        raise ConfigError(f"config.model.hf_path={directory!r}: {' '.join(str(e).split())}") from e
    try:
        check_matches_checkpoint(found, os.path.join(directory, "config.json"), preset, given)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return found
