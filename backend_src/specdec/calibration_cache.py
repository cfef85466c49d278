"""The load-time calibration, saved as JSON and reused while nothing it measured changed.

`policy.SpeculationPolicy.calibrate` times generations and forwards at every load
(minutes on a 2-core CPU). Its results, `Calibration`, are written after calibrating to
`<dir>/calibration-<hash>.json` and read back at the next load whose `fingerprint`
equals the stored one in full (the hash only names the file). The fingerprint is what
the timings depend on: the device (CPU model and torch threads, or the GPU's name),
torch's version, the engine's source, every loaded checkpoint's files (name, size,
mtime; weights are never hashed), the KV slots and context, and the config fields that
change what calibration measures.

A missing, corrupt or mismatching file means calibrating again and writing it; a write
that fails (a read-only directory) is a warning, never a failed load. Writes go to a
temporary file that replaces the old one, so a reader never sees half a file.

This module knows nothing about how calibration measures; `policy.py` decides what to
save and when.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Optional

import torch

from .config import EngineConfig
from .models import cpu_amx, cpu_attention, cpu_layer_ops, cpu_streamed
from .step_cost import StepCost

LOG = logging.getLogger("specdec")
FORMAT = 6  # of the file; bump when `Calibration` or the fingerprint changes shape
OFF = "off"
# Config fields that change what calibration measures (the device, dtype, checkpoints and
# context enter the fingerprint separately; the slots through the KV budget).
CONFIG_FIELDS = ("speculative_method", "eagle_total_tokens", "eagle_depth", "eagle_top_k", "num_draft_tokens",
                 "adaptive_speculation", "max_tokens_limit", "max_batch_size", "eagle_choices", "medusa_choices",
                 "eagle_score_temperature", "cuda_graph_mode", "cuda_graph_max_batch_size", "prompt_lookup_tokens",
                 "keep_host_memory")
CHECKPOINT_FIELDS = ("base_model_dir", "eagle_dir", "eagle3_dir", "medusa_dir", "draft_model_dir")
ENGINE_SOURCE = Path(__file__).resolve().parent  # the specdec package


@dataclasses.dataclass
class Calibration:
    """What `SpeculationPolicy.calibrate` measured."""

    total_tokens: int  # the EAGLE-2/3 tree size
    seconds_per_token: dict[int, float]  # tree size -> seconds per generated token (empty: not timed)
    prior_accept: dict[str, float]  # method -> accepted drafts per full-tree step
    cost: Optional[StepCost]  # the step costs (None: adaptive speculation off)
    # method -> {tree size: share of the full tree's accepted drafts} (measured sizes only)
    accept_share: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class CalibrationCache:
    """One calibration file: where it is and what it must have been measured on."""

    path: Path
    fingerprint: dict  # JSON values only (compared with the stored one after a round trip)

    @classmethod
    def for_engine(cls, engine, trees: dict, prompt: Optional[list[int]] = None) -> Optional["CalibrationCache"]:
        """The engine's cache file, or None when caching is off (or when its folder or
        fingerprint cannot be worked out: logged). `trees`: the policy's method ->
        StaticTree (or None); `prompt`: the chat request calibration continues, if any."""
        try:
            directory = cache_dir(engine.config.calibration_cache_dir)
            if directory is None:
                return None
            fp = json.loads(json.dumps(fingerprint(engine, trees, prompt)))
        except (OSError, RuntimeError) as e:  # no home folder; a checkpoint file gone meanwhile
            LOG.warning("no calibration cache: %s", e)
            return None
        digest = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
        return cls(directory / f"calibration-{digest}.json", fp)

    def load(self) -> tuple[Optional[Calibration], str]:
        """The stored calibration, or None with the reason (missing, corrupt, mismatching)."""
        try:
            data = json.loads(self.path.read_text())
        except (FileNotFoundError, NotADirectoryError):
            return None, "no cached calibration"
        except (OSError, ValueError) as e:
            LOG.warning("calibration cache %s is unreadable (%s); calibrating again", self.path, e)
            return None, f"cached calibration unreadable ({type(e).__name__})"
        if not isinstance(data, dict) or data.get("fingerprint") != self.fingerprint:
            return None, "cached calibration is for another setup"
        try:
            return _decode(data), "from cache"
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            LOG.warning("calibration cache %s is corrupt (%s: %s); calibrating again", self.path, type(e).__name__, e)
            return None, f"cached calibration corrupt ({type(e).__name__})"

    def save(self, calibration: Calibration) -> Optional[str]:
        """Writes the file atomically; returns None, or why it could not (logged)."""
        text = json.dumps({"fingerprint": self.fingerprint, **_encode(calibration)}, indent=1)
        return write_atomically(self.path, text, "calibration cache")


def write_atomically(path: Path, text: str, what: str) -> Optional[str]:
    """Writes `path` through a temporary file that replaces it, so a reader never sees
    half a file; returns None, or why it could not (logged as a warning about `what`)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp",
                                         delete=False) as f:
            tmp = f.name
            f.write(text)
        os.replace(tmp, path)
        return None
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        LOG.warning("cannot write the %s %s: %s", what, path, e)
        return f"{type(e).__name__}: {e.strerror or e}"


