"""The KV-cache budget: slots are what fits (max_batch_size, kv_cache_max_tokens, the
GPU's free memory x kv_cache_free_gpu_mem_fraction); requests beyond the slots wait
and finish with the same output; nothing fits: a load error that says why."""
from __future__ import annotations

import pytest

from engine_helpers import code_prompts, make_engine, request
from specdec.errors import ConfigError
from specdec.memory import MIB, kv_budget


def test_budget_takes_the_smallest_limit():
    assert kv_budget(8, slot_bytes=MIB, positions=100).slots == 8
    b = kv_budget(8, slot_bytes=MIB, positions=100, max_tokens=350)
    assert (b.slots, b.limited_by) == (3, "kv_cache_max_tokens")
    b = kv_budget(8, slot_bytes=MIB, positions=100, free_bytes=10 * MIB, fraction=0.5)
    assert (b.slots, b.limited_by) == (5, "kv_cache_free_gpu_mem_fraction")
    b = kv_budget(8, slot_bytes=MIB, positions=100, max_tokens=10_000, free_bytes=100 * MIB, fraction=0.9)
    assert (b.slots, b.limited_by) == (8, "max_batch_size")


def test_nothing_fits_is_a_clear_load_error():
    with pytest.raises(ConfigError, match=r"needs 64.0 MiB .*=0.5 of the 100.0 MiB free .* is 50.0 MiB"):
        kv_budget(8, slot_bytes=64 * MIB, positions=1000, free_bytes=100 * MIB, fraction=0.5)
    with pytest.raises(ConfigError, match="kv_cache_max_tokens=500 holds no request: one request needs 1000"):
        kv_budget(8, slot_bytes=MIB, positions=1000, max_tokens=500)


def test_requests_beyond_the_budget_wait_for_a_slot():
    max_seq_len = 256
    engine = make_engine(dtype="float64", max_seq_len=max_seq_len, max_batch_size=4,
                         kv_cache_max_tokens=2 * (max_seq_len + 1))
    assert engine.num_slots == 2 and engine.cache.kv.shape[2] == 2
    assert all(d.cache.kv.shape[2] == 2 for d in engine.drafters.values() if hasattr(d, "cache"))
    prompts = code_prompts(4, max_tokens=48)
    alone = [engine.generate(request(p, 24, "eagle2"))[0] for p in prompts]
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    done: set[str] = set()

    def emitter(rid):
        def emit(o):
            outs[rid].extend(o.token_ids)
            if o.finished:
                assert o.finish_reason == "length", o.error
                done.add(rid)
        return emit

    for i, p in enumerate(prompts):
        engine.submit(request(p, 24, "eagle2", rid=f"r{i}"), emitter(f"r{i}"))
    most = 0
    while len(done) < 4:
        engine.step()
        most = max(most, len(engine._running))
    assert most == 2
    assert [outs[f"r{i}"] for i in range(4)] == alone


def test_a_budget_below_one_request_fails_the_load():
    with pytest.raises(ConfigError, match="holds no request"):
        make_engine(max_seq_len=256, kv_cache_max_tokens=100)
