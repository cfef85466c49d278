"""What the tests of the C++ CPU kernels share (`models/cpu_extensions.py` builds them).

On an x86-64 Linux machine with a C++ compiler and ninja, as the test machines are, a
kernel must build: its tests fail rather than skip there, so that they cannot pass by
never running.
"""
from __future__ import annotations

import platform
import shutil
from typing import Any, Optional

import pytest
import torch


def can_build() -> bool:
    """This machine has what the build needs (x86-64, a C++ compiler, ninja)."""
    try:
        import ninja  # noqa: F401
        has_ninja = True
    except ImportError:
        has_ninja = shutil.which("ninja") is not None
    return platform.machine().lower() in ("x86_64", "amd64") and shutil.which("c++") is not None and has_ninja


def built_or_skip(built: Optional[Any], wanted: bool, what: str) -> Any:
    """`built` (a kernel module), or a skip where the machine cannot build it or the
    environment turned it off; a failure where it should have built."""
    if built is None:
        assert not can_build() or not wanted, f"the {what} should build on this machine"
        pytest.skip(f"no {what} on this machine")
    return built


def fail_the_build(module: Any, monkeypatch, tmp_path) -> None:
    """Makes `module` (cpu_streamed, cpu_attention, cpu_amx or cpu_layer_ops) build anew from a folder without its
    source, so that the build fails; skips off x86-64, where nothing is built at all. The
    process's build is forgotten for the test and restored after."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("not built off x86-64 at all")
    monkeypatch.setattr(module.KERNEL, "cache", {})
    monkeypatch.setattr(module, "kernel_dir", lambda: tmp_path)


def q4_1_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight as GGUF's Q4_1 blocks dequantize to, through the gguf package, with
    a constant block and an all-zero one."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    values[0, :32] = 0.0
    values[rows - 1, cols - 32:] = 0.37
    packed = quantize(values, GGMLQuantizationType.Q4_1)
    return torch.from_numpy(dequantize(packed, GGMLQuantizationType.Q4_1).copy()).float().reshape(rows, cols)


def int8_rows_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight as the EAGLE-3 head is set up: int8 rows with a float32 scale each,
    through tools/packed_rows.py's own quantizer and dequantizer (rows of magnitudes from
    1e-3 to 1; a block's scale is its row's, not its own largest magnitude over 127)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import packed_rows

    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 0, rows)[:, None]
    if rows > 1:
        values[1] = 0.0  # an all-zero row
    return packed_rows.dequantize(*packed_rows.quantize(values), torch.float32)


def q8_0_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight as GGUF's Q8_0 blocks dequantize to, through the gguf package
    (its quantizer and dequantizer, as tools/convert_gguf.py reads a GGUF)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    if cols > 32:
        values[0, :32] = 0.0  # an all-zero block (not the whole row: that one is 4-bit exact)
    packed = quantize(values, GGMLQuantizationType.Q8_0)
    return torch.from_numpy(dequantize(packed, GGMLQuantizationType.Q8_0).copy()).float().reshape(rows, cols)
