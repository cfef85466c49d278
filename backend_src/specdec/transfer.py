"""Host values onto the device without stalling the step.

On CUDA, `torch.tensor(values, device="cuda")` and `host_tensor.to("cuda")` copy from
pageable memory with `cudaMemcpyAsync` followed by `cudaStreamSynchronize`: the host
waits until every kernel queued before the copy has run. A step that builds its small
index tensors (slots, prefix lengths, tokens) that way never lets Python run ahead of
the GPU, and each of them costs a full pipeline drain.

`to_device` stages the values in pinned memory and queues the copy on the current
stream with `non_blocking=True`, like a kernel. PyTorch's caching host allocator
reuses the pinned pages and does not hand them out again before the copy has run, so
the staging tensor may be dropped at once. On CPU both functions are plain copies.

Every host-to-device transfer of the step path goes through here; tests/test_host_syncs.py
counts what bypasses it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def to_device(values: Sequence, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without a stream sync on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (e.g. a request's uniforms from its CPU generator) on `device`,
    without a stream sync on CUDA."""
    if device.type != "cuda" or tensor.device.type == "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
