"""The calibration cache (specdec/calibration_cache.py): a second load on the same setup
reuses the first one's calibration instead of measuring again, anything that changes
what calibration measures recalibrates, and no cache problem ever fails a load."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine_helpers import make_engine
from specdec import calibration_cache
from specdec.calibration_cache import cache_dir
from specdec.policy import SpeculationPolicy

# Everything calibration measures: the EAGLE-2 tree size and the step costs. Two slots
# keep the drafters' batch timings (batch 1 only) short.
CALIBRATING = dict(adaptive_speculation=True, eagle_total_tokens=0, max_batch_size=2, max_seq_len=256)
MEASURING = ("_choose_total_tokens", "_time_verify", "_time_drafters")


def engine_in(directory, **overrides):
    return make_engine(**{**CALIBRATING, "calibration_cache_dir": str(directory), **overrides})


def policy_state(engine) -> dict:
    p = engine.policy
    c = p.cost
    return {"total_tokens": p.total_tokens, "calibration": p.calibration, "prior_accept": p.prior_accept,
            "grid": (c.batch_sizes, c.tree_sizes, c.prefix_len, c.attn_slope), "verify": dict(c.verify),
            "draft": c.draft, "ratio": c._ratio}


def forbid_measuring(monkeypatch) -> None:
    def fail(self, engine):
        raise AssertionError("calibrated although the cache holds this setup's calibration")
    for name in MEASURING:
        monkeypatch.setattr(SpeculationPolicy, name, fail)


def cache_files(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("calibration-*.json"))


def copy_routing(source: Path, destination: Path) -> None:
    """The matmul routing saved beside a calibration (routing_cache.py): a restart on the
    same machine reads it back, so a copied calibration must travel with it."""
    for routing in Path(source).glob("row-routing-*.json"):
        (Path(destination) / routing.name).write_bytes(routing.read_bytes())


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A folder holding one engine's calibration, and that engine's policy state."""
    directory = tmp_path_factory.mktemp("calibration")
    engine = engine_in(directory)
    assert engine.policy.cost.ready and engine.policy.calibration and engine.policy.prior_accept
    assert engine.policy.calibration_note.startswith("calibrated in")
    assert "on a chat request" in engine.policy.calibration_note  # calibration_prompt.py
    prompt = engine.policy.calibration_prompt
    assert calibration_cache.fingerprint(engine, {}, prompt) != calibration_cache.fingerprint(engine, {}, None)
    os.environ["SPECDEC_CPU_STREAMED_COMPACT"] = "0"  # every weight read in float32: other costs
    try:
        float32_only = calibration_cache.fingerprint(engine, {}, prompt)
    finally:
        del os.environ["SPECDEC_CPU_STREAMED_COMPACT"]
    assert float32_only != calibration_cache.fingerprint(engine, {}, prompt)
    os.environ["SPECDEC_CPU_ATTENTION"] = "0"  # attention through torch's kernels: other costs
    try:
        torch_attention = calibration_cache.fingerprint(engine, {}, prompt)
    finally:
        del os.environ["SPECDEC_CPU_ATTENTION"]
    assert torch_attention["cpu_attention"] is None
    os.environ["SPECDEC_CPU_LAYER_OPS"] = "0"  # norms, SiLU and RoPE through torch's operators: other costs
    try:
        torch_layer_ops = calibration_cache.fingerprint(engine, {}, prompt)
    finally:
        del os.environ["SPECDEC_CPU_LAYER_OPS"]
    assert torch_layer_ops["cpu_layer_ops"] is None
    with_kernel = calibration_cache.fingerprint(engine, {}, prompt)
    if with_kernel["cpu_attention"] is not None:  # built on this machine
        assert with_kernel["cpu_attention"].startswith("specdec_tree_attention_") and with_kernel != torch_attention
    if with_kernel["cpu_layer_ops"] is not None:
        assert with_kernel["cpu_layer_ops"].startswith("specdec_layer_ops_") and with_kernel != torch_layer_ops
    if engine.row_routing is not None and engine.row_routing.streamed_rows:  # rows timed through the kernel
        assert with_kernel["streamed_build"].startswith("specdec_streamed_linear_")
    else:
        assert with_kernel["streamed_build"] is None
    return directory, policy_state(engine)


