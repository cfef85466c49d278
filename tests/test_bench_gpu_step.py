"""Smoke test of `tools/bench/bench_gpu_step.py` on the CPU with the tiny shape: the run
completes, its JSON report holds every number (positive) and the device's name, and
bad arguments exit with argparse's usage and a message that names the problem, not a
traceback. The 7B numbers
themselves need a GPU and are not checked here."""
from __future__ import annotations

import json

import pytest

import bench_gpu_step

SMOKE = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--iters", "2", "--warmup", "1",
         "--copy-mib", "16"]


def test_tiny_cpu_run_reports_every_number(tmp_path, capsys):
    path = tmp_path / "step.json"
    report = latency_report(tmp_path / "latency.json", [("eagle2", 16, 2.5)])
    assert bench_gpu_step.main([*SMOKE, "--report-json", str(path), "--family-report", report]) == 0
    out = capsys.readouterr().out
    assert "plain decode step" in out and "implied speedup" in out

    r = json.loads(path.read_text())
    assert r["device"] and r["device_type"] == "cpu" and r["torch"] and r["date"]
    assert r["shape"] == "tiny" and r["dtype"] == "float32" and r["context"] == 512
    positive = [r["copy"]["gb_per_s"], r["copy"]["ms"], r["weights"]["target_bytes"], r["weights"]["head_bytes"],
                r["weights"]["kv_read_bytes_plain_step"], r["bandwidth_bound_ms"], r["plain"]["step_ms"],
                r["plain"]["over_bound"], r["plain"]["graph_step_ms"], r["plain"]["graph_over_bound"]]
    assert r["graphs"] == {"captured": False, "buckets": 4}  # plain + widths 16, 32, 64
    trees = r["eagle2"]["trees"]
    assert [t["total_tokens"] for t in trees] == [16, 32, 60]
    for t in trees:
        positive += [t[k] for k in ("draft_ms", "verify_ms", "step_ms", "step_over_plain", "tau",
                                    "implied_speedup", "verify_graph_ms", "step_graph_ms",
                                    "step_graph_over_plain_graph", "implied_speedup_graph")]
        assert t["step_ms"] == pytest.approx(t["draft_ms"] + t["verify_ms"])
        assert t["step_graph_ms"] == pytest.approx(t["draft_ms"] + t["verify_graph_ms"])
        assert t["graph_width"] == {16: 16, 32: 32, 60: 64}[t["total_tokens"]]
        assert t["tau_total_tokens"] == 16 and t["tau"] == 2.5  # the report's only EAGLE-2 tree size
    assert all(isinstance(v, (int, float)) and v > 0 for v in positive), positive
    for name in ("plain_over_bound", "eagle2_60_over_plain", "plain_graph_over_bound",
                 "eagle2_60_graph_over_plain_graph"):
        target = r["targets"][name]
        assert target["value"] > 0 and target["limit"] > 0 and isinstance(target["met"], bool)


def latency_report(path, runs) -> str:
    """A `tools/bench/bench.py latency --report-json` file with these (label, total_tokens, tau) runs."""
    path.write_text(json.dumps({"runs": [
        {"label": label, "tree": f"dynamic depth=5 top_k=8 total_tokens={total}", "summary": {"tau": tau}}
        for label, total, tau in runs]}))
    return str(path)


def test_family_tau_picks_the_closest_tree_size(tmp_path):
    a = latency_report(tmp_path / "latency_a.json", [("none", 1, 1.0), ("eagle2", 16, 3.0), ("eagle2", 48, 5.0),
                                                     ("eagle3", 60, 9.0)])
    b = latency_report(tmp_path / "latency_b.json", [("eagle2", 16, 2.0)])
    reports = [tmp_path / "latency_a.json", tmp_path / "latency_b.json"]
    assert a and b
    assert bench_gpu_step.family_tau(reports, 16)["tau"] == 2.5  # averaged over the sets
    assert bench_gpu_step.family_tau(reports, 60)["tau"] == 5.0  # EAGLE-3's run is not EAGLE-2's
    assert bench_gpu_step.family_tau(reports, 32)["total_tokens"] == 16  # a tie goes to the smaller tree
    assert bench_gpu_step.family_tau([tmp_path / "missing.json"], 16) is None


@pytest.mark.parametrize("argv, message", [
    (["--device", "cuda"], "sees no CUDA GPU"),
    (["--shape", "llama-9000"], "invalid choice: 'llama-9000'"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--trees", "16,1"], "tree sizes must be >= 2"),
    (["--trees", "600"], "drafts at most 511 tokens"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--family-report", "/nonexistent/report.json"], "give one with --tau"),
])
def test_bad_arguments_exit_with_a_message(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(bench_gpu_step.torch.cuda, "is_available", lambda: False)
    base = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32"]
    with pytest.raises(SystemExit) as exc:
        bench_gpu_step.main([*base, *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert message in err and "Traceback" not in err, err
