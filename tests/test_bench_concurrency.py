"""Smoke test of tools/bench/bench_concurrency.py on the model family with tiny settings (the
in-process engine, its loop thread, client threads), and its argument checks."""
from __future__ import annotations

import json

import pytest

import bench_concurrency as bc
from engine_helpers import FAMILY, HUMANEVAL

needs_family = pytest.mark.skipif(not all((FAMILY / d / "config.json").is_file() for d in ("base", "eagle")),
                                  reason=f"no base + eagle checkpoints in {FAMILY} (set SPECDEC_TEST_FAMILY)")


@needs_family
def test_side_by_side_table_report_and_plots(tmp_path, capsys):
    report = tmp_path / "conc.json"
    code = bc.main(["--family", str(FAMILY), "--question-set", str(HUMANEVAL), "--concurrency", "2,1",
                    "--num-requests", "3", "--output-tokens", "5", "--warmup", "1", "--eagle-total-tokens", "8",
                    "--repeats", "2", "--report-json", str(report)])
    assert code == 0
    table = capsys.readouterr().out
    assert "plain tok/s" in table and "eagle2-fixed/plain" in table
    data = json.loads(report.read_text())
    points = data["points"]
    configs = ["plain", "eagle2", "eagle2-fixed"]
    # Each level twice, the configurations' order rotated in the second run.
    assert [(p["config"], p["concurrency"], p["repeat"]) for p in points] == [
        (c, n, r) for n in (1, 2) for r in (0, 1) for c in configs[r:] + configs[:r]]
    for n in ("1", "2"):
        assert set(data["summary"][n]) == set(configs) and data["summary"][n]["eagle2"]["repeats"] == 2
    for p in points:
        assert p["requests"] == 3 and p["output_tokens"] == 15  # every request generates exactly 5
        assert p["tokens_per_s"] > 0 and p["latency_p50_s"] <= p["latency_p90_s"]
        assert len(p["latencies_s"]) == 3
        assert p["graph_captures"] is None  # no --cuda-graphs: nothing counted
    by = {(p["config"], p["concurrency"]): p for p in points if p["repeat"] == 0}
    assert by[("plain", 1)]["tau"] == 1.0 and by[("plain", 1)]["acceptance_rate"] == 0.0
    assert by[("eagle2-fixed", 1)]["tau"] >= 1.0
    assert data["setup"]["eagle_total_tokens"] == 8
    assert "KV" in data["setup"]["engine_at_load"]  # the engine's load note (KV budget, calibration timings)
    assert data["machine"]["git_commit"] and data["machine"]["cpu"] and data["machine"]["date"]
    for path in data["plots"]:
        assert (tmp_path / path.split("/")[-1]).stat().st_size > 0
    assert (tmp_path / "conc.png").exists() and (tmp_path / "conc_latency.png").exists()


