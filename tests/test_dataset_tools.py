"""Dataset and benchmark-report tools: dataset_converter, prepare_dataset,
genai_perf_compare (parsing and command shape, no server) and plots."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
for _tools in ("tools", "tools/bench", "tools/data"):
    sys.path.insert(0, str(REPO / _tools))

import dataset_converter  # noqa: E402
import family  # noqa: E402
import genai_perf_compare as gpc  # noqa: E402
import prepare_dataset  # noqa: E402

DATA = dataset_converter.data_dir()  # $SPECDEC_DATA_DIR, else ../shared/data
QUESTION_SETS = sorted(DATA.glob("eagle_*_question.jsonl"))
TOKENIZER = family.BASE_DIR  # SmolLM2's tokenizer (tools/setup_model.py)
FIXTURES = REPO / "tests" / "fixtures" / "genai_perf"


def _first_turns(path: Path) -> list[str]:
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tokenizer():
    if not (TOKENIZER / "tokenizer.json").exists():
        pytest.skip("no shipped tokenizer")
    return prepare_dataset.load_tokenizer(TOKENIZER)


# ---------------------------------------------------------------- dataset_converter


def test_all_four_question_sets_are_present():
    assert [p.name for p in QUESTION_SETS] == [
        "eagle_alpaca_question.jsonl", "eagle_gsm8k_question.jsonl",
        "eagle_humaneval_question.jsonl", "eagle_mt_bench_question.jsonl",
    ]


def test_without_the_question_sets_the_suite_stops_saying_where_they_go(tmp_path):
    """A clone without ../shared/data gets one usage error naming the folder and
    SPECDEC_DATA_DIR, not dozens of failing tests."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_choices.py"],
                         cwd=REPO, env={**os.environ, "SPECDEC_DATA_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    said = run.stdout + run.stderr
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, said
    assert f"eagle_humaneval_question.jsonl, eagle_mt_bench_question.jsonl, eagle_gsm8k_question.jsonl, " \
           f"eagle_alpaca_question.jsonl are not in {tmp_path}" in said and "SPECDEC_DATA_DIR" in said


@pytest.mark.parametrize("path", QUESTION_SETS, ids=[p.stem for p in QUESTION_SETS])
def test_converter_keeps_exactly_the_first_turns_in_order(path, tmp_path):
    out = tmp_path / "converted.jsonl"
    assert dataset_converter.convert_file(path, out) == 80
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(list(row) == ["text"] for row in rows)
    assert [row["text"] for row in rows] == _first_turns(path)


def test_converter_cli_and_text_input_field(tmp_path):
    src = DATA / "eagle_humaneval_question.jsonl"
    out = tmp_path / "he.jsonl"
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "dataset_converter.py"), "--input_file", str(src),
         "--output_file", str(out), "--field", "text_input"],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["text_input"] for line in out.read_text().splitlines()] == _first_turns(src)


