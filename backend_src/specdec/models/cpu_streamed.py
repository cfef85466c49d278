"""The streamed float32 linear (kernels/cpu_streamed_linear.cpp): built once per machine, or absent.

A decode step's matmuls on a small CPU are bound by memory: a kernel that keeps up reads
the weights once per call whatever the row count. MKL's sgemm re-packs the weight at
every call, and MKL's packs and oneDNN's layout are copies of the weights (540 MB more
each for SmolLM2-135M's target). This kernel loads each pair of weight rows once and
applies every input row to it while it is in L1, on the weight as it is. It is the
fourth path of `cpu_linear`'s routing, timed at load beside the others and taken where it
is the fastest path without a copy, unless a copy beats it by `cpu_linear.COPY_MARGIN`.
On a 2-core Intel Xeon VM (AVX-512), the load-time timings of the target's linears
(docs/bench/row_routing_smollm2_target_streamed.json) put it at 4-16 rows, and 8-node
EAGLE-3 trees went from 1.05x to 1.14x of plain decoding on MT-bench and from 1.52x to
1.85x on HumanEval, plain decoding unchanged (docs/benchmarks.md 1.25).

The source is compiled at the first load on a machine with `torch.utils.cpp_extension`
(a C++ compiler and ninja; about 35 s on 2 cores) for that machine's CPU
(`-march=native`) into torch's extension folder (`$TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), under a name that hashes the source, the flags, the CPU
and torch: a later load, or another process, finds it there. Without a compiler, or
when the build fails, `streamed_kernel()` logs why once and returns None, and the
routing keeps to the other three paths. `SPECDEC_CPU_STREAMED=0` never builds it.

Its torch twin is `F.linear`: results equal it up to float32 rounding (another summation
order). A row's result does not depend on the rows beside it in a call.

Drafters' checkpoints hold their weights in 16 bits (float16 here, bfloat16 upstream), which
the engine serves as float32 on a CPU. `compact_weight` gives the kernel a float16 or
bfloat16 copy of such a weight when every value survives the round trip exactly: the
kernel widens each weight as it loads it, so its results equal its results on the float32
weight bit for bit, for half the memory read (a drafter's decode-time calls are bound by
memory as the target's are). A weight that is not exact in 16 bits (the target's, from
GGUF blocks) is used as it is. `SPECDEC_CPU_STREAMED_16BIT=0` keeps every weight in float32.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..ops._cupy import kernel_dir

LOG = logging.getLogger("specdec")

SOURCE_NAME = "cpu_streamed_linear.cpp"
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp")  # -fopenmp: at::parallel_for threads
LANES = 16  # the kernel's inner dimension must be a multiple of this

_lock = threading.Lock()
_kernel: dict[str, Any] = {}  # "module" -> the built extension, or None once a build failed


def wanted() -> bool:
    """The streamed path may be built and timed (SPECDEC_CPU_STREAMED is not 0)."""
    return os.environ.get("SPECDEC_CPU_STREAMED", "auto") != "0"


def streamed_kernel() -> Optional[Any]:
    """The built extension (its `streamed_linear(x, w, bias)`), building it at the
    first call; None when it is turned off or cannot be built (logged once)."""
    if not wanted():
        return None
    with _lock:
        if "module" not in _kernel:
            _kernel["module"] = _build()
        return _kernel["module"]


def compact_wanted() -> bool:
    """16-bit copies of exact weights may be made (SPECDEC_CPU_STREAMED_16BIT is not 0)."""
    return os.environ.get("SPECDEC_CPU_STREAMED_16BIT", "auto") != "0"


def compact_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight the kernel reads for `weight` (float32, `eligible`): a float16 copy
    when every value is exact in float16, else a bfloat16 copy when exact in bfloat16,
    else `weight` itself (also when `compact_wanted()` is false). Half the bytes, the
    same values, so the same results."""
    if not compact_wanted():
        return weight
    for dtype in (torch.float16, torch.bfloat16):
        copy = weight.to(dtype)
        if torch.equal(copy.float(), weight):  # every value exact (an overflow to inf or a NaN is not equal)
            return copy.contiguous()
    return weight


def eligible(weight: torch.Tensor) -> bool:
    """A weight the kernel takes as it is: float32 [N, K] contiguous on the CPU, K a
    multiple of `LANES`."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.is_contiguous() and weight.shape[1] % LANES == 0)


def streamed_linear(kernel: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., K] @ weight.T + bias through `kernel` (weight `eligible`, or its
    `compact_weight`): [..., N]."""
    flat = x.reshape(-1, weight.shape[1]).contiguous()  # [rows, K]
    out = kernel.streamed_linear(flat, weight, bias)  # [rows, N]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def twin(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch twin of the kernel."""
    return F.linear(x, weight, bias)


def build_name(source: bytes) -> str:
    """The extension's name: the source, flags, CPU and torch hashed, so that a changed
    one builds anew instead of loading a stale build."""
    digest = hashlib.sha256()
    for part in (source, " ".join(CFLAGS).encode(), _cpu_flags().encode(), torch.__version__.encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"specdec_streamed_linear_{digest.hexdigest()[:16]}"


def _build() -> Optional[Any]:
    path = kernel_dir() / SOURCE_NAME
    if platform.machine().lower() not in ("x86_64", "amd64"):
        LOG.info("streamed CPU linear: not built on %s (x86-64 only)", platform.machine())
        return None
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        source = path.read_bytes()
        module = cpp_extension.load(name=build_name(source), sources=[str(path)], extra_cflags=list(CFLAGS),
                                    verbose=False)
    except Exception as e:  # no compiler or ninja, a failed build, an unreadable source
        LOG.warning("streamed CPU linear unavailable (%s: %s); matmuls keep to MKL and oneDNN",
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    LOG.info("streamed CPU linear built from %s", path.name)
    return module


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip package's binary is put there
    when PATH lacks one (a server started without the virtual environment active)."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _cpu_flags() -> str:
    """The CPU's model and instruction-set flags (/proc/cpuinfo), else `platform`'s name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted_keys = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":", 1)[0].strip() in wanted_keys}))
