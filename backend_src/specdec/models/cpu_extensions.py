"""Building the repository's C++ CPU kernels (kernels/*.cpp) into torch extensions.

Each source is compiled at its first use on a machine with `torch.utils.cpp_extension`
(a C++ compiler and ninja; about 35 s on 2 cores) for that machine's CPU (`-march=native`)
into torch's extension folder (`$TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`),
under a name that hashes the source, the flags, the CPU, torch and where torch's headers are:
a later load, or another process, finds it there. torch's build file names every path it
compiles with, and a build whose file changed is rebuilt: two checkouts of one commit, each
with its own virtual environment, loading in turn rebuilt each other's kernels (40-85 s
each) at every load. So the headers' paths are in the name (each environment builds once)
and the compiler reads a copy of the source kept under that name (`stable_source`), not the
checkout's file. Without a compiler, or when the build fails, `load` logs why and returns
None, and the caller keeps to its torch twin.

What each kernel computes, and when it is used: `cpu_streamed.py` (the streamed linear),
`cpu_amx.py` (the AMX linear over 4-bit and int8 weights), `cpu_attention.py` (attention of a few queries),
`cpu_layer_ops.py` (norms, SiLU and RoPE around the matmuls).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sysconfig
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch

LOG = logging.getLogger("specdec")

CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp")  # -fopenmp: at::parallel_for threads


def build_name(prefix: str, source: bytes) -> str:
    """`prefix` and a hash of the source, flags, CPU, torch and the headers' paths, so that
    a changed one builds anew instead of loading a stale build, and two environments do not
    take turns rebuilding one build."""
    from torch.utils import cpp_extension

    headers = "\n".join([*cpp_extension.include_paths(), sysconfig.get_paths()["include"]])
    digest = hashlib.sha256()
    for part in (source, " ".join(CFLAGS).encode(), _cpu_flags().encode(), torch.__version__.encode(),
                 headers.encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"{prefix}_{digest.hexdigest()[:16]}"


def load(path: Path, prefix: str, what: str, otherwise: str) -> Optional[Any]:
    """The extension built from the source at `path` (x86-64 only), or None with a logged
    reason: `what` names the kernel in the log, `otherwise` says what runs instead."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        LOG.info("%s: not built on %s (x86-64 only)", what, platform.machine())
        return None
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        source = path.read_bytes()
        name = build_name(prefix, source)
        module = cpp_extension.load(name=name, sources=[str(stable_source(name, source, path.suffix))],
                                    extra_cflags=list(CFLAGS), verbose=False)
    except Exception as e:  # no compiler or ninja, a failed build, an unreadable source
        LOG.warning("%s unavailable (%s: %s); %s", what, type(e).__name__,
                    str(e).strip().splitlines()[-1] if str(e).strip() else "", otherwise)
        return None
    LOG.info("%s built from %s", what, path.name)
    return module


def stable_source(name: str, source: bytes, suffix: str) -> Path:
    """The path the compiler reads `source` from: a copy named after the build
    (`build_name`, which hashes the source), the same for every checkout, under
    `$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`). Written once, whole
    (a rename), so that a process building meanwhile never reads half a file."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    copy = Path(root) / "specdec_sources" / f"{name}{suffix}"
    if not copy.is_file() or copy.read_bytes() != source:
        copy.parent.mkdir(parents=True, exist_ok=True)
        partial = copy.with_name(f"{copy.name}.{os.getpid()}.{threading.get_ident()}.partial")
        partial.write_bytes(source)
        os.replace(partial, copy)
    return copy


class LazyKernel:
    """One kernel's extension, made by `build` at its first use: what each kernel module's
    getter, `wanted` and `build_id` are. The environment variable `switch` set to 0 turns
    the kernel off (nothing is built). One thread builds while others wait, and `build`
    returning None (no compiler, a failed build) is kept too, so a failure is tried and
    logged once per process."""

    def __init__(self, switch: str, build: Callable[[], Optional[Any]]):
        self.switch = switch
        self._build = build
        self._lock = threading.Lock()
        self.cache: dict[str, Any] = {}  # "module" -> the built extension, or None once a build failed

    def wanted(self) -> bool:
        """The kernel may be built and used (`switch` is not 0)."""
        return os.environ.get(self.switch, "auto") != "0"

    def module(self) -> Optional[Any]:
        """The built extension, building it at the first call; None when the kernel is
        turned off or cannot be built."""
        if not self.wanted():
            return None
        if "module" in self.cache:  # built (or failed) already: no lock needed to read it
            return self.cache["module"]
        with self._lock:
            if "module" not in self.cache:
                self.cache["module"] = self._build()
            return self.cache["module"]

    def build_id(self) -> Optional[str]:
        """The built kernel's name (a hash of its source, flags, CPU and torch), or None when
        it is off or cannot be built: what timings measured with it depend on."""
        module = self.module()
        return None if module is None else module.__name__


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
