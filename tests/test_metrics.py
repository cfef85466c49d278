"""specdec.metrics: engine counters → custom-metric increments, without Triton; and the
counters themselves, from a real engine run (τ and acceptance rate agree with the
requests' own AcceptanceStats)."""
from __future__ import annotations

import pytest

from engine_helpers import code_prompts, make_engine, request, run_batch
from specdec.engine import EngineLoad, EngineMetrics, StepLoad
from specdec.metrics import COUNTERS, GAUGES, CounterExport, gauge_labels, gauge_values, metric_labels


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _as_dict(increments):
    return {(i.spec.field, i.method): i.value for i in increments}


def test_counters_cover_every_engine_counter_and_name_tau():
    assert {s.field for s in COUNTERS} == set(EngineMetrics.__dataclass_fields__)
    assert len({s.name for s in COUNTERS}) == len(COUNTERS)
    assert all(s.name.startswith("specdec_") and s.name.endswith("_total") for s in COUNTERS)
    by_field = {s.field: s for s in COUNTERS}
    assert "τ = emitted_tokens / verify_steps" in by_field["verify_steps"].description
    assert "accepted_draft_tokens / draft_tokens" in by_field["draft_tokens"].description
    assert metric_labels("m", "1", "eagle2") == {"model": "m", "version": "1", "method": "eagle2"}


def test_increments_are_deltas_per_counter_and_method():
    m, export = EngineMetrics(), CounterExport(clock=Clock())
    assert export.increments(m) == []
    m.draft_tokens["eagle2"] += 10
    m.accepted_tokens["eagle2"] += 4
    m.verify_steps.update({"eagle2": 2, "none": 3})
    assert _as_dict(export.increments(m)) == {("draft_tokens", "eagle2"): 10, ("accepted_tokens", "eagle2"): 4,
                                              ("verify_steps", "eagle2"): 2, ("verify_steps", "none"): 3}
    assert export.increments(m) == []  # nothing new
    m.draft_tokens["eagle2"] += 5
    m.requests["medusa"] += 1
    assert _as_dict(export.increments(m)) == {("draft_tokens", "eagle2"): 5, ("requests", "medusa"): 1}


def test_skip_hides_what_was_counted_before():
    m, export = EngineMetrics(), CounterExport(clock=Clock())
    m.requests["eagle2"] += 8  # calibration at load
    export.skip(m)
    assert export.due()  # skipping does not delay the first real export
    m.requests["eagle2"] += 1
    assert _as_dict(export.increments(m)) == {("requests", "eagle2"): 1}


def test_due_rate_limits_but_final_outputs_always_export():
    clock = Clock()
    export = CounterExport(interval_s=1.0, clock=clock)
    assert export.due()
    export.increments(EngineMetrics())
    clock.now = 0.5
    assert not export.due() and export.due(final=True)
    clock.now = 1.0
    assert export.due()


@pytest.fixture(scope="module")
def engine():
    return make_engine(max_batch_size=4)


def test_engine_counters_match_the_requests_stats(engine):
    """Summed over a batch, the exported increments give the same τ and acceptance rate
    as the requests' own AcceptanceStats."""
    export = CounterExport(clock=Clock())
    export.skip(engine.metrics)
    prompts = code_prompts(2, max_tokens=32)
    stats = {}

    reqs = [request(prompts[i % 2], 12, m, rid=m) for i, m in enumerate(("none", "eagle2", "medusa"))]
    for r in reqs:
        engine.submit(r, lambda o, rid=r.request_id: stats.__setitem__(rid, o.stats))
    while engine.num_active:
        engine.step()
    got = _as_dict(export.increments(engine.metrics))
    assert got[("requests", "eagle2")] == got[("requests", "medusa")] == got[("requests", "none")] == 1
    for field, attr in (("draft_tokens", "total_draft_tokens"), ("accepted_tokens", "total_accepted_draft_tokens"),
                        ("verify_steps", "target_forwards"), ("emitted_tokens", "emitted_tokens")):
        total = sum(v for (f, _), v in got.items() if f == field)
        assert total == sum(getattr(s, attr) for s in stats.values()), field
    # Plain decoding drafts nothing; every verify step emits accepted + 1.
    assert got.get(("draft_tokens", "none"), 0) == 0
    assert got[("emitted_tokens", "none")] == got[("verify_steps", "none")]
    for method in ("eagle2", "medusa"):
        steps = got.get(("verify_steps", method), 0)
        if steps:
            assert got[("emitted_tokens", method)] == steps + got.get(("accepted_tokens", method), 0)


def test_run_batch_counts_requests_under_their_method(engine):
    export = CounterExport(clock=Clock())
    export.skip(engine.metrics)
    run_batch(engine, [request(code_prompts(1)[0][:16], 4, "draft_model", rid="d")])
    got = _as_dict(export.increments(engine.metrics))
    assert got[("requests", "draft_model")] == 1


def test_load_gauges_are_tensorrt_llms_and_add_up():
    load = EngineLoad(running=3, waiting=2, slots=4, slot_tokens=2112, iterations=7,
                      last_step=StepLoad(context_requests=1, context_tokens=40, generation_requests=3, unix_time=5.5))
    got = gauge_values(load)
    assert {name for name, _ in got} == {spec.name for spec in GAUGES}
    assert all(name.startswith("nv_trt_llm_") for name, _ in got)
    requests_, blocks, batcher, general = (spec.name for spec in GAUGES)
    assert (got[requests_, "active"], got[requests_, "waiting"], got[requests_, "max"]) == (3, 2, 4)
    assert (got[requests_, "scheduled"], got[requests_, "context"]) == (4, 1)
    assert got[blocks, "used"] + got[blocks, "free"] == got[blocks, "max"] == 4 and got[blocks, "fraction"] == 0.75
    assert (got[batcher, "total_context_tokens"], got[general, "timestamp"]) == (40, 5)
    assert gauge_labels("m", "1", GAUGES[1], "used") == {"model": "m", "version": "1", "kv_cache_block_type": "used"}


def test_the_engine_reports_its_load(engine):
    before = engine.load()
    assert before.running == before.waiting == 0 and before.slots == engine.num_slots
    prompts = code_prompts(2, max_tokens=32)
    for i in range(engine.num_slots + 1):  # one more than the slots: it waits
        engine.submit(request(prompts[i % 2], 6, "eagle2", rid=f"load{i}"), lambda o: None)
    engine.step()
    busy = engine.load()
    assert (busy.running, busy.waiting) == (engine.num_slots, 1)
    assert busy.iterations == before.iterations + 1 and busy.last_step.context_requests == engine.num_slots
    assert busy.last_step.context_tokens == sum(len(prompts[i % 2]) for i in range(engine.num_slots))
    while engine.num_active:
        engine.step()
    idle = engine.load()
    assert (idle.running, idle.waiting) == (0, 0) and idle.last_step.unix_time >= busy.last_step.unix_time
