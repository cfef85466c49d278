"""The matmul routing cache (`specdec/routing_cache.py`): a routing is measured once per
layer shapes and machine, later loads take the saved one without timing anything, other
shapes measure their own, a corrupt or foreign file is measured over, a folder that
cannot be written is a warning, and with the cache off every load measures."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn as nn

from cpu_kernels import int8_rows_weight
from specdec import routing_cache
from specdec.models import cpu_linear
from specdec.models.cpu_linear import ROW_LADDER, onednn_available, packed_layers, use_packed_cpu_linears
from specdec.routing_cache import cached_row_paths

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def model(width: int = 64) -> list:
    m = nn.Sequential(nn.Linear(width, 96), nn.Linear(96, width, bias=False))
    assert use_packed_cpu_linears(m) == 2
    return packed_layers(m)


@pytest.fixture
def timings(monkeypatch) -> list[int]:
    """Fake timings (oneDNN twice as fast from 8 rows on, an MKL pack paying at 4 rows, so
    1-4 rows pad to it, the streamed kernel the fastest at 6 rows); the list counts the
    timed row counts, so that a test sees whether anything was measured."""
    timed = []

    def time_paths(layers, rows, repeats, mkl=True, streamed=None):
        timed.append(rows)
        if rows >= 8:
            return (10.0, 5.0, 9.9, 9.0)
        return (10.0, 9.8, 7.0 if rows == 4 else 9.9, 8.0 if rows == 6 else float("inf"))
    monkeypatch.setattr(cpu_linear, "_time_paths", time_paths)
    # a saved routing's one-row path re-timed at load: as fast as the copy-free one (it holds)
    monkeypatch.setattr(cpu_linear, "time_routed", lambda layers, rows, repeats: (10.0, 10.0))
    return timed


def test_measured_once_then_read_back(tmp_path, timings):
    first, source = cached_row_paths(model(), tmp_path)
    assert source == "measured at load" and timings == list(ROW_LADDER)
    assert first.onednn_rows == frozenset(r for r in ROW_LADDER if r >= 8) and first.streamed_rows == {6}
    if first.packs:  # a torch build with MKL's packed gemm
        assert dict(first.packs) == {1: 4, 2: 4, 3: 4, 4: 4}
    [saved] = tmp_path.glob("row-routing-*.json")
    timings.clear()
    layers = model()
    again, source = cached_row_paths(layers, tmp_path)
    assert source == "measured at an earlier load" and timings == []  # nothing timed
    assert again == first and all(m.routing == first for m in layers)
    assert json.loads(saved.read_text())["onednn_rows"] == sorted(first.onednn_rows)
    assert json.loads(saved.read_text())["streamed_rows"] == [6]


@pytest.mark.parametrize("first_packs,then_packs", [("3", "0"), ("0", "3")])
def test_another_pack_limit_measures_its_own(tmp_path, timings, monkeypatch, first_packs, then_packs):
    monkeypatch.setenv("SPECDEC_CPU_MKL_PACKS", "3")
    if not cpu_linear.mkl_packs_allowed():
        pytest.skip("this torch build has no MKL packed gemm")
    monkeypatch.setenv("SPECDEC_CPU_MKL_PACKS", first_packs)
    first, _ = cached_row_paths(model(), tmp_path)
    monkeypatch.setenv("SPECDEC_CPU_MKL_PACKS", then_packs)
    timings.clear()
    again, source = cached_row_paths(model(), tmp_path)
    assert source == "measured at load" and timings
    assert bool(again.packs) == (then_packs != "0") and bool(first.packs) == (first_packs != "0")
    monkeypatch.setenv("SPECDEC_CPU_MKL_PACKS", first_packs)
    timings.clear()
    assert cached_row_paths(model(), tmp_path) == (first, "measured at an earlier load") and not timings


def test_other_shapes_measure_their_own(tmp_path, timings):
    cached_row_paths(model(64), tmp_path)
    timings.clear()
    _, source = cached_row_paths(model(32), tmp_path)
    assert source == "measured at load" and timings
    assert len(list(tmp_path.glob("row-routing-*.json"))) == 2


@pytest.mark.parametrize("damage", ["not json", json.dumps({"fingerprint": "another machine"}),
                                    "keys", "off the ladder", "pack off the ladder", "streamed off the ladder"])
def test_a_bad_file_is_measured_over(tmp_path, timings, damage, caplog):
    cached_row_paths(model(), tmp_path)
    [saved] = tmp_path.glob("row-routing-*.json")
    data = json.loads(saved.read_text())
    if damage == "keys":
        damage = json.dumps({"fingerprint": data["fingerprint"]})
    elif damage == "off the ladder":
        damage = json.dumps({**data, "onednn_rows": [5]})
    elif damage == "pack off the ladder":
        damage = json.dumps({**data, "packs": [[4, 5]]})
    elif damage == "streamed off the ladder":
        damage = json.dumps({**data, "streamed_rows": [5]})
    saved.write_text(damage)
    timings.clear()
    with caplog.at_level(logging.WARNING, logger="specdec"):
        routing, source = cached_row_paths(model(), tmp_path)
    assert source == "measured at load" and timings == list(ROW_LADDER)
    assert json.loads(saved.read_text())["onednn_rows"] == sorted(routing.onednn_rows)  # written again


@pytest.mark.parametrize("routed_ms,copy_free_ms,measured_again", [
    (12.4, 10.0, False), (12.6, 10.0, True), (40.0, 10.0, True), (8.0, 10.0, False),
    (1.9, 1.0, False)])  # 90 % slower, but by less than STALE_MIN_MS: a tiny model's noise
def test_a_saved_routing_slower_at_one_row_than_a_copy_free_path_is_measured_again(
        tmp_path, timings, monkeypatch, caplog, routed_ms, copy_free_ms, measured_again):
    """At each later load the saved routing's path for one row is timed against the
    copy-free paths: more than STALE_MARGIN (25 %) and STALE_MIN_MS (1 ms) slower, and the
    routing is measured again and saved over; otherwise (or faster, as a copy that was
    worth making is) the saved one stands."""
    first, _ = cached_row_paths(model(), tmp_path)
    [saved] = tmp_path.glob("row-routing-*.json")
    rechecked = []

    def time_routed(layers, rows, repeats):
        rechecked.append((len(layers), rows))
        return routed_ms, copy_free_ms
    monkeypatch.setattr(cpu_linear, "time_routed", time_routed)
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "onednn_rows": []}))  # as a busy load saved it
    timings.clear()
    layers = model()
    with caplog.at_level(logging.WARNING, logger="specdec"):
        routing, source = cached_row_paths(layers, tmp_path)
    assert rechecked == [(2, 1)]  # both layers, one row
    if measured_again:
        assert source == "measured at load" and timings == list(ROW_LADDER) and routing == first
        assert json.loads(saved.read_text())["onednn_rows"] == sorted(first.onednn_rows)  # saved over
        assert "measuring again" in caplog.text
    else:
        assert source == "measured at an earlier load" and timings == [] and not routing.onednn_rows
    assert all(m.routing == routing for m in layers)


def test_time_routed_times_the_routing_and_the_copy_free_paths(monkeypatch):
    """The re-check's timing calls the layers themselves (the same per-call cost on
    every path), through their routing (here a 4-row MKL pack for one row, made in its
    untimed pass), then through F.linear and the streamed kernel; the routing is theirs
    again after, with no compact copy left where it does not take the kernel."""
    if not cpu_linear.mkl_packs_allowed():
        pytest.skip("this torch build has no MKL packed gemm")
    layers = model()
    routing = cpu_linear.RowRouting(frozenset(), packs=((1, 4),))
    cpu_linear.route(layers, routing)
    seen = []
    real = cpu_linear.PackedCpuLinear.forward

    def spy(self, x):
        seen.append((self.routing.pack_rows(1), self.routing.streamed(1), self._streamed is not None))
        return real(self, x)
    monkeypatch.setattr(cpu_linear.PackedCpuLinear, "forward", spy)
    routed_ms, copy_free_ms = cpu_linear.time_routed(cpu_linear._called(layers), 1, repeats=1)
    assert 0 < routed_ms < 1e3 and 0 < copy_free_ms < 1e3
    paths = {(4, False, False), (None, False, False)}  # the pack, F.linear
    if cpu_linear.streamed_kernel_for(layers) is not None:
        paths.add((None, True, True))
    assert set(seen) == paths and len(seen) == 2 * 2 * len(paths)  # 2 layers, 2 passes, each path
    assert all(set(m._mkl_packs) == {4} for m in layers)  # the routed path ran
    assert all(m.routing is routing and m._streamed is None and m._streamed_weight is None for m in layers)


def test_cache_off_or_unwritable_still_routes(tmp_path, timings, caplog):
    routing, source = cached_row_paths(model(), None)
    assert source == "measured at load" and routing.onednn_rows
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be: the write fails
    with caplog.at_level(logging.WARNING, logger="specdec"):
        routing, source = cached_row_paths(model(), blocked / "cache")
    assert source == "measured at load" and routing.onednn_rows
    assert "cannot write the matmul routing cache" in caplog.text


def test_environment_override_measures_nothing(tmp_path, timings, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_ONEDNN", "1")
    assert cached_row_paths(model(), tmp_path) == (None, "not measured")
    assert timings == [] and not list(tmp_path.iterdir())


def test_fingerprint_names_the_machine_and_the_shapes():
    fp = routing_cache.fingerprint(model())
    assert fp["layers"] == [[64, 96, 1], [96, 64, 0]]
    assert fp["cpu"] and fp["threads"] >= 1 and fp["torch"]


def test_fingerprint_names_the_streamed_kernel_it_could_time(monkeypatch):
    """A routing measured without the streamed kernel (not built, or turned off) is not
    read back by a load that has it, nor the other way round."""
    with_kernel = routing_cache.fingerprint(model())
    monkeypatch.setenv("SPECDEC_CPU_STREAMED", "0")
    without = routing_cache.fingerprint(model())
    assert without["streamed"] is None
    if with_kernel["streamed"] is not None:
        assert with_kernel["streamed"].startswith("specdec_streamed_linear_") and with_kernel != without
    odd = routing_cache.fingerprint(model(width=72))  # 72 inputs: not a multiple of 16, never streamed
    monkeypatch.delenv("SPECDEC_CPU_STREAMED")
    assert odd["streamed"] is None and routing_cache.fingerprint(model(width=72))["streamed"] is None


def test_fingerprint_names_the_form_the_kernel_reads_each_weight_in():
    """A routing timed on a head set up in float16 is not read back for the same shapes
    set up as int8 rows (tools/packed_rows.py), which the kernel reads in half the bytes."""
    layers = model()
    if routing_cache.fingerprint(layers)["streamed"] is None:
        pytest.skip("no streamed kernel here: the forms are not timed")
    for m in layers:
        m.weight.data = m.weight.data.half().float()
    half = routing_cache.fingerprint(layers)
    for m in layers:
        m.weight.data = int8_rows_weight(*m.weight.shape)
    rows = routing_cache.fingerprint(layers)
    assert half["forms"] == ["float16", "float16"] and rows["forms"] == ["int8", "int8"]
    assert half["layers"] == rows["layers"] and half != rows


def test_fingerprint_says_whether_the_kernel_reads_compact_copies(monkeypatch):
    """Timings taken with compact copies of exact weights are not read back by a load that
    keeps every weight in float32 (SPECDEC_CPU_STREAMED_COMPACT=0), nor the other way."""
    compact = routing_cache.fingerprint(model())
    monkeypatch.setenv("SPECDEC_CPU_STREAMED_COMPACT", "0")
    float32_only = routing_cache.fingerprint(model())
    assert compact["streamed_compact"] is True and float32_only["streamed_compact"] is False
    assert compact != float32_only
