"""tools/bench/bench_overheads.py on tiny sizes: it runs, the catch-up's one-position output
equals the full forward's, its off-state comparison drafts nothing (the tool stops
otherwise), and its two ways of truncating a distribution agree."""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "bench"))

import bench_overheads  # noqa: E402
from engine_helpers import FAMILY  # noqa: E402


def test_tiny_run_reports_both_measurements(tmp_path):
    out = tmp_path / "overheads.json"
    assert bench_overheads.main(["--family", str(FAMILY), "--pairs", "24", "--iters", "1", "--batch", "3",
                                 "--steps", "2", "--repeats", "3", "--measure", "catch-up,off-state",
                                 "--off-methods", "eagle2,eagle3", "--report-json", str(out)]) == 0
    r = json.loads(out.read_text())
    for method in ("eagle2", "eagle3"):
        row = r["catch_up"][method]
        assert row["pairs"] == 24 and row["full_ms"] > 0 and row["queries_ms"] > 0
        assert row["max_abs_diff"] < 1e-4
    m = r["off_state"]["median_ms"]
    assert m["none"]["step"] > 0 and m["eagle2"]["step"] > 0 and m["eagle2"]["commit"] > 0
    assert m["eagle3"]["step"] > 0 and m["eagle3"]["commit"] > 0  # EAGLE-3's features are committed too
    assert [len(r["off_state"]["per_repeat_ms"][k]) for k in ("none", "eagle2", "eagle3")] == [3, 3, 3]
    assert set(r["off_state"]["overheads"]) == {"eagle2", "eagle3"}
    assert gc.get_freeze_count() == 0  # frozen as a launched engine is while it measured, not after
    assert "sampling" not in r  # (not asked for)


def test_sampling_compares_two_ways_that_keep_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "sampling.json"
    assert bench_overheads.main(["--family", str(FAMILY), "--measure", "sampling", "--sampling-iters", "1",
                                 "--batch", "1", "--report-json", str(out)]) == 0
    r = json.loads(out.read_text())
    rows = r["sampling"]
    assert "catch_up" not in r and "sampling 16x16, top_p 0.95" in capsys.readouterr().out
    assert len(rows) == 9 and all(row["ranked_ms"] > 0 and row["everything_ms"] > 0 for row in rows.values())
    assert all(row["max_abs_diff"] < 1e-6 for row in rows.values())
