"""What a step makes the host wait for, counted on CPU (tests/sync_probe.py).

On a GPU the step should queue all its work and wait once: when it reads the accepted
tokens back to emit them (and once per prefill group, for the first tokens). Every
other device value read on the host, and every host-to-device copy that is not
staged through `specdec/transfer.py`, would stall the CPU until the GPU drained its
queue. The same code runs on CPU, so counting here proves what a GPU step does.
"""
from __future__ import annotations

import linecache
from pathlib import Path

import pytest
import torch

from engine_helpers import code_prompts, make_engine, request
from specdec.transfer import to_device
from sync_probe import SyncProbe

PACKAGE = Path(__file__).resolve().parent.parent / "backend_src" / "specdec"
METHODS = ["none", "eagle2", "eagle3", "eagle", "medusa", "draft_model"]


def _source(site: str) -> str:
    path, line = site.rsplit(":", 1)
    return linecache.getline(str(PACKAGE / path), int(line)).strip()


def _assert_only_the_emit_reads(probe: SyncProbe, expected: int) -> None:
    assert not probe.blocking, f"blocking host-to-device copies: {dict(probe.blocking)}"
    assert sum(probe.syncs.values()) == expected, {s: (n, _source(s)) for s, n in probe.syncs.items()}
    for site in probe.syncs:
        assert site.startswith("engine.py:") and ".tolist()" in _source(site), (site, _source(site))


@pytest.fixture(autouse=True)
def kernel_stand_ins(monkeypatch):
    """On a GPU the engine verifies sampled trees with kernels/verify_sampling.cu, whose
    launcher reads only shapes (test_kernel_launchers_wait_for_nothing, GPU only); on
    CPU its torch twin runs, whose loop decides on the host. The twin stands in for the
    kernel here, unseen by the probe."""
    import specdec.engine as engine_module
    twin = engine_module.verify_sampling

    def kernel(*args):
        probe = SyncProbe.active
        if probe is None:
            return twin(*args)
        with probe.paused():
            return twin(*args)
    monkeypatch.setattr(engine_module, "verify_sampling", kernel)


@pytest.fixture(autouse=True)
def gpu_truncation(monkeypatch):
    """On the CPU, top-k/top-p rank a few candidates and read back which rows need the
    whole vocabulary (sampling.probabilities), a read that costs a CPU nothing; a GPU
    ranks the whole vocabulary instead, without reading. The probe sees the GPU's way."""
    import specdec.sampling as sampling_module
    monkeypatch.setattr(sampling_module, "reads_are_free", lambda device: False)


def _running_engine(reqs, steps: int = 3):
    engine = make_engine(dtype="float32", max_batch_size=8)
    for r in reqs:
        engine.submit(r, lambda out: None)
    for _ in range(steps):  # admission + prefill, then steady state with every drafter caught up
        engine.step()
    assert len(engine._running) == len(reqs)
    return engine


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", METHODS)
def test_a_decode_step_waits_once(method, sampled):
    prompts = code_prompts(4, max_tokens=48)
    kw = dict(temperature=0.8, top_p=0.9, seed=3) if sampled else {}
    engine = _running_engine([request(p, 64, method, rid=str(i), **kw) for i, p in enumerate(prompts)])
    with SyncProbe() as probe:
        engine.step()
    _assert_only_the_emit_reads(probe, 1)


def test_a_mixed_step_with_log_probs_and_a_newcomer_waits_twice():
    """Every method in one batch, greedy and sampled rows, log-probs, a bad word and
    min_tokens, and a request admitted in the same step: one read for its prefill, one
    for the step."""
    prompts = code_prompts(7, max_tokens=48)
    reqs = [request(p, 64, m, rid=m, return_log_probs=True) for p, m in zip(prompts, METHODS)]
    reqs[1] = request(prompts[1], 64, "eagle2", rid="eagle2", temperature=0.7, seed=5, return_log_probs=True)
    reqs[2] = request(prompts[2], 64, "eagle3", rid="eagle3", bad_words=[[13]], min_tokens=40, end_id=2)
    engine = _running_engine(reqs)
    engine.submit(request(prompts[6], 64, "eagle2", rid="late"), lambda out: None)
    with SyncProbe() as probe:
        engine.step()
    assert len(engine._running) == 7
    _assert_only_the_emit_reads(probe, 2)


