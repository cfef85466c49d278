"""The lazily built CPU kernel every kernel module is (`models/cpu_extensions.LazyKernel`):
built once per process however many threads ask at once, a failed build tried once, and
nothing built when its switch turns it off."""
from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "backend_src"))

from specdec.models.cpu_extensions import LazyKernel  # noqa: E402

SWITCH = "SPECDEC_TEST_LAZY_KERNEL"


def counting_build(result, calls: list):
    def build():
        calls.append(1)
        time.sleep(0.05)  # long enough for every thread to ask while it builds
        return result
    return build


def test_threads_asking_at_once_share_one_build():
    calls: list = []
    module = types.ModuleType("specdec_test_kernel_0123")
    kernel = LazyKernel(SWITCH, counting_build(module, calls))
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(kernel.module())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 8 and all(m is module for m in got)
    assert kernel.build_id() == "specdec_test_kernel_0123" and len(calls) == 1


def test_a_failed_build_is_tried_once():
    calls: list = []
    kernel = LazyKernel(SWITCH, counting_build(None, calls))
    assert kernel.module() is None and kernel.module() is None and kernel.build_id() is None
    assert len(calls) == 1


def test_the_switch_at_0_builds_nothing(monkeypatch):
    calls: list = []
    kernel = LazyKernel(SWITCH, counting_build(types.ModuleType("m"), calls))
    monkeypatch.setenv(SWITCH, "0")
    assert not kernel.wanted() and kernel.module() is None and kernel.build_id() is None
    assert not calls
    monkeypatch.setenv(SWITCH, "auto")
    assert kernel.wanted() and kernel.module() is not None and len(calls) == 1
