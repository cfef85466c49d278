"""How many requests the KV cache holds: sized once at load, never grown.

Every running request owns one slot of every model's static cache (target, EAGLE
head, draft model), `max_seq_len` positions long. The number of slots is the smallest of
- `max_batch_size`;
- `kv_cache_max_tokens` // positions per slot, when set (a hard cap, any device);
- on a GPU, `kv_cache_free_gpu_mem_fraction` x the memory free once the weights are
  loaded, divided by one slot's bytes (TensorRT-LLM's parameter of the same name).
Fewer slots than `max_batch_size` means fewer requests decode together: the others
wait in the queue (admission waits for a free slot), never an out-of-memory crash.
No room for even one slot fails the load with the numbers that did not fit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import ConfigError

MIB = 2**20


@dataclass(frozen=True)
class KVBudget:
    slots: int
    slot_bytes: int  # every model's cache, one slot
    limited_by: str  # "max_batch_size" | "kv_cache_max_tokens" | "kv_cache_free_gpu_mem_fraction"

    def describe(self, positions: int) -> str:
        return (f"KV cache: {self.slots} slots x {positions} positions, {self.slots * self.slot_bytes / MIB:.1f} MiB "
                f"(limited by {self.limited_by})")


def free_device_bytes(device: torch.device) -> Optional[int]:
    """Free memory of a CUDA device (None on CPU: host memory is not budgeted)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def kv_budget(max_batch_size: int, slot_bytes: int, positions: int, max_tokens: int = 0,
              free_bytes: Optional[int] = None, fraction: float = 0.9) -> KVBudget:
    """Slots for `slot_bytes` each (`positions` KV positions per slot)."""
    limits = {"max_batch_size": max_batch_size}
    if max_tokens:
        limits["kv_cache_max_tokens"] = max_tokens // positions
    if free_bytes is not None:
        limits["kv_cache_free_gpu_mem_fraction"] = int(free_bytes * fraction) // max(1, slot_bytes)
    name = min(limits, key=lambda k: limits[k])
    slots = limits[name]
    if slots < 1:
        if name == "kv_cache_max_tokens":
            raise ConfigError(f"kv_cache_max_tokens={max_tokens} holds no request: one request needs "
                              f"{positions} KV positions (max_seq_len); raise it or lower max_seq_len")
        raise ConfigError(f"the KV cache of one request ({positions} positions) needs {slot_bytes / MIB:.1f} MiB "
                          f"but kv_cache_free_gpu_mem_fraction={fraction} of the {free_bytes / MIB:.1f} MiB free "
                          f"after loading the weights is {free_bytes * fraction / MIB:.1f} MiB; lower max_seq_len, "
                          f"raise the fraction, or use a larger GPU")
    return KVBudget(slots=slots, slot_bytes=slot_bytes, limited_by=name)