def test_every_graphed_forward_is_capturable():
    """What a CUDA graph records (`DecodeGraphs._run`) reads nothing back and copies
    nothing from the host (either would fail a capture), for every bucket that serving
    mixed methods created: the target's verify forwards, the EAGLE-2/3 heads' depth
    expansions and catch-ups, the draft model's chain. Feeding a graph (`forward`:
    copies into its buffers) stalls nothing either."""
    prompts = code_prompts(4, max_tokens=48)
    engine = make_engine(dtype="float32", max_batch_size=8, cuda_graph_mode=True, cuda_graph_max_batch_size=4)
    reqs = [request(p, 24, m, rid=m) for p, m in zip(prompts, ["eagle2", "eagle3", "draft_model", "medusa"])]
    for r in reqs:
        engine.submit(r, lambda out: None)
    for _ in range(4):
        engine.step()
    components = {"target": engine.graphs, "eagle2": engine.drafters["eagle2"].graphs,
                  "eagle3": engine.drafters["eagle3"].graphs, "draft_model": engine.drafters["draft_model"].graphs}
    with SyncProbe() as probe:
        engine.step()
    _assert_only_the_emit_reads(probe, 1)
    for name, graphs in components.items():
        assert graphs.graphs, f"{name}: nothing graphed"
        for key, g in graphs.graphs.items():
            with torch.inference_mode(), SyncProbe() as probe:
                graphs._run(g)
            assert not probe.syncs and not probe.blocking, (name, key, dict(probe.syncs), dict(probe.blocking))


def test_the_graphed_drafting_loop_is_capturable():
    """EAGLE-2/3's whole drafting loop (`CapturedCalls`, graphs.py) reads nothing back and
    copies nothing from the host, not even through transfer.py, in every call that
    serving greedy and sampled requests of both methods made (batches padded to a bucket
    among them)."""
    prompts = code_prompts(4, max_tokens=48)
    engine = make_engine(dtype="float32", max_batch_size=8, cuda_graph_mode=True, cuda_graph_max_batch_size=4)
    calls = []
    for method in ("eagle2", "eagle3"):
        loop = engine.drafters[method].loop_graphs
        function = loop._function

        def probed(key, _function=function, _method=method, **inputs):
            with SyncProbe(staged_ok=False) as probe:
                out = _function(key, **inputs)
            calls.append((_method, key, dict(probe.syncs), dict(probe.blocking)))
            return out
        loop._function = probed
    reqs = [request(p, 24, m, rid=str(i), **kw) for i, (p, m, kw) in enumerate(zip(
        prompts, ["eagle2", "eagle3", "eagle2", "eagle3"], [{}, {}, dict(temperature=0.8, seed=1), {}]))]
    for r in reqs:
        engine.submit(r, lambda out: None)
    for _ in range(6):
        engine.step()
    assert {c[0] for c in calls} == {"eagle2", "eagle3"} and any(c[1][0] > 1 for c in calls), calls
    assert all(not syncs and not blocking for _, _, syncs, blocking in calls), calls


def test_the_probe_sees_what_it_must():
    """Negative controls: each kind of stall the probe exists to find is found, and
    transfers staged through transfer.py are not."""
    x = torch.arange(6)
    with SyncProbe(scope="/tests/") as probe:
        x[2].item()  # a sync
        x.tolist()  # a sync
        x[x > 2]  # a sync: the output size depends on values
        torch.tensor([1, 2])  # a blocking copy on a GPU
        x.to("cpu")  # a blocking copy on a GPU
        to_device([1, 2], x.device)  # staged: not blocking
        x.to(torch.float32)  # no device named: not a copy across devices
    assert sum(probe.syncs.values()) == 3 and sum(probe.blocking.values()) == 2, (probe.syncs, probe.blocking)
    with SyncProbe(scope="/tests/", staged_ok=False) as strict:
        to_device([1, 2], x.device)  # staged, but still a copy from the host
    assert sum(strict.blocking.values()) == 1, strict.blocking


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's sync debug mode)")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_on_a_gpu_a_step_synchronizes_once(graphs):
    """The CPU probe's claim checked by CUDA itself: torch's sync debug mode warns at
    every synchronizing call (D2H reads, pageable H2D copies). A decode step of mixed
    methods, greedy and sampled, with the real kernels, warns once."""
    import warnings
    prompts = code_prompts(6, max_tokens=48)
    engine = make_engine(device="cuda", dtype="float16", max_batch_size=8, cuda_graph_mode=graphs)
    reqs = [request(p, 64, m, rid=m) for p, m in zip(prompts, METHODS)]
    reqs[1] = request(prompts[1], 64, "eagle2", rid="eagle2", temperature=0.7, seed=5)
    for r in reqs:
        engine.submit(r, lambda out: None)
    for _ in range(4):  # graphs capture their bucket in an early step
        engine.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]  # not the "prototype" notice
    assert len(syncs) == 1, syncs