def cache_dir(setting: str) -> Optional[Path]:
    """`calibration_cache_dir`: "off" -> None; "" -> $SPECDEC_CACHE_DIR, else
    $XDG_CACHE_HOME/specdec, else ~/.cache/specdec; anything else is the directory."""
    if setting.strip().lower() == OFF:
        return None
    if setting.strip():
        return Path(setting).expanduser()
    if os.environ.get("SPECDEC_CACHE_DIR"):
        return Path(os.environ["SPECDEC_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "specdec"
    return Path.home() / ".cache" / "specdec"


def fingerprint(engine, trees: dict, prompt: Optional[list[int]] = None) -> dict:
    """What the calibration's results depend on. The engine's source stands for how
    calibration measures (its sizes, prefix, ...) and for what the timed code costs."""
    config: EngineConfig = engine.config
    return {
        "format": FORMAT,
        "device": _device(engine.device),
        "torch": torch.__version__,
        "engine_source": _source_digest(),
        "dtype": config.dtype,
        "packed_linears": engine.packed_linears,  # oneDNN and MKL packs on or off (SPECDEC_CPU_ONEDNN)
        # the row counts whose target matmuls (its decoder layers', then its LM head's) take oneDNN, an
        # MKL pack or the streamed kernel, as measured at this load
        "onednn_rows": None if engine.row_routing is None else sorted(engine.row_routing.onednn_rows),
        "mkl_packs": None if engine.row_routing is None else [list(p) for p in engine.row_routing.packs],
        "streamed_rows": None if engine.row_routing is None else sorted(engine.row_routing.streamed_rows),
        "streamed_compact": cpu_streamed.compact_wanted(),  # exact weights read as compact copies
        "streamed_build": _streamed_build(engine),
        "amx_build": _amx_build(engine),
        "cpu_attention": _attention_build(engine),
        "cpu_layer_ops": _layer_ops_build(engine),
        "lm_head_routing": None if engine.head_routing is None else engine.head_routing.describe(),
        "num_slots": engine.num_slots,
        "max_context": engine.max_context,
        "config": {name: getattr(config, name) for name in CONFIG_FIELDS},
        "checkpoints": {name: _files(getattr(config, name)) for name in CHECKPOINT_FIELDS
                        if getattr(config, name) is not None},
        "trees": {method: None if tree is None else [list(c) for c in tree.choices]
                  for method, tree in sorted(trees.items())},
        "calibration_prompt": prompt,  # acceptance depends on the text measured
    }


def _streamed_build(engine) -> Optional[str]:
    """The streamed kernel's build (its name hashes its source) where the routing sends
    the target's rows to it, else None."""
    routing = engine.row_routing
    return cpu_streamed.build_id() if routing is not None and routing.streamed_rows else None


def _amx_build(engine) -> Optional[str]:
    """The AMX kernel's build where the streamed kernel's calls of a few rows go to it (the
    routing sends rows to the streamed kernel), else None."""
    return cpu_amx.build_id() if _streamed_build(engine) is not None else None


def _attention_build(engine) -> Optional[str]:
    """The CPU attention kernel's build (its name hashes its source) where the layers take
    it, else None: off, not built, another dtype, a GPU."""
    return cpu_attention.build_id() if _float32_on_cpu(engine) else None


def _layer_ops_build(engine) -> Optional[str]:
    """The CPU layer operations' build where the layers take them, else None (as above)."""
    return cpu_layer_ops.build_id() if _float32_on_cpu(engine) else None


def _float32_on_cpu(engine) -> bool:
    """The engine runs in float32 on a CPU: where the layers take the CPU kernels."""
    return engine.device.type == "cpu" and engine.config.dtype == "float32"


def _device(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device)}
    return {"type": device.type, "cpu": cpu_model(), "threads": torch.get_num_threads()}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _files(directory: str) -> dict:
    """A checkpoint directory as its files' names, sizes and mtimes (no contents read)."""
    root = Path(directory).resolve()
    files = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            files.append([str(p.relative_to(root)), st.st_size, st.st_mtime_ns])
    return {"dir": str(root), "files": files}


def _source_digest() -> str:
    """The engine's Python source (names and contents of the package's .py files)."""
    h = hashlib.sha256()
    for p in sorted(ENGINE_SOURCE.rglob("*.py")):
        h.update(str(p.relative_to(ENGINE_SOURCE)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# -- the file's body ---------------------------------------------------------------------
# JSON objects have string keys only: maps with int or tuple keys are stored as lists of
# [key, value] pairs, tuples as lists (turned back into tuples when read).

def _encode(c: Calibration) -> dict:
    cost = None
    if c.cost is not None:
        cost = {"batch_sizes": c.cost.batch_sizes, "tree_sizes": c.cost.tree_sizes,
                "prefix_len": c.cost.prefix_len, "attn_slope": c.cost.attn_slope,
                "verify": [[list(k), v] for k, v in c.cost.verify.items()],
                "draft": [[list(k), [[b, t] for b, t in p.items()]] for k, p in c.cost.draft.items()],
                # the running measured/predicted ratios: calibration's own generations
                # already corrected the model, and a cached load must start where it did
                "ratio": [[_lists(k), r, n] for k, (r, n) in c.cost._ratio.items()]}
    return {"total_tokens": c.total_tokens,
            "seconds_per_token": [[n, t] for n, t in c.seconds_per_token.items()],
            "prior_accept": c.prior_accept, "cost": cost,
            "accept_share": {m: [[n, s] for n, s in shares.items()] for m, shares in c.accept_share.items()}}


def _decode(data: dict) -> Calibration:
    cost = None
    if data["cost"] is not None:
        d = data["cost"]
        cost = StepCost([int(b) for b in d["batch_sizes"]], [int(n) for n in d["tree_sizes"]], int(d["prefix_len"]))
        cost.attn_slope = float(d["attn_slope"])
        for (B, N), seconds in d["verify"]:
            cost.set_verify(int(B), int(N), float(seconds))
        for (method, nodes), points in d["draft"]:
            cost.draft[(str(method), int(nodes))] = {int(b): float(t) for b, t in points}
        cost._ratio = {_tuples(k): (float(r), int(n)) for k, r, n in d["ratio"]}
    total = int(data["total_tokens"])
    if total < 1:
        raise ValueError(f"total_tokens {total}")
    return Calibration(total_tokens=total,
                       seconds_per_token={int(n): float(t) for n, t in data["seconds_per_token"]},
                       prior_accept={str(m): float(a) for m, a in dict(data["prior_accept"]).items()},
                       cost=cost,
                       accept_share={str(m): {int(n): float(s) for n, s in shares}
                                     for m, shares in dict(data.get("accept_share", {})).items()})


def _lists(key):
    return [_lists(k) for k in key] if isinstance(key, tuple) else key


def _tuples(key):
    return tuple(_tuples(k) for k in key) if isinstance(key, list) else key
