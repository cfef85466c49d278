"""Freed host memory stays with the process (host_memory.py): a tensor bigger than
glibc's largest mmap threshold, freed and allocated again, lands on pages already
mapped instead of pages the kernel faults in again; the engine sets this at load on
the CPU unless `keep_host_memory` is false."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import specdec.engine as engine_module
from engine_helpers import make_engine
from specdec import host_memory
from specdec.config import EngineConfig

BACKEND_SRC = Path(host_memory.__file__).resolve().parents[1]

# In a fresh process (this one's malloc has been set by the engines the tests load):
# minor page faults over 20 rounds of allocating and freeing two 48 MB tensors, after
# 12 rounds that warm the heap.
FAULTS_SCRIPT = """
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
from specdec.host_memory import keep_freed_memory
note = keep_freed_memory() if sys.argv[2] == "keep" else None
def one_round():
    torch.ones(12 * 2**20).sum()  # freed below a small block (mmap's case)
    x = torch.ones(12 * 2**20)
    del x  # freed at the heap's top (trimming's case)
for _ in range(12):  # the heap grows until the round's blocks fit in what earlier rounds freed
    one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    one_round()
print(json.dumps({"note": note, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""
PAGES = 48 * 2**20 // 4096  # one tensor's 4 KB pages


def _faults(setting: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, str(BACKEND_SRC), setting],
                         capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc's malloc only")
def test_a_freed_big_tensor_is_reused_without_page_faults():
    returned = _faults("return")
    assert returned["note"] is None
    assert returned["faults"] > 20 * PAGES, returned  # glibc's own: each round maps the tensor afresh
    kept = _faults("keep")
    assert "no mmap" in kept["note"]
    assert kept["faults"] < PAGES // 4, kept


def test_the_engine_keeps_host_memory_on_the_cpu_unless_told_not_to(monkeypatch):
    calls = []
    monkeypatch.setattr(engine_module, "keep_freed_memory", lambda: calls.append(1) or "kept for the test")
    assert "kept for the test" in make_engine().load_note
    assert calls == [1]
    assert "kept for the test" not in make_engine(keep_host_memory=False).load_note
    assert calls == [1]


def test_keep_host_memory_is_a_config_parameter(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert EngineConfig.from_params({"base_model_dir": str(tmp_path)}).keep_host_memory is True
    assert EngineConfig.from_params({"base_model_dir": str(tmp_path), "keep_host_memory": "false"}
                                    ).keep_host_memory is False
