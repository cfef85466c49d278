"""CuPy glue shared by the ops: finds `kernels/`, compiles each `.cu` once per device
(`cupy.RawModule`, NVRTC), and launches on torch's current stream with the tensors'
device addresses.

Owns nothing about what a kernel computes. Importing this module never fails: without
CuPy, without a GPU, or when a kernel does not compile, `get_kernel` returns None (the
compile error is logged once) and the ops run their torch twins. Only API common to
cupy-cuda12x and cupy-cuda13x is used (RawModule, Device, ExternalStream).

The sources are found in `$SPECDEC_KERNEL_DIR`, else in `kernels/` at the repository
root (backend_src/specdec/ops -> ../../../kernels).
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy
import torch

try:
    import cupy
except Exception:  # ImportError, or a CUDA library mismatch raised while importing
    cupy = None

log = logging.getLogger(__name__)

KERNEL_DIR_ENV = "SPECDEC_KERNEL_DIR"
# No FMA contraction: verify_sampling compares products bit for bit with its twin.
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false")

_lock = threading.Lock()
_kernels: dict[tuple[str, str, int], Any] = {}  # (file, name, device) -> RawKernel | None
_modules: dict[tuple[str, int], Any] = {}  # (file, device) -> RawModule (compiled)
_streams: dict[tuple[int, int], Any] = {}  # (device, torch stream pointer) -> cupy ExternalStream


def kernel_dir() -> Path:
    """Where the `.cu` sources are: $SPECDEC_KERNEL_DIR or <repo>/kernels."""
    env = os.environ.get(KERNEL_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[3] / "kernels"


def cupy_available() -> bool:
    """True when CuPy imported and sees at least one CUDA device."""
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, or CuPy built for another CUDA major
        return False


def _compiled_module(filename: str, device_index: int):
    key = (filename, device_index)
    if key not in _modules:
        source = (kernel_dir() / filename).read_text()
        with cupy.cuda.Device(device_index):
            module = cupy.RawModule(code=source, options=NVRTC_OPTIONS)
            module.compile()  # compile now, so that errors surface here, once
        _modules[key] = module
    return _modules[key]


def get_kernel(filename: str, name: str, device: torch.device):
    """The compiled `extern "C"` kernel `name` of `kernels/<filename>` for `device`, or
    None when CuPy, the GPU or the compile is missing (logged once per kernel)."""
    if cupy is None or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (filename, name, index)
    with _lock:
        if key not in _kernels:
            try:
                _kernels[key] = _compiled_module(filename, index).get_function(name)
            except Exception as exc:  # compile error, missing file, no driver
                log.warning("CUDA kernel %s:%s unavailable on cuda:%d, using its torch twin: "
                            "%s", filename, name, index, exc)
                _kernels[key] = None
        return _kernels[key]


def require_kernel(filename: str, name: str, device: torch.device):
    """Like `get_kernel`, but raises RuntimeError instead of returning None."""
    kernel = get_kernel(filename, name, device)
    if kernel is None:
        raise RuntimeError(f"CUDA kernel {filename}:{name} is unavailable on {device} "
                           "(no CuPy, no GPU, or it did not compile; see the log)")
    return kernel


def _external_stream(pointer: int, index: int):
    """CuPy's wrapper of a torch stream, made once per (device, stream) and reused:
    building it at every launch was part of a 150-575 us launch path (docs 3.1)."""
    key = (index, pointer)
    stream = _streams.get(key)
    if stream is None:
        try:
            stream = cupy.cuda.ExternalStream(pointer, index)
        except TypeError:  # CuPy versions whose ExternalStream takes only the pointer
            stream = cupy.cuda.ExternalStream(pointer)
        _streams[key] = stream
    return stream


def launch(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any],
           device: torch.device) -> None:
    """Launches `kernel` on torch's current stream of `device`. A tensor argument passes
    as its device address (`T*` in the kernel; the caller checked dtype, device and
    contiguity), by value as a numpy uint64, as CuPy passes an array's: no DLPack view
    to build per argument. Other arguments must already be numpy scalars of the
    kernel's parameter types."""
    stream = torch.cuda.current_stream(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index), _external_stream(stream.cuda_stream, index):
        kernel(grid, block, tuple(numpy.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args))


def threads_for(work: int, cap: int = 256) -> int:
    """A block size for `work` independent items: a multiple of 32 in [32, cap]."""
    return max(32, min(cap, (work + 31) // 32 * 32))


def pow2_threads_for(work: int, cap: int = 1024) -> int:
    """A power-of-two block size in [32, cap] for kernels with tree reductions."""
    threads = 32
    while threads < work and threads < cap:
        threads *= 2
    return threads