def test_a_second_load_reuses_the_calibration(calibrated, monkeypatch):
    directory, first = calibrated
    [path] = cache_files(directory)
    forbid_measuring(monkeypatch)
    engine = engine_in(directory)
    assert policy_state(engine) == first  # exactly: JSON round-trips floats
    assert f"calibration from the cache {path}" in engine.load_note
    assert engine.policy.cost.verify_seconds(2, 8, 100) > 0  # predictions work on the restored grid


def test_a_changed_setup_calibrates_again(calibrated, tmp_path, monkeypatch):
    [path] = cache_files(calibrated[0])
    directory = tmp_path  # a copy: the shared folder keeps holding one file for the other tests
    (directory / path.name).write_bytes(path.read_bytes())
    copy_routing(calibrated[0], directory)
    calls = []
    measure = SpeculationPolicy._time_verify
    monkeypatch.setattr(SpeculationPolicy, "_time_verify", lambda self, e: calls.append(1) or measure(self, e))
    engine = engine_in(directory, max_batch_size=1)
    assert calls and engine.policy.calibration_note.startswith("calibrated in")
    assert len(cache_files(directory)) == 2  # one file per setup; the first one stays
    forbid_measuring(monkeypatch)
    engine_in(directory)  # the first setup still loads from its own file


@pytest.mark.parametrize("damage", ["not json {", '{"fingerprint": 1}', "body"])
def test_a_corrupt_file_is_measured_again_and_rewritten(calibrated, tmp_path, damage):
    directory, first = calibrated
    [path] = cache_files(directory)
    copy = tmp_path / path.name
    copy_routing(directory, tmp_path)
    if damage == "body":  # the right setup, a body that does not decode
        data = json.loads(path.read_text())
        data["cost"]["verify"] = "?"
        copy.write_text(json.dumps(data))
    else:
        copy.write_text(damage)
    engine = engine_in(tmp_path)
    assert engine.policy.calibration_note.startswith("calibrated in")
    assert cache_files(tmp_path) == [copy]
    assert json.loads(copy.read_text())["fingerprint"] == json.loads(path.read_text())["fingerprint"]


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    engine = make_engine(**CALIBRATING, calibration_cache_dir="off")
    assert engine.policy.cost.ready
    assert "(no calibration cache)" in engine.load_note
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_folder_still_loads(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache folder would be inside a file: mkdir fails, even as root
    engine = engine_in(blocker / "cache")
    assert engine.policy.cost.ready
    assert "could not save it" in engine.load_note


def test_configs_that_calibrate_nothing_write_no_calibration(tmp_path):
    engine = make_engine(calibration_cache_dir=str(tmp_path))  # fixed tree, adaptive speculation off
    assert engine.policy.calibration_note is None
    assert cache_files(tmp_path) == []  # (the matmul routing may be saved there: routing_cache.py)


def test_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "specdec-cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("") == tmp_path / "specdec-cache"
    assert cache_dir("/srv/cal") == Path("/srv/cal")
    assert cache_dir("off") is None and cache_dir("OFF") is None
    monkeypatch.delenv("SPECDEC_CACHE_DIR")
    assert cache_dir("") == tmp_path / "xdg" / "specdec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("") == tmp_path / "home" / ".cache" / "specdec"


def test_a_checkpoint_file_that_changes_changes_the_fingerprint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    before = calibration_cache._files(str(tmp_path))
    assert [f[:2] for f in before["files"]] == [["config.json", 2], ["model.safetensors", 10]]
    stat = (tmp_path / "model.safetensors").stat()
    os.utime(tmp_path / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert calibration_cache._files(str(tmp_path)) != before
