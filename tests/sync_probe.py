"""Finds, on any device, what would stall a CUDA stream or break a CUDA-graph capture.

`SyncProbe` records, by call site (`file.py:line` of the innermost frame under `scope`,
the engine package by default), two kinds of events inside a `with` block:

- syncs: a device value read on the host (`.item()`, `int(t)`, `bool(t)`, `.tolist()`,
  `.cpu()`, `.numpy()`) or an op whose output size depends on values (`nonzero`,
  `masked_select`, indexing with a bool mask);
- blocking copies: host data turned into a tensor (`torch.tensor(list)`, seen as
  `aten.lift_fresh`) or a `.to(device)` with `non_blocking=False`. On CUDA both are a
  `cudaMemcpyAsync` followed by `cudaStreamSynchronize`.

What goes through `specdec/transfer.py` (pinned staging, `non_blocking=True`) is not a
blocking copy. On CPU none of these stall anything, but the same code runs on a GPU,
so a test on CPU proves what the step does there.
"""
from __future__ import annotations

import collections
import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select"}


def _site(scope: str, staged_ok: bool = True) -> str | None:
    """`file.py:line` of the innermost frame under `scope` (a folder), or None when the
    call came from outside the scope or (`staged_ok`) through transfer.py (not blocking)."""
    stack = [(f.filename.replace("\\", "/"), f.lineno) for f in traceback.extract_stack()]
    frames = [(name, line) for name, line in stack if scope in name]
    if not frames or (staged_ok and any(name.endswith("/specdec/transfer.py") for name, _ in stack)):
        return None
    name, line = frames[-1]
    return f"{name.split(scope)[-1]}:{line}"


class SyncProbe(TorchDispatchMode):
    active: "SyncProbe | None" = None  # the probe inside whose block we are

    def __init__(self, scope: str = "/backend_src/specdec/", staged_ok: bool = True):
        """`staged_ok=False`: copies staged through transfer.py count as blocking too (inside
        a CUDA graph no host-to-device copy may run: the graph would replay the copy of
        a staging buffer that is long gone)."""
        super().__init__()
        self.scope = scope
        self.staged_ok = staged_ok
        self.syncs: collections.Counter = collections.Counter()  # site -> count
        self.blocking: collections.Counter = collections.Counter()  # site -> count
        self._saved: dict = {}
        self._paused = 0

    @contextlib.contextmanager
    def paused(self):
        """Nothing inside is recorded (a stand-in for work that runs elsewhere on a GPU)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _record(self, counter: collections.Counter) -> None:
        if self._paused:
            return
        site = _site(self.scope, self.staged_ok)
        if site is not None:
            counter[site] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            self._record(self.syncs)
        elif name in ("index", "index_put", "index_put_") and len(args) > 1:
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
                self._record(self.syncs)
        elif name in ("lift_fresh", "lift_fresh_copy"):
            self._record(self.blocking)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        probe = self

        def wrap(name, counter, blocking_to=False):
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapper(t, *args, **kwargs):
                if not blocking_to or (not kwargs.get("non_blocking", False) and _names_device(args, kwargs)):
                    probe._record(counter)
                return original(t, *args, **kwargs)
            setattr(torch.Tensor, name, wrapper)

        wrap("tolist", self.syncs)
        wrap("cpu", self.syncs)
        wrap("numpy", self.syncs)
        wrap("to", self.blocking, blocking_to=True)
        SyncProbe.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        SyncProbe.active = None
        return super().__exit__(*exc)


def _names_device(args, kwargs) -> bool:
    """A `.to(...)` call that names a device (a copy across devices on a GPU)."""
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)
