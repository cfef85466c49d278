"""Reading a Triton model config's `parameters` block, shared by the adapters.

Owns: string parameters (rejecting template placeholders left unfilled), booleans,
and loading the Hugging Face tokenizer named by `tokenizer_dir` with one clear
`ConfigError`. Never imports Triton: the adapters pass `json.loads(args["model_config"])`.
"""
from __future__ import annotations

import os

from .errors import ConfigError

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def string_params(config: dict) -> dict[str, str]:
    """All parameters as {key: string_value}."""
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def param(config: dict, key: str, default: str = "") -> str:
    value = string_params(config).get(key, default)
    if "${" in value:
        raise ConfigError(f"parameter {key!r} still holds a template placeholder {value!r}; "
                          f"fill it with tools/fill_template.py")
    return value


def flag(config: dict, key: str, default: bool) -> bool:
    value = param(config, key, "").strip().lower()
    if value == "":
        return default
    if value not in _TRUE + _FALSE:
        raise ConfigError(f"parameter {key!r} must be true or false, got {value!r}")
    return value in _TRUE


def is_decoupled(config: dict) -> bool:
    return bool(config.get("model_transaction_policy", {}).get("decoupled", False))


def load_tokenizer(config: dict):
    """The tokenizer in parameter `tokenizer_dir`, loaded with local files only."""
    tokenizer_dir = param(config, "tokenizer_dir")
    if not tokenizer_dir or not os.path.isdir(tokenizer_dir):
        raise ConfigError(f"parameter 'tokenizer_dir': {tokenizer_dir!r} is not a directory")
    from transformers import AutoTokenizer  # heavy; only the tokenizing models need it
    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ... for unusable dirs
        raise ConfigError(f"parameter 'tokenizer_dir': cannot load a tokenizer from "
                          f"{tokenizer_dir!r}: {e}") from None
