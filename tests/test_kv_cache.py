"""The static KV cache: what a batch reads is its slots' keys and values, whether the
slots are consecutive (read in place) or scattered (gathered into the reused buffer),
and writes land at each request's own positions."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.kv_cache import AttentionBatch, KVCache
from specdec.models.layers import causal_mask

L, S, H, T, D = 3, 8, 2, 40, 4


@pytest.fixture
def cache():
    c = KVCache(L, S, H, T, D, torch.float32, "cpu")
    c.kv.copy_(torch.randn_like(c.kv))
    return c


@pytest.mark.parametrize("slots", [[3], [0, 1, 2, 3], [2, 3, 4], [5, 1, 6], [0, 2], [7, 6, 5, 4, 3, 2, 1, 0]])
def test_reads_are_the_slots_keys_and_values(cache, slots):
    B, N = len(slots), 3
    prefix = torch.tensor([random.Random(s).randint(0, 20) for s in slots])
    batch = AttentionBatch.build(torch.tensor(slots), prefix, causal_mask(B, N, "cpu"), host_slots=slots)
    consecutive = slots == list(range(slots[0], slots[0] + B))
    assert (batch.first_slot is not None) == consecutive
    for layer in range(L):
        k, v = cache.read(layer, batch)
        assert k.shape == (B, H, batch.key_len, D)
        assert torch.equal(k, cache.kv[layer, 0, slots, :, : batch.key_len])
        assert torch.equal(v, cache.kv[layer, 1, slots, :, : batch.key_len])
        if consecutive:  # in place: the same storage as the cache, laid out as its slice
            assert k.untyped_storage().data_ptr() == cache.kv.untyped_storage().data_ptr()
            assert k.stride() == cache.kv[layer, 0, slots[0]: slots[0] + B, :, : batch.key_len].stride()


def test_an_in_place_read_reaches_the_last_slot_and_position_and_no_further(cache):
    last = AttentionBatch.build(torch.tensor([S - 1]), torch.tensor([T - 1]), causal_mask(1, 1, "cpu"),
                                host_slots=[S - 1])
    k, v = cache.read(L - 1, last)
    assert torch.equal(k, cache.kv[L - 1, 0, S - 1:, :, :T]) and torch.equal(v, cache.kv[L - 1, 1, S - 1:])
    past = AttentionBatch.build(torch.tensor([S - 1]), torch.tensor([T]), causal_mask(1, 1, "cpu"), host_slots=[S - 1])
    with pytest.raises(ValueError, match="outside the cache"):
        cache.read(0, past)  # one key past the cache's positions


def test_a_later_read_reuses_the_gather_buffer(cache):
    slots = [6, 1]
    batch = AttentionBatch.build(torch.tensor(slots), torch.tensor([5, 9]), causal_mask(2, 1, "cpu"))
    k0, _ = cache.read(0, batch)
    k0 = k0.clone()
    k1, _ = cache.read(1, batch)
    assert torch.equal(k1, cache.kv[1, 0, slots, :, : batch.key_len]) and not torch.equal(k0, k1)
    assert cache._gather is not None and cache._gather.numel() == 2 * S * H * T * D  # allocated once


def test_writes_land_at_each_requests_positions(cache):
    slots = [4, 5]
    prefix = torch.tensor([7, 2])
    batch = AttentionBatch.build(torch.tensor(slots), prefix, causal_mask(2, 3, "cpu"), host_slots=slots)
    k = torch.randn(2, H, 3, D)
    v = torch.randn(2, H, 3, D)
    before = cache.kv.clone()
    cache.write(1, batch, k, v)
    for b, (s, p) in enumerate(zip(slots, prefix.tolist())):
        assert torch.equal(cache.kv[1, 0, s, :, p: p + 3], k[b]) and torch.equal(cache.kv[1, 1, s, :, p: p + 3], v[b])
    changed = (cache.kv != before).nonzero()[:, 2].unique().tolist()
    assert changed == slots


@pytest.mark.parametrize("slot, prefix, offset, n", [(0, 0, 0, 1), (5, 7, 0, 3), (2, 11, 4, 2), (7, 30, 0, 10)])
def test_one_requests_write_is_a_slice_that_lands_where_the_indexed_write_does(cache, slot, prefix, offset, n):
    local = torch.ones(1, n, offset + n, dtype=torch.bool).tril(diagonal=offset)  # a chain after `offset` entries
    sliced = AttentionBatch.build(torch.tensor([slot]), torch.tensor([prefix]), local, write_offset=offset,
                                  host_slots=[slot])
    indexed = AttentionBatch.build(torch.tensor([slot]), torch.tensor([prefix]), local, write_offset=offset)
    assert sliced.write_start == prefix + offset and indexed.write_start is None
    k = torch.randn(1, n, H, D).transpose(1, 2)  # [1, H, n, D], strided as the layers give it
    v = torch.randn(1, H, n, D)
    other = KVCache(L, S, H, T, D, torch.float32, "cpu")
    other.kv.copy_(cache.kv)
    cache.write(2, sliced, k, v)
    other.write(2, indexed, k, v)
    assert torch.equal(cache.kv, other.kv)
    assert torch.equal(cache.kv[2, 0, slot, :, prefix + offset: prefix + offset + n], k[0])


def test_only_one_request_with_its_slot_on_the_host_writes_a_slice():
    two = AttentionBatch.build(torch.tensor([2, 3]), torch.tensor([4, 4]), causal_mask(2, 2, "cpu"),
                               host_slots=[2, 3])
    assert two.first_slot == 2 and two.write_start is None


def test_slots_are_taken_lowest_first_and_moved_down():
    from specdec.kv_cache import SlotAllocator

    slots = SlotAllocator(4)  # the docstring's example
    assert [slots.take(), slots.take(), slots.take()] == [0, 1, 2]
    slots.give_back(0)
    slots.move(2, 0)
    assert slots.free == [2, 3] and slots.lowest_free == 2 and slots.take() == 2
    with pytest.raises(AssertionError):
        slots.move(1, 0)  # 0 is held
    slots.give_back(1)
    with pytest.raises(AssertionError):
        slots.give_back(1)  # already free


def test_a_moved_slot_holds_the_first_positions_of_the_other(cache):
    before = cache.kv.clone()
    cache.move_slot(5, 2, 7)
    assert torch.equal(cache.kv[:, :, 2, :, :7], before[:, :, 5, :, :7])
    assert torch.equal(cache.kv[:, :, 2, :, 7:], before[:, :, 2, :, 7:])  # the rest of slot 2 is left as it was
    others = [s for s in range(S) if s != 2]
    assert torch.equal(cache.kv[:, :, others], before[:, :, others])
