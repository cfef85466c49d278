"""The CPU matmul routing, measured once per machine and model shape, saved and reused.

`models.cpu_linear.choose_row_paths` times a model's float32 matmuls through MKL's
sgemm, oneDNN, MKL's packed gemm and the streamed kernel at each row count, and routes
each row count to the fastest path. That costs 3-5 s for SmolLM2-135M's target on 2 cores, as much again for Medusa's
heads, at every load. Its result also moved between loads on a busy machine (a server
loads its other models meanwhile), and the calibration cache keys on the target's
routing, so a routing that changed at a restart meant minutes of calibrating again.

So the first routing measured for a list of layer shapes on this CPU model, thread
count, torch version and `cpu_linear.py` is written to
`<calibration cache folder>/row-routing-<hash>.json`, and later loads with the same
fingerprint take it from there. Deleting the file measures again. A missing, corrupt or
mismatching file is measured and written again, and so is a routing whose path for one
row no longer holds at this load (`_still_holds`: about 0.3 s for the target); a failed
write is a warning, never a failed load. With the calibration cache off
(`calibration_cache_dir: off`), every load measures.

This module decides when to measure, not how (`cpu_linear.py`).
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Optional

import torch

from .calibration_cache import cache_dir, cpu_model, write_atomically
from .models import cpu_amx, cpu_linear, cpu_streamed
from .models.cpu_linear import PackedCpuLinear, RowRouting, choose_row_paths, layer_shapes, measuring_wanted, route

LOG = logging.getLogger("specdec")
FORMAT = 4  # of the file; bump when it changes shape
RECHECKED_ROWS = 1  # the row count a saved routing is timed again at, at each load (`_still_holds`)
STALE_MARGIN = 0.25  # a saved routing's path this much slower there than the copy-free one: measured again,
STALE_MIN_MS = 1.0  # if it is also this many ms slower (a small model's timings are noise at that scale)


def cached_row_paths(layers: list[PackedCpuLinear], directory: Optional[Path]) -> tuple[Optional[RowRouting], str]:
    """Routes `layers` by the routing saved in `directory` for their shapes on this
    machine, else by measuring (and saving) one. Returns the routing (None: nothing
    routed, as `choose_row_paths`) and where it came from: "measured at load" or
    "measured at an earlier load"."""
    if not measuring_wanted(layers):
        return None, "not measured"
    if directory is None:
        return choose_row_paths(layers), "measured at load"
    fp = json.loads(json.dumps(fingerprint(layers)))
    digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    path = directory / f"row-routing-{digest}.json"
    stored = _read(path, fp)
    if stored is not None:
        route(layers, stored)
        if _still_holds(layers, path):
            return stored, "measured at an earlier load"
    routing = choose_row_paths(layers)
    if routing is not None:
        write_atomically(path, json.dumps({"fingerprint": fp, "onednn_rows": sorted(routing.onednn_rows),
                                           "packs": [list(p) for p in routing.packs],
                                           "streamed_rows": sorted(routing.streamed_rows),
                                           "timings_ms": [list(t) for t in routing.timings_ms]}, indent=1),
                         "matmul routing cache")
    return routing, "measured at load"


def _still_holds(layers: list[PackedCpuLinear], path: Path) -> bool:
    """Whether a saved routing (already applied to `layers`) is still right where it
    matters most: one row, what plain decoding at batch 1 pays at every step. Its path
    there is timed against the faster path without a copy (`cpu_linear.time_routed`);
    more than `STALE_MARGIN` and `STALE_MIN_MS` slower means the routing was measured on a
    busy machine (one saved while a test ran beside the load routed one row to a 4-row MKL
    pack, padded, and plain decoding ran about a quarter slower at every later load), so
    it is measured again. Other load slows both paths alike, which leaves the check as it is."""
    routed_ms, copy_free_ms = cpu_linear.time_routed(cpu_linear._called(layers), RECHECKED_ROWS, repeats=2)
    if routed_ms <= copy_free_ms * (1 + STALE_MARGIN) or routed_ms - copy_free_ms <= STALE_MIN_MS:
        return True
    LOG.warning("matmul routing cache %s: its path for %d row took %.1f ms against %.1f ms without a copy at "
                "this load; measuring again", path, RECHECKED_ROWS, routed_ms, copy_free_ms)
    return False


def routing_cache_dir(setting: str) -> Optional[Path]:
    """The calibration cache's folder for `calibration_cache_dir` = `setting` (None: off,
    or no folder can be worked out: logged)."""
    try:
        return cache_dir(setting)
    except RuntimeError as e:  # no home folder
        LOG.warning("no matmul routing cache: %s", e)
        return None


def fingerprint(layers: list[PackedCpuLinear]) -> dict:
    """What the routing depends on: the CPU, its threads, torch, how routing measures
    (`cpu_linear.py`'s source), how many MKL packs it may keep, the streamed kernel (its
    build, or none, and whether it reads compact copies of exact weights), the AMX kernel
    it sends 4-bit calls of a few rows to (its build, or none), the shapes of the layers a
    forward calls and, where the kernel could take them, the compact form it would read
    each in (`cpu_streamed.probed_form`: a head set up in float16 and the same head as
    int8 rows have one shape and different timings)."""
    source = Path(cpu_linear.__file__).read_bytes()
    called = cpu_linear._called(layers)
    kernel = cpu_linear.streamed_kernel_for(called)
    forms = None if kernel is None else [cpu_streamed.probed_form(m.weight.detach()) for m in called]
    return {"format": FORMAT, "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_linear": hashlib.sha256(source).hexdigest()[:16], "mkl_packs": cpu_linear.mkl_packs_allowed(),
            "streamed": None if kernel is None else kernel.__name__, "streamed_compact": cpu_streamed.compact_wanted(),
            "amx": None if kernel is None else cpu_amx.build_id(), "layers": layer_shapes(layers),
            "forms": forms}


def _read(path: Path, fp: dict) -> Optional[RowRouting]:
    """The routing stored at `path` for fingerprint `fp`, or None (missing, another
    fingerprint, or unreadable: the last one logged)."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:
        LOG.warning("matmul routing cache %s is unreadable (%s); measuring again", path, e)
        return None
    if not isinstance(data, dict) or data.get("fingerprint") != fp:
        return None
    try:
        rows = frozenset(int(r) for r in data["onednn_rows"])
        packs = tuple((int(step), int(size)) for step, size in data["packs"])
        streamed = frozenset(int(r) for r in data["streamed_rows"])
        timings = tuple((int(r), float(a), float(b), float(c), float(d)) for r, a, b, c, d in data["timings_ms"])
    except (KeyError, TypeError, ValueError) as e:
        LOG.warning("matmul routing cache %s is corrupt (%s); measuring again", path, e)
        return None
    ladder = set(cpu_linear.ROW_LADDER)
    if not rows <= ladder or not streamed <= ladder or not all(step in ladder and size in ladder
                                                               for step, size in packs):
        LOG.warning("matmul routing cache %s names row counts off the ladder; measuring again", path)
        return None
    return RowRouting(rows, packs, timings, streamed)
