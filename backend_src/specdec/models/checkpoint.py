"""Reading checkpoints from local directories, never running code from them.

Handles the layouts upstream checkpoints ship in: `model.safetensors`, sharded
safetensors with `model.safetensors.index.json`, `pytorch_model.bin` (and its sharded
index), and Medusa's `medusa_lm_head.safetensors` / `medusa_lm_head.pt`. `.bin`/`.pt`
files are read only with `torch.load(weights_only=True)`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file

from ..errors import ConfigError


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {str(directory)!r}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _load_one(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path), device="cpu")
    return torch.load(str(path), map_location="cpu", weights_only=True)


def load_state_dict(directory: str | Path, names: Optional[tuple[str, ...]] = None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint in `directory` (CPU, stored dtype).

    `names` lists the single-file names to try, in order, before the sharded indexes
    (default: `model.safetensors`, `pytorch_model.bin`).
    """
    directory = Path(directory)
    names = names or ("model.safetensors", "pytorch_model.bin")
    for name in names:
        if (directory / name).is_file():
            return _load_one(directory / name)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                state.update(_load_one(directory / shard))
            return state
    raise ConfigError(f"no weights in {str(directory)!r} (looked for {', '.join(names)} and sharded indexes)")


def load_tensor(directory: str | Path, key: str) -> torch.Tensor:
    """One tensor by name from a (possibly sharded) checkpoint, e.g. the base model's
    embeddings for a drafter whose checkpoint does not carry them."""
    directory = Path(directory)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.is_file():
            shard = json.loads(index.read_text())["weight_map"].get(key)
            if shard is not None:
                return _load_one(directory / shard)[key]
    state = load_state_dict(directory)
    if key not in state:
        raise ConfigError(f"{str(directory)!r} has no tensor {key!r}")
    return state[key]


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float64": torch.float64}[name]
