"""Entry checks shared by the ops' twins and launchers.

The ops are called by the engine, not by users, so a failed check is a programming
error: it raises ValueError naming the op, the argument and what was expected. Checks
look at metadata only (shape, dtype, device, layout), never at values, so they cost no
GPU sync.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def check_tensor(op: str, name: str, t: object, shape: Sequence[Optional[int]],
                 dtype: torch.dtype | tuple[torch.dtype, ...],
                 device: Optional[torch.device] = None, contiguous: bool = False) -> None:
    """Raises ValueError unless `t` is a tensor of `shape` (None: any size) and `dtype`,
    on `device` when given, and contiguous when asked."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{op}: {name} must be {expected}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{op}: {name} must have shape {expected}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")


def check_cuda_device(op: str, t: torch.Tensor) -> torch.device:
    """The CUDA device of `t` (with its index), or ValueError when `t` is not on one."""
    if t.device.type != "cuda":
        raise ValueError(f"{op}: the CUDA path needs tensors on a GPU, got {t.device}")
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)