@pytest.mark.parametrize("argv,message", [
    (["--configs", "plain,magic"], "unknown configuration 'magic'"),
    (["--configs", "medusa-fixed"], "only eagle2, eagle3 can be fixed"),
    (["--configs", "plain,plain"], "twice"),
    (["--concurrency", "0,2"], "--concurrency must be >= 1"),
    (["--concurrency", "a"], "integers"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--url", "localhost:1", "--configs", "eagle2-fixed"], "needs --eagle-total-tokens"),
    (["--url", "localhost:1", "--configs", "plain-whole"], "a -whole or -apart configuration needs the engine"),
    (["--url", "localhost:1", "--configs", "eagle3-apart"], "a -whole or -apart configuration needs the engine"),
    (["--output-tokens", "0"], "--output-tokens must be N or LO-HI with 1 <= LO <= HI, got '0'"),
    (["--output-tokens", "48-16"], "got '48-16'"),
    (["--output-tokens", "a-b"], "got 'a-b'"),
    (["--output-tokens", "1-2-3"], "got '1-2-3'"),
])
def test_bad_arguments_are_one_clear_error(argv, message, capsys):
    assert bc.main(["--family", str(FAMILY), *argv]) == 2
    assert message in capsys.readouterr().err


def test_varied_lengths_are_the_same_for_every_configuration_and_level():
    """`--output-tokens LO-HI`: request i generates lengths[i] tokens (seeded, in range),
    whichever configuration, level or client thread sends it."""
    assert bc.output_lengths("32") == (32, 32) and bc.output_lengths("16-48") == (16, 48)
    lengths = bc.request_lengths(16, 48, 64)
    assert lengths == bc.request_lengths(16, 48, 64) and min(lengths) >= 16 and max(lengths) <= 48
    assert len(set(lengths)) > 10 and bc.request_lengths(7, 7, 3) == [7, 7, 7]
    prompts = [[i] for i in range(5)]
    seen = {}

    def run(config, ids, output_tokens, request_id):
        seen[(config.label, request_id.split("-")[-1])] = (ids, output_tokens)
        return bc.Sample(0.1, 0.01, output_tokens)

    for config in bc.parse_configs("plain,eagle2"):
        for level in (1, 3):
            point = bc.run_level(run, config, prompts, lengths, level, 12)
            assert point.output_tokens == sum(lengths[:12])
    assert {key[1]: value for key, value in seen.items()} == {str(i): ([i % 5], lengths[i]) for i in range(12)}


def test_percentile_and_summary():
    assert bc.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bc.percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    point = bc.summarize("x", 2, [bc.Sample(1.0, 0.1, 10, 8, 4, 6, 9), bc.Sample(3.0, 0.3, 10, 0, 0, 1, 1)], 2.0)
    assert point.tokens_per_s == 10.0 and point.latency_avg_s == 2.0
    assert point.tau == pytest.approx(10 / 7) and point.acceptance_rate == 0.5


def test_repeats_report_medians_of_ratios_within_a_repeat():
    """A ratio compares configurations of the same repeat (the machine's speed drifts
    between repeats), and the table shows its median and range."""
    def point(config, tok_s, repeat):
        return bc.Point(config, 4, 1, 1.0, 10, tok_s, 1.0, 1.0, 1.0, 0.1, 1.0, 0.0, [1.0], repeat)

    configs = bc.parse_configs("plain,eagle2")
    # A slow machine in repeat 1 halves both; eagle2 is 1.1x, 1.2x and 0.9x of plain.
    points = [point("plain", 100, 0), point("eagle2", 110, 0), point("plain", 50, 1), point("eagle2", 60, 1),
              point("plain", 100, 2), point("eagle2", 90, 2)]
    row = bc.level_summary(points, configs, 4)["eagle2"]
    assert row["ratio"] == pytest.approx(1.1) and (row["ratio_min"], row["ratio_max"]) == (pytest.approx(0.9), 1.2)
    assert row["tokens_per_s"] == 90 and row["repeats"] == 3
    assert "1.10x (0.90-1.20)" in bc.format_table(points, configs)


def test_a_level_gives_each_ratio_its_median_interval_from_six_repeats_on():
    """Ten paired repeats at one level: the ratio's median interval is the order
    statistics `repeats.median_interval` picks, in the JSON and in the table."""
    points = [bc.Point(c, 8, 1, 1.0, 10, tok_s, 1.0, 1.0, 1.0, 0.1, 1.0, 0.0, [1.0], r)
              for r in range(10) for c, tok_s in (("plain", 100), ("eagle2", 95 + r))]
    row = bc.level_summary(points, bc.parse_configs("plain,eagle2"), 8)["eagle2"]
    assert (row["ratio_ci95_low"], row["ratio_ci95_high"]) == (pytest.approx(0.96), pytest.approx(1.03))
    assert "median's 95 % CI 0.96-1.03" in bc.format_table(points, bc.parse_configs("plain,eagle2"))


def test_whole_and_apart_configurations_turn_their_prefill_setting_off_while_they_run():
    """`-whole` and `-apart` combine with the other suffixes; a `-whole` configuration's
    requests find the engine's chunked prefill off, an `-apart` one's mixed prefill off,
    the others' both as the engine was loaded."""
    configs = {c.label: c for c in bc.parse_configs("plain,plain-whole,eagle3-nolookup-whole-fixed,plain-apart,"
                                                    "eagle3-whole-apart")}
    assert [(c.method, c.whole_prefill, c.apart_prefill, c.lookup, c.fixed) for c in configs.values()] == [
        ("none", False, False, True, False), ("none", True, False, True, False), ("eagle3", True, False, False, True),
        ("none", False, True, True, False), ("eagle3", True, True, True, False)]

    class Engine:  # what InProcess reads and calls
        def __init__(self):
            from specdec.config import EngineConfig
            self.config = EngineConfig(base_model_dir=str(FAMILY / "base"))
            self.mixed_prefill = True
            self.seen = []

        def submit(self, req, emit):
            from specdec.request import AcceptanceStats, StepOutput
            self.seen.append((self.config.enable_chunked_context, self.mixed_prefill))
            emit(StepOutput(req.request_id, [1] * req.max_tokens, [], True, "length", None, AcceptanceStats()))

    engine = Engine()
    run = bc.InProcess(engine)
    labels = ("plain-whole", "plain-whole", "plain", "plain-apart", "plain-whole", "eagle3-whole-apart", "plain")
    for label in labels:
        assert run(configs[label], [1, 2], 3, "r").output_tokens == 3
    assert engine.seen == [(False, True), (False, True), (True, True), (True, False), (False, True), (False, False),
                           (True, True)]
