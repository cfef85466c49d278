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


def test_a_float32_cpu_engine_builds_its_layers_kernels_at_load(monkeypatch):
    """The layer operations and the attention kernel are built while the engine loads, not
    by its first request (each build took 1-2 minutes on a fresh 2-core VM, and a server is
    ready once loaded). A float64 engine takes neither and builds neither; the tree kernel,
    which every CPU engine takes, is built at every CPU load."""
    from engine_helpers import make_engine
    from specdec.models import cpu_attention, cpu_layer_ops
    from specdec.ops import cpu_tree

    calls: list = []
    for module in (cpu_layer_ops, cpu_attention):  # fresh kernels whose builds fail, as without a compiler
        monkeypatch.setattr(module.KERNEL, "cache", {})
        monkeypatch.setattr(module.KERNEL, "_build", counting_build(None, calls))
    tree_calls: list = []
    monkeypatch.setattr(cpu_tree.KERNEL, "cache", {})
    monkeypatch.setattr(cpu_tree.KERNEL, "_build", counting_build(None, tree_calls))
    make_engine(dtype="float64")
    assert calls == [] and len(tree_calls) == 1  # trees are int64 whatever the model's dtype
    make_engine(dtype="float32", max_batch_size=1)
    assert len(calls) == 2 and "module" in cpu_layer_ops.KERNEL.cache and "module" in cpu_attention.KERNEL.cache


def test_checkouts_of_one_source_build_from_one_path(monkeypatch, tmp_path):
    """torch's build file names the source's path, and a build whose file changed rebuilds:
    two checkouts loading in turn rebuilt each other's kernel at every load. The compiler
    reads a copy named after the source's hash instead, the same for both; a changed
    source gets a copy of its own."""
    from torch.utils import cpp_extension

    from specdec.models import cpu_extensions

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(cpu_extensions.platform, "machine", lambda: "x86_64")
    built: list = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, sources, **kw: built.append((name, sources)) or name)
    sources = []
    for checkout, text in (("one", b"int a;"), ("two", b"int a;"), ("three", b"int b;")):
        path = tmp_path / checkout / "kernel.cpp"
        path.parent.mkdir()
        path.write_bytes(text)
        assert cpu_extensions.load(path, "specdec_test", "a test kernel", "nothing") == built[-1][0]
        (source,) = built[-1][1]
        assert Path(source).read_bytes() == text and Path(source).is_relative_to(tmp_path / "extensions")
        sources.append(source)
    assert sources[0] == sources[1] != sources[2]
    assert built[0][0] == built[1][0] != built[2][0]


def test_environments_with_torch_elsewhere_build_apart(monkeypatch):
    """torch's build file names its headers' paths too: a second virtual environment gets a
    build of its own instead of rebuilding the first one's."""
    from torch.utils import cpp_extension

    from specdec.models import cpu_extensions

    here = cpu_extensions.build_name("specdec_test", b"int a;")
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **kw: ["/elsewhere/torch/include"])
    assert cpu_extensions.build_name("specdec_test", b"int a;") != here
