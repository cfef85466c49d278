"""The sampling a request gets for the fields it leaves out: the served model's, as vLLM and
SGLang do.

    --generation-config auto     the checkpoint's generation_config.json (the default)
    --generation-config openai   none: OpenAI's defaults alone (vLLM's `vllm` is the same)
    --generation-config DIR      the generation_config.json in DIR

Owns: reading `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` from a
`generation_config.json` (the keys it has; vLLM's `--generation-config auto` and SGLang's
`--sampling-defaults model` take the same ones) and checking them against the ranges a
request's own values must be in. Under them OpenAI's defaults apply (temperature 1,
top_p 1, `protocol.parse_request`). A field the client sends always wins.

The default model's generation_config.json carries the sampling SmolLM2's model card uses
(temperature 0.2, top_p 0.9; `tools/setup_model.py`): at OpenAI's temperature 1 a model of
135 M parameters wanders off within a sentence.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .protocol import OpenAIError, _int, _number

FILE = "generation_config.json"
AUTO, NONE = "auto", ("openai", "vllm")
# the keys read (named as the ensemble's inputs) -> (lowest, highest, whether lowest is excluded),
# a request's ranges but for top_k, whose -1 only a request may send; top_k is an integer
KEYS = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "top_k": (0, None, False),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.0, None, True),
}


class SamplingDefaultsError(ValueError):
    """A generation config the front door cannot use; the message names the file and key."""


def parse(config: dict, where: str = FILE) -> dict:
    """The sampling defaults in a generation config's keys, checked by the request's own field
    readers (`protocol._number`, `protocol._int`).

    Keys the config lacks (or sets to null) are left out; `top_k` 0 and `min_p` 0 mean off,
    as in transformers, and so are left out too."""
    defaults = {}
    for key, (lo, hi, lo_open) in KEYS.items():
        try:
            value = _int(config, key, lo=lo) if key == "top_k" else _number(config, key, lo, hi, lo_open)
        except OpenAIError as e:
            raise SamplingDefaultsError(f"{where}: {e.message}") from None
        if value is not None and (value or key not in ("top_k", "min_p")):
            defaults[key] = value
    return defaults


def load(source: str, model_dir: Optional[str | Path]) -> dict:
    """The defaults `--generation-config source` names; `model_dir` is the served checkpoint's
    folder (where `auto` looks). A folder without the file gives none; `DIR` must have it."""
    if source in NONE or (source == AUTO and model_dir is None):
        return {}
    path = Path(model_dir if source == AUTO else source) / FILE
    if not path.is_file():
        if source == AUTO:
            return {}
        raise SamplingDefaultsError(f"--generation-config {source}: no {FILE} there")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SamplingDefaultsError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise SamplingDefaultsError(f"{path}: must hold a JSON object")
    return parse(config, str(path))


def describe(defaults: dict) -> str:
    """`temperature 0.2, top_p 0.9` for the log."""
    return ", ".join(f"{k} {v:g}" for k, v in defaults.items())
