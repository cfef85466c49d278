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


def test_level_steps_every_method_and_puts_the_engine_back(tmp_path):
    from specdec import engine as engine_module, policy as policy_module

    originals = (engine_module.Engine.step, engine_module.Engine._verify, engine_module.Engine._prefill_pending,
                 policy_module.SpeculationPolicy.plan)
    out = tmp_path / "level.json"
    assert bench_overheads.main(["--family", str(FAMILY), "--measure", "level", "--batch", "3", "--repeats", "2",
                                 "--level-tokens", "3-6", "--report-json", str(out)]) == 0
    level = json.loads(out.read_text())["level"]
    assert level["batch"] == 3 and set(level["methods"]) == {"none", "eagle2", "eagle3"}
    lengths = bench_overheads.request_lengths(3, 6, 3)
    assert level["output_tokens"] == sum(lengths)
    for method, row in level["methods"].items():
        assert len(row["per_repeat"]) == 2 and row["wall_ms"] > 0
        assert row["decode_steps"] <= max(lengths) - 1  # the prefill emits each first token
        assert set(row["phases_ms"]) == {"prefill", "plan", "draft", "verify", "other"}
        assert row["phases_ms"]["prefill"] > 0 and row["phases_ms"]["verify"] > 0
    assert level["methods"]["none"]["decode_steps"] == max(lengths) - 1
    assert level["methods"]["none"]["tree_steps"] == 0 and level["methods"]["none"]["phases_ms"]["draft"] == 0
    assert level["methods"]["none"]["wall_vs_plain"] == 1.0
    assert (engine_module.Engine.step, engine_module.Engine._verify, engine_module.Engine._prefill_pending,
            policy_module.SpeculationPolicy.plan) == originals
    assert gc.get_freeze_count() == 0


def test_level_prices_tree_steps_at_plain_decodings_cost_for_their_batch():
    step = lambda B, N, accepted, verify_ms, step_ms: [B, N, accepted, verify_ms / 1e3, step_ms / 1e3]  # noqa: E731
    phases = {"prefill": 1.0, "plan": 0.0, "draft": 0.0, "verify": 1.0, "other": 0.0}
    runs = {"none": [dict(wall_ms=100.0, phases_ms=phases, steps=[step(2, 1, 0, 10, 20), step(2, 1, 0, 12, 22),
                                                                   step(1, 1, 0, 8, 16)])],
            "eagle2": [dict(wall_ms=90.0, phases_ms=phases, steps=[step(2, 4, 3, 17, 30), step(1, 3, 1, 9, 18),
                                                                    step(1, 1, 0, 8, 16), step(5, 4, 9, 50, 60)])]}
    out = bench_overheads._level_summary(runs, batch=2, lengths=[4, 3])
    eagle2 = out["methods"]["eagle2"]
    # tree steps at batches 2 and 1 (batch 5 was never decoded plainly: not priced)
    assert eagle2["tree_steps"] == 2 and eagle2["per_repeat"][0]["tree_batches"] == [(1, 1), (2, 1)]
    assert abs(eagle2["tree_extra_verify_ms"] - ((17 - 11) + (9 - 8))) < 1e-9  # above plain's median verify
    assert abs(eagle2["tree_saved_ms"] - (3 * 21 / 2 + 1 * 16 / 1)) < 1e-9  # a B-th of plain's step per draft
    assert eagle2["accepted"] == 13 and eagle2["decode_steps"] == 4 and abs(eagle2["wall_vs_plain"] - 0.9) < 1e-12
    assert out["plain_step_ms_by_batch"] == {1: 16.0, 2: 21.0}


def test_single_query_times_both_attentions_and_leaves_grouping_on(tmp_path):
    from specdec.models import layers

    out = tmp_path / "single.json"
    assert bench_overheads.main(["--family", str(FAMILY), "--measure", "single-query", "--batch", "3", "--steps", "2",
                                 "--repeats", "2", "--report-json", str(out)]) == 0
    rows = json.loads(out.read_text())["single_query"]
    assert set(rows) == {"1", "3"}
    for row in rows.values():
        assert [len(row["per_repeat_ms"][k]) for k in ("grouped", "enable_gqa")] == [2, 2]
        assert row["median_ms"]["grouped"] > 0 and row["median_ms"]["enable_gqa"] > 0
    assert layers.GROUP_SINGLE_QUERIES and gc.get_freeze_count() == 0


def test_packing_runs_the_level_both_ways_and_puts_the_engine_back(tmp_path):
    from specdec import engine as engine_module

    decode = engine_module.Engine._decode
    out = tmp_path / "packing.json"
    assert bench_overheads.main(["--family", str(FAMILY), "--measure", "packing", "--batch", "3", "--repeats", "2",
                                 "--level-tokens", "3-6", "--report-json", str(out)]) == 0
    r = json.loads(out.read_text())["packing"]
    for setting in ("packed", "scattered"):
        assert len(r["per_repeat"][setting]["wall_ms"]) == 2
        assert 0 < r["median"][setting]["decode_ms"] < r["median"][setting]["wall_ms"]
    assert engine_module.Engine._decode is decode and gc.get_freeze_count() == 0


def test_mixed_prefill_times_arrival_steps_both_ways_and_puts_the_engine_back(tmp_path, monkeypatch):
    """Each setting's arrivals ride in the verify forward (mixed) or not (apart), and the
    engine's setting is as loaded afterwards."""
    from specdec.models.llama import LlamaModel

    parts_calls = []
    forward_parts = LlamaModel.forward_parts
    monkeypatch.setattr(LlamaModel, "forward_parts",
                        lambda self, parts, *a, **kw: parts_calls.append(len(parts)) or forward_parts(self, parts, *a,
                                                                                                      **kw))
    out = tmp_path / "mixed.json"
    assert bench_overheads.main(["--family", str(FAMILY), "--measure", "mixed-prefill", "--batch", "3",
                                 "--steps", "3", "--repeats", "2", "--report-json", str(out)]) == 0
    r = json.loads(out.read_text())["mixed_prefill"]
    for setting in ("mixed", "apart"):
        assert len(r["per_repeat"][setting]["arrival_ms"]) == 2 and r["median"][setting]["plain_ms"] > 0
    assert parts_calls == [2] * 3 * 3  # 3 arrivals ride in each mixed round (the untimed one too), none apart
    assert len(r["arrival_tokens"]) == 3 and gc.get_freeze_count() == 0
