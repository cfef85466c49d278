"""tools/bench/bench_host_memory.py: a worker times every level on the tiny family; the
parent runs the two settings in turns, stops where their tokens differ, and reports
medians side by side."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "bench"))

import bench_host_memory  # noqa: E402
from engine_helpers import FAMILY  # noqa: E402


def test_a_worker_times_every_level(capsys):
    bench_host_memory.main(["--worker", "returned", "--family", str(FAMILY), "--levels", "none:2,eagle2:2,prefill:16",
                            "--warm-steps", "1", "--steps", "2", "--max-tokens", "200"])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert result["setting"] == "returned" and "host memory" not in result["load_note"]
    assert [r["level"] for r in result["levels"]] == ["none:2", "eagle2:2", "prefill:16"]
    assert all(r["ms_per_step"] > 0 and r["faults_per_step"] >= 0 and r["tokens_sha"] for r in result["levels"])
    assert result["peak_rss_mib"] > 0


def _fake_worker(ms: dict, sha: dict, order: list):
    real = subprocess.run  # (the module is shared: machine_info's git calls pass through)

    def run(cmd, **kw):
        if "--worker" not in cmd:
            return real(cmd, **kw)
        setting = cmd[cmd.index("--worker") + 1]
        order.append(setting)
        levels = [dict(level=lv, ms_per_step=ms[setting], faults_per_step=0 if setting == "kept" else 100,
                       tokens_sha=sha.get((setting, len(order)), "same")) for lv in ("none:1", "eagle2:8")]
        out = json.dumps(dict(setting=setting, levels=levels, peak_rss_mib=10.0, load_note=""))
        return subprocess.CompletedProcess(cmd, 0, stdout="  timing\nRESULT " + out + "\n", stderr="")
    return run


def test_settings_take_turns_and_the_report_sets_them_side_by_side(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(bench_host_memory.subprocess, "run", _fake_worker({"kept": 80.0, "returned": 100.0}, {}, order))
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    bench_host_memory.main(["--repeats", "2", "--report-md", str(md), "--report-json", str(js)])
    assert order == ["kept", "returned", "returned", "kept"]
    assert "| eagle2:8 | 80.0 | 100.0 | 0.80 | 0 | 100 |" in md.read_text()
    assert json.loads(js.read_text())["median"]["kept"]["none:1"]["ms_per_step"] == 80.0


def test_tokens_that_differ_between_settings_stop_the_run(monkeypatch):
    order = []
    monkeypatch.setattr(bench_host_memory.subprocess, "run",
                        _fake_worker({"kept": 80.0, "returned": 100.0}, {("returned", 2): "other"}, order))
    with pytest.raises(SystemExit, match="tokens differ"):
        bench_host_memory.main(["--repeats", "1"])