def test_turns_error_names_the_multi_turn_question(tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    rc = dataset_converter.main(["--input_file", str(DATA / "eagle_mt_bench_question.jsonl"),
                                 "--output_file", str(out), "--turns", "error"])
    assert rc == 2
    assert "question_id 81 (line 1) has 2 turns" in capsys.readouterr().err
    assert not out.exists()


BAD_FILES = {
    "not_json": ('{"question_id": 0, "turns": ["a"]}\n{"question_id": 1, turns}\n', ":2: not valid JSON"),
    "no_turns": ('{"turns": ["a"]}\n\n{"question_id": 2, "prompt": "b"}\n', ":3: missing 'turns'"),
    "empty_file": ("\n\n", "no questions (empty file)"),
    "empty_turns": ('{"question_id": 0, "turns": []}\n', ":1: 'turns' must be a non-empty list"),
    "blank_turn": ('{"question_id": 0, "turns": ["  "]}\n', ":1: turns[0] is empty"),
    "not_object": ('["a"]\n', ":1: expected a JSON object"),
    "turn_not_str": ('{"turns": [3]}\n', ":1: turns[0] is int"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_exit_2_with_line_number(name, tmp_path, capsys):
    content, expected = BAD_FILES[name]
    src = tmp_path / f"{name}.jsonl"
    src.write_text(content)
    out = tmp_path / "out.jsonl"
    assert dataset_converter.main(["--input_file", str(src), "--output_file", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err, err
    assert not out.exists()


def test_bad_file_process_exit_code_and_missing_file(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text("{oops\n")
    script = str(REPO / "tools" / "dataset_converter.py")
    done = subprocess.run([sys.executable, script, "--input_file", str(src), "--output_file", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and f"{src}:1: not valid JSON" in done.stderr
    done = subprocess.run([sys.executable, script, "--input_file", str(tmp_path / "nope.jsonl"),
                           "--output_file", str(tmp_path / "o")], capture_output=True, text=True)
    assert done.returncode == 2 and "no such file" in done.stderr


# ---------------------------------------------------------------- prepare_dataset


def test_token_norm_dist_follows_mean_and_stdev(tokenizer):
    samples = prepare_dataset.token_norm_dist(tokenizer, 400, 64, 8, 32, 4, seed=7)
    in_lens = [len(s.input_ids) for s in samples]
    out_lens = [s.output_tokens for s in samples]
    # ceil() adds ~0.5 to the mean; 400 draws put the sample mean within ~0.4 (1 sigma).
    assert abs(statistics.mean(in_lens) - 64.5) < 2.0
    assert abs(statistics.stdev(in_lens) - 8) < 1.6
    assert abs(statistics.mean(out_lens) - 32.5) < 1.0
    assert abs(statistics.stdev(out_lens) - 4) < 0.8
    assert [s.task_id for s in samples] == list(range(400))
    special = set(tokenizer.all_special_ids)
    ids = {t for s in samples for t in s.input_ids}
    assert not ids & special and min(ids) >= 0 and max(ids) < len(tokenizer)


def test_token_norm_dist_is_seeded(tokenizer):
    a = prepare_dataset.token_norm_dist(tokenizer, 20, 16, 4, 8, 2, seed=1)
    assert a == prepare_dataset.token_norm_dist(tokenizer, 20, 16, 4, 8, 2, seed=1)
    assert a != prepare_dataset.token_norm_dist(tokenizer, 20, 16, 4, 8, 2, seed=2)
    fixed = prepare_dataset.token_norm_dist(tokenizer, 10, 12, 0, 5, 0, seed=0)
    assert {len(s.input_ids) for s in fixed} == {12} and {s.output_tokens for s in fixed} == {5}


def test_dataset_subcommand_writes_trtllm_bench_lines(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_dataset, "load_tokenizer", lambda path: tokenizer)
    src = DATA / "eagle_gsm8k_question.jsonl"
    out = tmp_path / "ds.jsonl"
    rc = prepare_dataset.main(["--tokenizer", str(TOKENIZER), "--output", str(out),
                               "dataset", "--input-file", str(src), "--output-tokens", "128"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [list(r) for r in rows] == [["task_id", "input_ids", "output_tokens"]] * 80
    assert [r["task_id"] for r in rows] == list(range(80))
    assert {r["output_tokens"] for r in rows} == {128}
    assert [r["input_ids"] for r in rows] == [tokenizer.encode(t) for t in _first_turns(src)]
    assert len(prepare_dataset.read_samples(out)) == 80


def test_dataset_prompt_format_needs_no_tokenizer(capsys):
    src = DATA / "eagle_alpaca_question.jsonl"
    assert prepare_dataset.main(["dataset", "--input-file", str(src), "--output-tokens", "16",
                                 "--format", "prompt"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == _first_turns(src) and "input_ids" not in rows[0]


def test_prepare_dataset_bad_input_exits_2(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"turns": ["ok"]}\nnot json\n')
    assert prepare_dataset.main(["--tokenizer", str(TOKENIZER), "dataset", "--input-file", str(src),
                                 "--output-tokens", "8"]) == 2
    assert f"{src}:2: not valid JSON" in capsys.readouterr().err
    assert prepare_dataset.main(["token-norm-dist", "--num-requests", "1", "--input-mean", "4",
                                 "--output-mean", "4"]) == 2
    assert "--tokenizer is required" in capsys.readouterr().err


# ---------------------------------------------------------------- genai_perf_compare


def test_fixture_json_and_csv_agree():
    for label in ("plain", "eagle2"):
        run_dir = next((FIXTURES / label).iterdir())
        from_json = gpc.load_run(run_dir / "profile_export_genai_perf.json")
        from_csv = gpc.load_run(run_dir / "profile_export_genai_perf.csv")
        assert set(from_csv) == {
            "time_to_first_token", "time_to_second_token", "request_latency", "inter_token_latency",
            "output_token_throughput_per_user", "output_sequence_length", "input_sequence_length",
            "output_token_throughput", "request_throughput", "request_count",
        }
        for metric, stats in from_csv.items():
            for stat, value in stats.items():
                assert value == pytest.approx(from_json[metric][stat], abs=0.006), (metric, stat)
        assert from_json["request_count"]["avg"] == 10


def test_directory_lookup_prefers_json_and_reports_missing(tmp_path):
    exports = gpc.find_exports(FIXTURES / "plain")
    assert list(exports) == ["concurrency1"] and exports["concurrency1"].name == "profile_export_genai_perf.json"
    with pytest.raises(gpc.CompareError, match="no profile_export_genai_perf"):
        gpc.find_exports(tmp_path)
    with pytest.raises(gpc.CompareError, match="2 runs for concurrency1 inside"):
        gpc.find_exports(FIXTURES)


def test_a_label_folder_holds_one_run_per_stimulus(tmp_path, capsys):
    """`profile` writes <out>/<label>/<stimulus>/<model>-triton-<backend>-<stimulus>/; compare pairs stimuli."""
    for label in ("plain", "eagle2"):
        src = next((FIXTURES / label).iterdir())
        for stim in ("concurrency1", "request_rate0.4"):
            shutil.copytree(src, tmp_path / label / stim / f"ensemble-triton-tensorrtllm-{stim}")
    assert set(gpc.load_runs(tmp_path / "plain")) == {"concurrency1", "request_rate0.4"}
    with pytest.raises(gpc.CompareError, match="2 runs inside"):
        gpc.load_run(tmp_path / "plain")
    out, md = tmp_path / "cmp.json", tmp_path / "cmp.md"
    assert gpc.main(["compare", f"plain={tmp_path / 'plain'}", f"eagle2={tmp_path / 'eagle2'}",
                     "--json-out", str(out), "--markdown", str(md)]) == 0
    assert set(json.loads(out.read_text())) == {"concurrency1", "request_rate0.4"}
    text = md.read_text()
    assert "**request_rate0.4**" in text and "| metric | stat | plain | eagle2 | eagle2/plain |" in text
    assert "| request_count (count) | avg | 10.00 | 10.00 | 1.000x |" in text
    assert "Command: `python tools/bench/genai_perf_compare.py compare plain=" in text and "\nDate: " in text
    shutil.rmtree(tmp_path / "eagle2" / "request_rate0.4")
    assert gpc.main(["compare", f"plain={tmp_path / 'plain'}", f"eagle2={tmp_path / 'eagle2'}"]) == 2
    assert "request_rate0.4: no run for eagle2" in capsys.readouterr().err


def test_csv_telemetry_blocks_are_skipped(tmp_path):
    src = next((FIXTURES / "plain").iterdir()) / "profile_export_genai_perf.csv"
    csv_path = tmp_path / "profile_export_genai_perf.csv"
    csv_path.write_text(src.read_text() + "\nMetric,GPU,avg,min,max\nGpu Power Usage (W),gpu0,\"1,200.00\",1.00,2.00\n")
    metrics = gpc.load_run(csv_path)
    assert "gpu_power_usage" not in metrics
    assert metrics["request_latency"]["max"] == pytest.approx(1033.82)


def test_comparison_table_ratios_against_first_label(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert gpc.main(["compare", f"plain={FIXTURES / 'plain'}", f"eagle2={FIXTURES / 'eagle2'}",
                     "--json-out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "eagle2/plain" in table.splitlines()[1]
    for metric in ("request_latency", "output_sequence_length", "input_sequence_length",
                   "output_token_throughput", "request_throughput"):
        assert metric in table
    export = json.loads(out.read_text())["concurrency1"]
    runs = export["runs"]
    row = next(r for r in export["rows"] if r["metric"] == "request_latency" and r["stat"] == "p99")
    assert row["ratios"]["eagle2"] == pytest.approx(
        runs["eagle2"]["request_latency"]["p99"] / runs["plain"]["request_latency"]["p99"])
    stats = {(r["metric"], r["stat"]) for r in export["rows"]}
    assert {("request_latency", s) for s in ("avg", "min", "max", "p99", "p90", "p75")} <= stats
    assert ("request_throughput", "avg") in stats and ("request_throughput", "p99") not in stats


def test_compare_rejects_bad_specs(capsys):
    assert gpc.main(["compare", str(FIXTURES / "plain")]) == 2
    assert "expected LABEL=PATH" in capsys.readouterr().err
    assert gpc.main(["compare", f"a={FIXTURES / 'plain'}", f"a={FIXTURES / 'eagle2'}"]) == 2
    assert "given twice" in capsys.readouterr().err


def test_genai_perf_command_has_the_tutorial_shape(tmp_path):
    args = argparse.Namespace(model="ensemble", tokenizer=".cache/smollm2/base", no_streaming=False,
                              input_file="q.jsonl", output_tokens_mean=128, request_count=80,
                              output_tokens_mean_deterministic=True, genai_perf_args="--random-seed 7")
    venv = tmp_path / "venv"
    cmd = gpc.genai_perf_command(args, venv, "localhost:8001", ("concurrency", "1"), tmp_path / "a")
    assert cmd[:2] == [str(venv / "bin" / "genai-perf"), "profile"]
    line = " ".join(cmd[2:])
    for part in ("-m ensemble", "--endpoint-type kserve", "--backend tensorrtllm", "--tokenizer .cache/smollm2/base",
                 "--url localhost:8001", "--concurrency 1", "--streaming", "--input-file q.jsonl",
                 "--output-tokens-mean 128 --output-tokens-mean-deterministic", "--request-count 80",
                 "--random-seed 7", f"--artifact-dir {tmp_path / 'a'}"):
        assert part in line
    cmd = gpc.genai_perf_command(args, venv, "h:9001", ("request_rate", "2.0"), tmp_path / "b")
    assert "--request-rate 2.0" in " ".join(cmd) and "--request-count 80" in " ".join(cmd)
    assert gpc.parse_label("eagle2", "localhost:8001") == ("eagle2", "localhost:8001")
    assert gpc.parse_label("plain=h:9001", "localhost:8001") == ("plain", "h:9001")


def test_measurement_follows_perf_analyzers_rules():
    """Warm-up only under concurrency (a request-rate warm-up never ends); a rate below 1
    cannot be measured by request count, so it takes the time windows or is refused."""
    args = argparse.Namespace(request_count=40, measurement_interval=30000, warmup_request_count=2)
    assert gpc.measurement_args(args, ("concurrency", "1")) == [
        "--warmup-request-count", "2", "--request-count", "40"]
    assert gpc.measurement_args(args, ("request_rate", "2.0")) == ["--request-count", "40"]
    assert gpc.measurement_args(args, ("request_rate", "0.4")) == ["--measurement-interval", "30000"]
    args.measurement_interval = None
    with pytest.raises(gpc.CompareError, match="below 1"):
        gpc.measurement_args(args, ("request_rate", "0.4"))
    assert gpc.measurement_args(argparse.Namespace(), ("concurrency", "1")) == []


def test_profile_refuses_measurement_flags_in_passthrough(tmp_path, capsys):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "genai-perf").touch()
    base = ["--venv", str(tmp_path / "venv"), "profile", "--label", "plain", "--tokenizer", str(tmp_path)]
    assert gpc.main(base + ["--genai-perf-args", "--request-count 80"]) == 2
    assert "use this tool's --request-count" in capsys.readouterr().err
    assert gpc.main(base + ["--request-rate", "0.5", "--request-count", "40"]) == 2
    assert "give --measurement-interval" in capsys.readouterr().err


# ---------------------------------------------------------------- plots


def test_plots_write_pngs(tmp_path):
    import plots

    png = b"\x89PNG"
    assert plots.speedup_bars({"eagle2": {"mt_bench": 2.8, "gsm8k": 3.0}, "medusa": {"mt_bench": 1.9}},
                              tmp_path / "s.png").read_bytes()[:4] == png
    assert plots.tau_histogram({"eagle2": [1, 3, 4, 4], "medusa": [1, 2, 2]},
                               tmp_path / "t.png").read_bytes()[:4] == png
    assert plots.throughput_vs_concurrency({"plain": [(1, 40.0), (4, 120.0)], "eagle2": [(4, 250.0), (1, 90.0)]},
                                           tmp_path / "sub" / "c.png").read_bytes()[:4] == png
    with pytest.raises(ValueError, match="no methods"):
        plots.speedup_bars({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="τ < 1"):
        plots.tau_histogram({"m": [0, 1]}, tmp_path / "x.png")
