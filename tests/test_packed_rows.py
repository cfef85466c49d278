"""Drafter weight matrices committed as int8 rows (tools/packed_rows.py): what setup
writes back is the upstream layout, each value within half its row's scale of the
trained one, every other tensor as it was."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import packed_rows  # noqa: E402


def test_quantized_rows_are_within_half_a_step_and_a_zero_row_stays_zero():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 32, generator=gen) * torch.logspace(-3, 1, 64)[:, None]
    rows[5] = 0
    weight, scale = packed_rows.quantize(rows)
    assert weight.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (64,)
    back = packed_rows.dequantize(weight, scale, torch.float32)
    assert ((back - rows).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert (weight.abs().amax(dim=1)[torch.arange(64) != 5] == 127).all()  # each row uses the whole range
    assert torch.equal(back[5], torch.zeros(32))


def _head(folder: Path, D: int = 40, H: int = 16) -> dict:
    gen = torch.Generator().manual_seed(1)
    state = {"fc.weight": torch.randn(H, 3 * H, generator=gen).half(),
             "lm_head.weight": torch.randn(D, H, generator=gen).half(),
             "norm.weight": torch.rand(H, generator=gen).half(),
             "d2t": torch.arange(D) * 2, "t2d": torch.zeros(3 * D, dtype=torch.bool)}
    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"draft_vocab_size": %d}\n' % D)
    (folder / "training.json").write_text("{}\n")
    return state


def test_pack_then_unpack_gives_the_upstream_layout_back(tmp_path):
    state = _head(tmp_path / "trained")
    matrices = ("fc.weight", "lm_head.weight")
    packed_rows.main(["pack", str(tmp_path / "trained"), str(tmp_path / "committed")])
    kept = load_file(str(tmp_path / "committed" / "model.safetensors"))
    assert kept.keys() == state.keys() - set(matrices)
    assert (tmp_path / "committed" / "training.json").is_file()
    packed_file = tmp_path / "committed" / packed_rows.PACKED_FILE
    packed = load_file(str(packed_file))
    assert all(packed[m].dtype == torch.int8 for m in matrices)
    assert packed_file.stat().st_size < 0.6 * sum(state[m].numel() * 2 for m in matrices) + 1024
    packed_rows.main(["unpack", str(tmp_path / "committed"), str(tmp_path / "served")])
    served = load_file(str(tmp_path / "served" / "model.safetensors"))
    assert served.keys() == state.keys()
    for name in state.keys() - set(matrices):
        assert torch.equal(served[name], state[name]), name
    for name in matrices:
        scale = packed[name + packed_rows.SCALE]
        assert served[name].dtype == torch.float32  # the int8 rows' products, exactly
        assert torch.equal(served[name], packed[name].float() * scale[:, None]), name
        error = (served[name] - state[name].float()).abs()
        assert (error <= scale[:, None] / 2 * (1 + 1e-6)).all() and error.max() > 0, name
    assert sorted(p.name for p in (tmp_path / "served").iterdir()) == ["config.json", "model.safetensors"]
    packed_rows.main(["unpack", "--dtype", "float16", str(tmp_path / "committed"), str(tmp_path / "half")])
    half = load_file(str(tmp_path / "half" / "model.safetensors"))  # as setup wrote it before 2026-12-02
    for name in matrices:
        assert half[name].dtype == torch.float16 and torch.equal(half[name], served[name].half()), name


def test_a_folder_without_packed_rows_is_copied_and_one_holding_both_is_refused(tmp_path):
    state = _head(tmp_path / "plain")
    (tmp_path / "out").mkdir()
    packed_rows.unpack(tmp_path / "plain", tmp_path / "out")
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["lm_head.weight"],
                       state["lm_head.weight"])
    packed_rows.pack(tmp_path / "plain", tmp_path / "committed")
    save_file(state, str(tmp_path / "committed" / "model.safetensors"))
    with pytest.raises(ValueError, match="both"):
        packed_rows.unpack(tmp_path / "committed", tmp_path / "out")


def test_weights_of_two_float_dtypes_are_refused(tmp_path):
    state = _head(tmp_path / "mixed")
    save_file({**state, "fc.weight": state["fc.weight"].float()}, str(tmp_path / "mixed" / "model.safetensors"))
    with pytest.raises(ValueError, match="one float dtype"):
        packed_rows.pack(tmp_path / "mixed", tmp_path / "committed")
