"""tools/bench/profile_step.py on the tiny family (CPU): its phase rows nest as the engine's
calls do, plain decoding drafts nothing, both passes decode the same tokens, and the
engine's classes are left as they were."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "bench"))

import profile_step  # noqa: E402
from engine_helpers import FAMILY  # noqa: E402
from specdec.engine import Engine  # noqa: E402


def test_phases_nest_and_the_engine_is_restored(tmp_path):
    before = Engine._verify
    out = tmp_path / "profile.json"
    methods = ["none", "eagle3", "eagle2", "medusa", "draft_model"]
    assert profile_step.main(["--family", str(FAMILY), "--device", "cpu", "--dtype", "float32",
                              "--methods", ",".join(methods), "--num-requests", "2", "--output-tokens", "8",
                              "--report-json", str(out), "--markdown", str(tmp_path / "profile.md")]) == 0
    assert Engine._verify is before  # unwrapped again
    report = json.loads(out.read_text())
    assert list(report["methods"]) == methods
    for method, r in report["methods"].items():
        host, synced = r["host"], r["synced"]
        assert host["tokens"] == synced["tokens"] == 2 * 8  # 8 new tokens each, both passes
        ms, calls = host["ms_per_step"], host["calls_per_step"]
        assert calls["verify"] == calls["decode step"] == 1  # one verification a step
        assert calls["plan"] == 1
        # inclusive times: a phase holds the phases inside it
        assert ms["draft"] + ms["verify"] <= ms["decode step"]
        assert ms["target forward"] <= ms["verify"]
        if method == "none":
            assert calls["draft"] == 0 and r["tau"] == 1.0
        else:
            assert calls["draft"] == 1 and r["tau"] >= 1.0
        if method in ("eagle2", "eagle3"):
            assert calls["head"] >= 1 and ms["head"] <= ms["draft"]
            assert calls["catch-up"] == 1 and ms["catch-up"] <= ms["draft"]
        else:
            assert calls["head"] == calls["catch-up"] == 0
        assert calls["drafting loop"] == 0  # eager: no CUDA graphs asked for
    assert "| decode step |" in (tmp_path / "profile.md").read_text()


def test_with_graphs_the_eagle_drafting_loop_is_one_call_a_step(tmp_path):
    """--cuda-graphs (emulated on CPU): each EAGLE-2/3 step drafts through one call of the
    graphed loop, after one catch-up; plain decoding makes none."""
    out = tmp_path / "profile.json"
    assert profile_step.main(["--family", str(FAMILY), "--device", "cpu", "--dtype", "float32", "--cuda-graphs",
                              "--methods", "none,eagle2,eagle3", "--num-requests", "1", "--output-tokens", "8",
                              "--report-json", str(out), "--markdown", str(tmp_path / "profile.md")]) == 0
    for method, r in json.loads(out.read_text())["methods"].items():
        calls = r["host"]["calls_per_step"]
        expected = 0 if method == "none" else 1
        assert calls["drafting loop"] == calls["catch-up"] == expected, (method, calls)
