"""A static KV cache shared by all requests: one slot per running request.

Layout `kv[L, 2, S, H_kv, T_max, D]` (layers, key/value, slots, KV heads, positions,
head dim), allocated once at load. New tokens of a forward are written at absolute
positions `prefix_len + t` of their request's slot (gpt-fast style), so a tree of
draft tokens is written right after the committed prefix and, after verification,
`ops.kv_compact` moves the accepted path down in place. Nothing grows per step.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .errors import InputError
from .models import cpu_layer_ops


@dataclass
class AttentionBatch:
    """Where a forward's tokens sit, built once per forward and shared by all layers.

    Worked example (one request, prefix 3 cached tokens, 2 new chain tokens):
        prefix_len [3], write_pos [[3, 4]], key_len 5,
        mask row 0: [1 1 1 1 0], row 1: [1 1 1 1 1]
    """

    slots: torch.Tensor  # [B] int64 cache slot of each request
    write_pos: torch.Tensor  # [B, T] int64 cache position of each new token
    mask: torch.Tensor  # [B, 1, T, key_len] bool: query t may attend to key s
    key_len: int  # keys read per request: max(prefix_len) + T
    first_slot: Optional[int] = None  # set when slots are first_slot, first_slot + 1, ...: reads are views
    static: bool = False  # a graph's buffers: reads never depend on the slots' values on the host (graphs.py)
    # One request whose slot and first write position the host knows (`first_slot`): its
    # T tokens go to positions [write_start, write_start + T), written as a slice.
    write_start: Optional[int] = None
    _additive: Optional[torch.Tensor] = field(default=None, repr=False)  # additive_mask's, made once

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """`mask` as `scaled_dot_product_attention` adds it to the scores: 0 where a query
        may attend, -inf elsewhere, in `dtype` [B, 1, T, key_len]; made at the first call
        and shared by every layer of the forward. Given the bool mask, the CPU kernel makes
        this itself at every call: with 8 queries over 250 keys it took 171 µs against
        152 (ad hoc, 2-core Xeon, float32), the same results."""
        if self._additive is None or self._additive.dtype != dtype:
            self._additive = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self._additive

    @staticmethod
    def build(slots: torch.Tensor, prefix_len: torch.Tensor, local_mask: torch.Tensor,
              write_offset: int = 0, host_slots: Optional[Sequence[int]] = None,
              max_prefix: Optional[int] = None) -> "AttentionBatch":
        """Keys `[0, prefix_len)` are visible to every new token; keys in the window
        `[prefix_len, prefix_len + W)` are visible as `local_mask[B, T, W]` says (causal
        for a chain, ancestors for a tree). The T new tokens are written at
        `prefix_len + write_offset + t`, so `W == write_offset + T`: a drafter that
        grows a tree depth by depth writes each depth after the last one. `host_slots`
        (the slots as a host list, when the caller has them) lets consecutive slots be
        read in place instead of gathered; `max_prefix` (`prefix_len.max()`, when the
        caller knows it on the host) spares a device-to-host sync."""
        B, T, W = local_mask.shape
        assert W == write_offset + T, (W, write_offset, T)
        assert slots.shape == (B,) and prefix_len.shape == (B,), (slots.shape, prefix_len.shape)
        device = local_mask.device
        if max_prefix is None:  # a host sync: the largest prefix fixes the key length
            max_prefix = int(prefix_len.max().item())
        key_len = max_prefix + W
        window = prefix_len[:, None] + torch.arange(W, device=device)[None, :]  # [B, W]
        mask = torch.arange(key_len, device=device)[None, None, :] < prefix_len[:, None, None]
        mask = mask.expand(B, T, key_len).clone()
        mask.scatter_(2, window[:, None, :].expand(B, T, W), local_mask)
        first = None
        if host_slots is not None and list(host_slots) == list(range(host_slots[0], host_slots[0] + B)):
            first = int(host_slots[0])
        return AttentionBatch(slots=slots, write_pos=window[:, write_offset:], mask=mask[:, None], key_len=key_len,
                              first_slot=first,
                              write_start=max_prefix + write_offset if B == 1 and first is not None else None)

    @staticmethod
    def build_static(slots: torch.Tensor, prefix_len: torch.Tensor, local_mask: torch.Tensor, write_offset: int,
                     key_len: int) -> "AttentionBatch":
        """`build` for a forward inside a CUDA graph: the key length is fixed by the
        caller (`max(prefix_len) + W <= key_len` for every real row) and nothing is read
        on the host. A row whose prefix reaches `key_len` (a graph's padding row, whose
        prefix is the slot's spare positions) sees every key and writes past them.

            prefix_len [2], W 2, key_len 6, local row [1 1]  ->  mask [1 1 1 1 0 0]
        """
        B, T, W = local_mask.shape
        assert W == write_offset + T, (W, write_offset, T)
        device = local_mask.device
        rel = torch.arange(key_len, device=device)[None] - prefix_len[:, None]  # [B, K] key s - prefix
        in_window = (rel >= 0) & (rel < W)
        local = local_mask.gather(2, rel.clamp(0, W - 1)[:, None, :].expand(B, T, key_len))  # [B, T, K]
        mask = (rel < 0)[:, None, :] | (in_window[:, None, :] & local)
        write_pos = prefix_len[:, None] + write_offset + torch.arange(T, device=device)[None]  # [B, T]
        return AttentionBatch(slots=slots, write_pos=write_pos, mask=mask[:, None], key_len=key_len, static=True)


class KVCache:
    """The static cache of one model (target or drafter)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.max_len = max_len
        self.num_slots = num_slots
        self.kv = torch.zeros(num_layers, 2, num_slots, num_kv_heads, max_len, head_dim,
                              dtype=dtype, device=device)
        self._gather: Optional[torch.Tensor] = None  # [2, slots x H x T x D]: read's buffer for scattered slots

    def write(self, layer: int, batch: AttentionBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, H_kv, T, D] for the forward's new tokens. One request's go in as a
        slice (`batch.write_start`): on the 2-core Xeon an indexed write of 8 tokens took
        107 µs and a slice's copy 75, right after a weight stream (60 writes a forward;
        ad hoc)."""
        if batch.write_start is not None:
            s, start, T = batch.first_slot, batch.write_start, k.shape[2]
            kernel = cpu_layer_ops.kernel_for(self.kv, k, v)
            if kernel is not None:  # one call on the CPU (models/cpu_layer_ops.py); the two lines below are its twin
                kernel.write_kv(self.kv, layer, s, start, k[0].contiguous(), v[0].contiguous())
                return
            self.kv[layer, 0, s, :, start: start + T].copy_(k[0])
            self.kv[layer, 1, s, :, start: start + T].copy_(v[0])
            return
        index = (batch.slots[:, None], slice(None), batch.write_pos)
        self.kv[layer, 0][index] = k.transpose(1, 2).to(self.kv.dtype)
        self.kv[layer, 1][index] = v.transpose(1, 2).to(self.kv.dtype)

    def read(self, layer: int, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H_kv, key_len, D] of the batch's slots: views of the cache
        when the slots are consecutive (one request, or `batch.first_slot`), else
        gathered into a buffer allocated once and reused by every layer and step
        (allocating ~MBs per layer per step cost more than the attention on CPU)."""
        B, n = batch.slots.shape[0], batch.key_len
        if B == 1 and batch.first_slot is None and not batch.static:
            s = batch.slots[0]
            return self.kv[layer, 0, s, :, :n][None], self.kv[layer, 1, s, :, :n][None]
        if batch.first_slot is not None:
            # The views `self.kv[layer, part, first : first + B, :, :n]` made in one call each:
            # indexing makes five views a read (7.5 µs a layer on the 2-core Xeon against 3.5,
            # 30 reads a forward; ad hoc)
            if not (0 <= batch.first_slot and batch.first_slot + B <= self.num_slots and n <= self.max_len):
                raise ValueError(f"slots [{batch.first_slot}, {batch.first_slot + B}) or {n} keys outside the cache")
            layer_stride, part_stride, *view_strides = self.kv.stride()
            offset = self.kv.storage_offset() + layer * layer_stride + batch.first_slot * view_strides[0]
            shape = (B, self.kv.shape[3], n, self.kv.shape[5])
            return (self.kv.as_strided(shape, view_strides, offset),
                    self.kv.as_strided(shape, view_strides, offset + part_stride))
        self.reserve_gather()
        H, D = self.kv.shape[3], self.kv.shape[5]
        k = self._gather[0, : B * H * n * D].view(B, H, n, D)
        v = self._gather[1, : B * H * n * D].view(B, H, n, D)
        torch.index_select(self.kv[layer, 0, :, :, :n], 0, batch.slots, out=k)
        torch.index_select(self.kv[layer, 1, :, :, :n], 0, batch.slots, out=v)
        return k, v

    def move_slot(self, source: int, to: int, length: int) -> None:
        """Copies the first `length` positions of slot `source` into slot `to`, every layer."""
        if length > 0:
            self.kv[:, :, to, :, :length] = self.kv[:, :, source, :, :length]

    def reserve_gather(self) -> None:
        if self._gather is None:
            self._gather = torch.empty(2, self.kv[0, 0].numel(), dtype=self.kv.dtype, device=self.kv.device)


class SlotAllocator:
    """Free list of cache slots: the scheduler takes the lowest free one per admitted
    request, and `move` hands a request's slot down into a free lower one
    (`Engine._pack_slots` keeps the running requests in the lowest slots).

        4 slots: take 0, take 1, take 2; give_back 0; move 2 -> 0; free: 2, 3
    """

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots))  # ascending

    def take(self) -> int:
        if not self.free:
            raise InputError("no free KV-cache slot")
        return self.free.pop(0)

    def give_back(self, slot: int) -> None:
        assert slot not in self.free, f"slot {slot} freed twice"
        bisect.insort(self.free, slot)

    def move(self, held: int, to: int) -> None:
        """The request holding `held` now holds `to` (which was free); `held` is free."""
        assert to in self.free and held not in self.free, (held, to, self.free)
        self.free.remove(to)
        bisect.insort(self.free, held)

    @property
    def available(self) -> int:
        return len(self.free)

    @property
    def lowest_free(self) -> int:
        return self.free[0]
