"""Smoke tests of the benchmark and report tools on the model family, tiny settings:
`tools/bench/bench.py` (latency, throughput, --compare with the transformers reference,
JSON export, plot) and `tools/bench/eval_family.py` (report, JSON, model-card section)."""
from __future__ import annotations

import json
import shutil

import pytest

import bench
import eval_family
from engine_helpers import FAMILY, HUMANEVAL
from specdec.policy import MAX_DEPTH

pytestmark = pytest.mark.skipif(
    not all((FAMILY / d / "config.json").is_file() for d in ("base", "draft", "eagle", "eagle3", "medusa")),
    reason=f"the model family at {FAMILY} is incomplete (set SPECDEC_TEST_FAMILY)")

SMALL = ["--num-requests", "2", "--output-tokens", "8", "--warmup", "1", "--no-progress"]


def _bench(capsys, *argv) -> tuple[int, str]:
    code = bench.main(["--family", str(FAMILY), *argv])
    return code, capsys.readouterr().out



def test_an_env_variant_runs_each_engine_configuration_again_with_the_variable_set(tmp_path, capsys, monkeypatch):
    """`--env-variant NAME=VALUE`: every engine configuration also runs as `<entry>
    [NAME=VALUE]`, taking turns with the rest, the variable set only while it runs (and
    put back after); `transformers` references run once."""
    seen = []
    original = bench.run_engine

    def recording(engine, entry, reqs, *a, **kw):
        seen.append((entry, bench.os.environ.get("SPECDEC_TEST_SWITCH")))
        return original(engine, entry, reqs, *a, **kw)
    monkeypatch.setattr(bench, "run_engine", recording)
    monkeypatch.setenv("SPECDEC_TEST_SWITCH", "before")
    report = tmp_path / "variant.json"
    code, out = _bench(capsys, "latency", "--question-set", str(HUMANEVAL), "--num-requests", "1", "--output-tokens",
                       "4", "--warmup", "0", "--no-progress", "--compare", "none,eagle3", "--dtype", "float64",
                       "--env-variant", "SPECDEC_TEST_SWITCH=0", "--report-json", str(report))
    assert code == 0
    assert sorted(set(seen)) == [("eagle3", "0"), ("eagle3", "before"), ("none", "0"), ("none", "before")]
    assert bench.os.environ["SPECDEC_TEST_SWITCH"] == "before"
    labels = [run["label"] for run in json.loads(report.read_text())["runs"]]
    assert labels == ["none", "eagle3", "none [SPECDEC_TEST_SWITCH=0]", "eagle3 [SPECDEC_TEST_SWITCH=0]"]
    assert "eagle3 [SPECDEC_TEST_SWITCH=0]" in out
    assert bench.label_entry("eagle3+lookup@8 [A=1]") == ("eagle3+lookup@8", ("A", "1"))
    assert bench.label_entry("hf") == ("hf", None)
    code = bench.main(["--family", str(FAMILY), "latency", "--question-set", str(HUMANEVAL), "--compare", "none,eagle3",
                       "--env-variant", "NOVALUE"])
    assert code == 2 and "--env-variant must be NAME=VALUE" in capsys.readouterr().err

def test_latency_on_a_dataset_file(tmp_path, capsys):
    dataset = tmp_path / "ds.jsonl"
    dataset.write_text('{"task_id":0,"input_ids":[1,534,292,668],"output_tokens":8}\n'
                       '{"task_id":1,"input_ids":[1,534,292,668,292,534,292],"output_tokens":6}\n')
    report = tmp_path / "latency.json"
    code, out = _bench(capsys, "latency", "--dataset", str(dataset), "--method", "eagle2", "--warmup", "1",
                       "--no-progress", "--report-json", str(report))
    assert code == 0
    for section in ("ENGINE DETAILS", "PERFORMANCE OVERVIEW", "Token Throughput (tokens/sec)",
                    "P99 request latency (ms)", "Mean acceptance length tau", "Versions"):
        assert section in out
    data = json.loads(report.read_text())
    run = data["runs"][0]
    assert run["label"] == "eagle2" and run["summary"]["num_requests"] == 2
    assert [r["output_len"] for r in run["requests"]] == [8, 6]  # EOS ignored: exact lengths
    assert all(r["latency_ms"] >= r["ttft_ms"] > 0 for r in run["requests"])
    assert run["summary"]["tau"] >= 1.0
    assert data["machine"]["torch"] and data["machine"]["date"]
    assert data["engine_at_load"] and data["engine_at_load"] in out  # the load note, as printed


def test_throughput_compare_with_transformers(tmp_path, capsys):
    report, plot = tmp_path / "cmp.json", tmp_path / "cmp.png"
    code, out = _bench(capsys, "throughput", "--question-set", str(HUMANEVAL), *SMALL, "--max-batch-size", "2",
                       "--compare", "none,eagle2,hf", "--dtype", "float64", "--adaptive", "off",
                       "--report-json", str(report), "--plot", str(plot))
    assert code == 0
    assert "COMPARISON" in out and "same as none" in out
    rows = {r["label"]: r for r in json.loads(report.read_text())["comparison"]}
    assert list(rows) == ["none", "eagle2", "hf"]
    assert rows["none"]["speedup"] == 1.0
    assert rows["eagle2"]["same_as_none"]["same"], rows["eagle2"]  # greedy speculation is lossless
    assert rows["eagle2"]["tau"] > 1.0  # adaptive off: every step drafted something
    assert plot.is_file() and plot.with_name("cmp_tau.png").is_file()


def test_latency_compare_interleaves_configurations_request_by_request(tmp_path, capsys, monkeypatch):
    """Drift on a shared machine must weigh on every configuration alike: after the
    warm-ups, each request runs under every configuration (order rotating) before the
    next request starts; --no-interleave runs configurations one after another."""
    calls = []
    for name in ("run_engine", "run_hf"):
        original = getattr(bench, name)

        def recording(*a, _original=original, _engine=name == "run_engine", **kw):
            entry, reqs = (a[1], a[2]) if _engine else (a[0], a[2])
            calls.append((entry, tuple(r.task_id for r in reqs)))
            return _original(*a, **kw)
        monkeypatch.setattr(bench, name, recording)
    args = ["latency", "--question-set", str(HUMANEVAL), "--num-requests", "3", "--output-tokens", "6",
            "--warmup", "1", "--no-progress", "--compare", "none,eagle3,hf", "--dtype", "float64"]
    report = tmp_path / "interleaved.json"
    assert _bench(capsys, *args, "--report-json", str(report))[0] == 0
    timed = calls[3:]
    assert calls[:3] == [("none", (0,)), ("eagle3", (0,)), ("hf", (0,))]  # warm-ups
    assert timed == [("none", (0,)), ("eagle3", (0,)), ("hf", (0,)),
                     ("eagle3", (1,)), ("hf", (1,)), ("none", (1,)),
                     ("hf", (2,)), ("none", (2,)), ("eagle3", (2,))]
    rows = {r["label"]: r for r in json.loads(report.read_text())["comparison"]}
    assert rows["eagle3"]["same_as_none"]["same"] and rows["hf"]["same_as_none"]["same"]
    runs = json.loads(report.read_text())["runs"]
    assert [[q["task_id"] for q in run["requests"]] for run in runs] == [[0, 1, 2]] * 3
    # the engine's verify steps while timed, by what they verified (none for transformers)
    forwards = {r["label"]: sum(q["target_forwards"] for q in r["requests"]) for r in runs[:2]}
    assert runs[0]["verify_steps"] == {"none": forwards["none"]} and runs[2]["verify_steps"] is None
    assert sum(runs[1]["verify_steps"].values()) == forwards["eagle3"] and set(runs[1]["verify_steps"]) <= {
        "eagle3", "none", "prompt_lookup"}
    calls.clear()
    assert _bench(capsys, *args, "--no-interleave")[0] == 0
    assert [c for c in calls if len(c[1]) > 1] == [("none", (0, 1, 2)), ("eagle3", (0, 1, 2)), ("hf", (0, 1, 2))]


def test_repeats_pass_over_the_requests_again_the_rotation_going_on(tmp_path, capsys, monkeypatch):
    """`--repeats 2`: two passes over the requests, configurations taking turns as in one
    pass (the rotation goes on across passes); each run holds both passes' results and
    the tok/s of each pass, the comparison each pass's speedup."""
    calls = []
    original = bench.run_engine

    def recording(engine, entry, reqs, *a, **kw):
        calls.append((entry, tuple(r.task_id for r in reqs)))
        return original(engine, entry, reqs, *a, **kw)
    monkeypatch.setattr(bench, "run_engine", recording)
    report = tmp_path / "repeats.json"
    code, out = _bench(capsys, "latency", "--question-set", str(HUMANEVAL), "--num-requests", "1", "--output-tokens",
                       "4", "--warmup", "0", "--no-progress", "--compare", "none,eagle3", "--dtype", "float64",
                       "--repeats", "2", "--report-json", str(report))
    assert code == 0
    assert calls == [("none", ()), ("eagle3", ()), ("none", (0,)), ("eagle3", (0,)), ("eagle3", (0,)), ("none", (0,))]
    data = json.loads(report.read_text())
    assert [len(run["requests"]) for run in data["runs"]] == [2, 2]
    assert all(len(run["pass_throughputs"]) == 2 for run in data["runs"])
    row = data["comparison"][1]
    first, second = (data["runs"][1]["pass_throughputs"][i] / data["runs"][0]["pass_throughputs"][i] for i in (0, 1))
    assert row["speedup_repeats"] == [first, second] and row["same_as_none"]["same"]
    assert "over 2 paired passes" in out
    code = bench.main(["--family", str(FAMILY), "latency", "--question-set", str(HUMANEVAL), "--repeats", "2"])
    assert code == 2 and "--repeats needs --compare" in capsys.readouterr().err


def test_graphed_runs_count_the_captures_made_while_timed(tmp_path, capsys):
    """--cuda-graphs (emulated on CPU): each engine configuration reports how many graph
    buckets were first needed while it was timed (the warm-up's are not counted);
    `transformers` has none. Without --cuda-graphs nothing is counted."""
    report = tmp_path / "graphs.json"
    code, out = _bench(capsys, "latency", "--question-set", str(HUMANEVAL), "--num-requests", "2",
                       "--output-tokens", "6", "--warmup", "1", "--no-progress", "--compare", "none,eagle2,hf",
                       "--cuda-graphs", "--adaptive", "off", "--report-json", str(report))
    assert code == 0 and "CUDA graphs captured while timed" in out
    runs = {r["label"]: r for r in json.loads(report.read_text())["runs"]}
    assert runs["hf"]["graph_captures"] is None
    for label in ("none", "eagle2"):
        count, seconds = runs[label]["graph_captures"]
        assert count >= 0 and seconds == 0.0  # CPU: buckets are created, nothing is captured
    assert runs["eagle2"]["graph_captures"][0] >= 1  # the second prompt needs buckets the first did not
    assert _bench(capsys, "latency", "--question-set", str(HUMANEVAL), *SMALL, "--method", "none",
                  "--report-json", str(report))[0] == 0
    assert json.loads(report.read_text())["runs"][0]["graph_captures"] is None


def test_entries_can_name_an_eagle_tree_size(tmp_path, capsys):
    """`eagle3@3` and `eagle3@2` run side by side in one engine with 3- and 2-node trees,
    drafted as adaptive speculation drafts those sizes, beside Medusa's best 2 paths and
    the draft model's 1-token chain; no step emits more tokens than its tree has nodes,
    and all stay lossless."""
    report = tmp_path / "sizes.json"
    code, out = _bench(capsys, "latency", "--question-set", str(HUMANEVAL), "--num-requests", "2",
                       "--output-tokens", "12", "--warmup", "0", "--no-progress", "--dtype", "float64",
                       "--compare", "none,eagle3@3,eagle3+nolookup@3,eagle3@2,eagle2@4,eagle2@4/3,medusa@3,draft_model@2",
                       "--report-json", str(report))
    assert code == 0
    data = json.loads(report.read_text())
    runs = {r["label"]: r for r in data["runs"]}
    assert runs["eagle3@3"]["tree"] == "dynamic depth=2 top_k=2 total_tokens=3, lookup 10"  # the engine's default
    assert runs["eagle3+nolookup@3"]["tree"] == "dynamic depth=2 top_k=2 total_tokens=3"
    assert runs["eagle3@2"]["tree"] == "dynamic depth=1 top_k=1 total_tokens=2, lookup 10"
    assert runs["eagle2@4"]["tree"] == "dynamic depth=2 top_k=2 total_tokens=4, lookup 10"
    assert runs["eagle2@4/3"]["tree"] == "dynamic depth=3 top_k=2 total_tokens=4, lookup 10"  # one depth deeper
    assert runs["medusa@3"]["tree"] == "static first 2 paths of mc_sim_7b_63 (3 nodes), lookup 10"
    assert runs["draft_model@2"]["tree"] == "chain of 1"
    for label, nodes in (("eagle3@3", 3), ("eagle3+nolookup@3", 3), ("eagle3@2", 2), ("eagle2@4", 4), ("eagle2@4/3", 4),
                         ("medusa@3", 3), ("draft_model@2", 2)):
        assert max(int(k) for k in runs[label]["step_tau_histogram"]) <= nodes
    assert all(r["same_as_none"]["same"] for r in data["comparison"][1:])


def test_sampled_runs_take_a_nucleus(tmp_path, capsys, monkeypatch):
    """--temperature with --top-p reaches every engine request and the report."""
    seen = []
    sampling_for = bench.sampling_for
    monkeypatch.setattr(bench, "sampling_for", lambda args, task_id: seen.append(sampling_for(args, task_id))
                        or seen[-1])
    report = tmp_path / "sampled.json"
    code, out = _bench(capsys, "latency", "--question-set", str(HUMANEVAL), "--num-requests", "2",
                       "--output-tokens", "6", "--warmup", "0", "--no-progress", "--compare", "none,eagle3",
                       "--temperature", "0.8", "--top-p", "0.9", "--report-json", str(report))
    assert code == 0 and "Top-p" in out and json.loads(report.read_text())["config"]["top_p"] == 0.9
    assert len(seen) == 4 and {(s.temperature, s.top_p) for s in seen} == {(0.8, 0.9)}
    assert sorted(s.seed for s in seen) == [0, 0, 1, 1]  # a stream per request, the same for every configuration
    seen.clear()
    assert _bench(capsys, "latency", "--question-set", str(HUMANEVAL), "--num-requests", "2", "--output-tokens", "6",
                  "--warmup", "0", "--no-progress", "--temperature", "0.8", "--unseeded")[0] == 0
    assert len(seen) == 2 and all(s.seed is None for s in seen)


def test_bad_arguments_exit_2(capsys):
    code = bench.main(["--family", str(FAMILY), "latency", "--question-set", str(HUMANEVAL), "--compare", "none,nope"])
    assert code == 2 and "unknown configuration 'nope'" in capsys.readouterr().err
    for entry in ("eagle@3", "eagle3@1", "eagle3@x", "hf@2", "medusa@1", "draft_model@0"):
        code = bench.main(["--family", str(FAMILY), "latency", "--question-set", str(HUMANEVAL),
                           "--compare", f"none,{entry}"])
        assert code == 2 and "METHOD@N" in capsys.readouterr().err, entry
    for entry in ("medusa@3/2", "eagle3@8/0", "eagle3@8/x", f"eagle2@8/{MAX_DEPTH + 1}"):
        code = bench.main(["--family", str(FAMILY), "latency", "--question-set", str(HUMANEVAL),
                           "--compare", f"none,{entry}"])
        assert code == 2 and "a drafting depth is eagle2@N/D" in capsys.readouterr().err, entry
    for entry in ("draft_model+lookup", "eagle3+look", "hf+nolookup@2"):
        code = bench.main(["--family", str(FAMILY), "latency", "--question-set", str(HUMANEVAL),
                           "--compare", f"none,{entry}"])
        assert code == 2 and "+lookup and +nolookup follow" in capsys.readouterr().err, entry
    for top_p in ("0", "1.5"):
        code = bench.main(["--family", str(FAMILY), "latency", "--question-set", str(HUMANEVAL),
                           "--temperature", "0.8", "--top-p", top_p])
        assert code == 2 and "--top-p must be in (0, 1]" in capsys.readouterr().err, top_p


def test_eval_family_tiny(tmp_path, capsys):
    card = tmp_path / "MODEL_CARD.md"
    card.write_text("# card\n\n<!-- eval_family:begin -->\nold\n<!-- eval_family:end -->\n\nafter\n")
    for snapshot in (tmp_path / "round2" / "1000", tmp_path / "round1" / "500"):  # two rounds' snapshots
        for head in ("eagle", "eagle3"):  # a training snapshot: the heads' directories
            shutil.copytree(FAMILY / head, snapshot / head)
    out_json = tmp_path / "family.json"
    code = eval_family.main(["--family", str(FAMILY), "--snapshots", str(tmp_path / "round1"), str(tmp_path / "round2"),
                             "--questions", "1", "--curve-tokens", "8", "--answer-tokens", "8", "--max-seq-len", "256",
                             "--json", str(out_json), "--model-card", str(card)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out_json.read_text())
    assert [a["set"] for a in data["answers"]] == ["humaneval", "mt_bench", "gsm8k", "alpaca"]
    assert all(a["question"] and isinstance(a["answer"], str) for a in data["answers"])
    curve = data["learning_curve"]
    assert [r["answer_tokens"] for r in curve][:2] == [500, 1000] and curve[-1]["final"]
    for r in curve:
        assert r["equal_to_plain"]  # greedy speculation is lossless
        assert all(r[f"{m}_{s}"] >= 1.0 for m in ("eagle2", "eagle3") for s in ("mt_bench", "humaneval"))
    text = card.read_text()
    assert "\nold\n" not in text and text.endswith("after\n")
    assert data["shipped_tokens"] == eval_family.shipped_tokens()  # the committed heads' training records
    for part in ("### What the target answers", "### Learning curve", "| 500 |", "| 1,000 |",
                 "python tools/bench/eval_family.py --family"):
        assert part in text
    # a later round on another machine: the earlier points come from the report, first, with their date
    later = tmp_path / "later.json"
    code = eval_family.main(["--family", str(FAMILY), "--snapshots", str(tmp_path / "round2"), "--earlier", str(out_json),
                             "--questions", "1", "--curve-tokens", "8", "--answer-tokens", "8", "--max-seq-len", "256",
                             "--json", str(later), "--model-card", str(card)])
    assert code == 0, capsys.readouterr().err
    again = json.loads(later.read_text())["learning_curve"]
    assert [r["answer_tokens"] for r in again] == [r["answer_tokens"] for r in curve] + [1000, curve[-1]["answer_tokens"]]
    assert [r["final"] for r in again] == [False] * (len(curve) + 1) + [True]
    assert all(r["measured"] == data["date"] for r in again[: len(curve)]) and "measured" not in again[-1]
    assert again[-1]["eagle3_humaneval"] == curve[-1]["eagle3_humaneval"]  # the same heads measure the same
    assert f"| 1,000 (measured {data['date']}) |" in card.read_text()
    # --curve-sets: a question file of one's own (named by its stem) beside an EAGLE set
    own = tmp_path / "held_out.jsonl"
    own.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Name three colours."]}) + "\n")
    code = eval_family.main(["--family", str(FAMILY), "--snapshots", str(tmp_path / "none"), "--curve-sets", "gsm8k",
                             str(own), "--questions", "1", "--curve-tokens", "8", "--answer-tokens", "8",
                             "--max-seq-len", "256", "--json", str(later), "--model-card", str(card)])
    assert code == 0, capsys.readouterr().err
    (row,) = json.loads(later.read_text())["learning_curve"]
    assert sorted(k for k in row if k.startswith("eagle")) == ["eagle2_gsm8k", "eagle2_held_out", "eagle3_gsm8k",
                                                               "eagle3_held_out"]
    assert "| EAGLE-2 GSM8K | EAGLE-2 held_out | EAGLE-3 GSM8K | EAGLE-3 held_out |" in card.read_text()


def test_the_learning_curve_refuses_heads_of_two_rounds(tmp_path, capsys):
    """The last point stands at its heads' answer tokens: heads trained on different counts
    (the shipped family once a round shipped one head) are refused before any model loads,
    and a round's own output folder (`--heads`) gives the point its count."""
    heads = tmp_path / "round"
    for head, tokens in (("eagle", 100), ("eagle3", 200)):
        shutil.copytree(FAMILY / head, heads / head)
        (heads / head / "training.json").write_text(json.dumps({"answer_tokens_seen": tokens}))
    with pytest.raises(SystemExit, match="EAGLE-1 head .* 100 answer tokens and its EAGLE-3 head on 200"):
        eval_family.main(["--family", str(FAMILY), "--heads", str(heads), "--snapshots", str(tmp_path / "none")])
    assert eval_family.heads_answer_tokens(FAMILY) is None  # no record: the card prints "?"
    (heads / "eagle3" / "training.json").write_text(json.dumps({"answer_tokens_seen": 100}))
    assert eval_family.heads_answer_tokens(heads) == 100
    committed = eval_family.shipped_tokens()
    if len(set(committed.values())) > 1:  # the shipped family mixes rounds (the committed records stand for it)
        with pytest.raises(SystemExit, match="one learning-curve point cannot stand at both"):
            eval_family.heads_answer_tokens(eval_family.FAMILY_DIR)


def test_the_learning_curve_marks_the_points_whose_heads_are_shipped():
    """A round may ship one head and keep the other's earlier round: each of this run's
    points says which committed heads it holds; an earlier report's points say nothing."""
    shipped = {"eagle2": 100, "eagle3": 200}

    def label(tokens, shipped=shipped, **row):
        return eval_family.shipped_label({"answer_tokens": tokens, "final": False, **row}, shipped)

    assert label(100) == " (EAGLE-2's shipped)"
    assert label(200, final=True) == " (EAGLE-3's shipped)"
    assert label(300, final=True) == ""
    assert label(200, shipped={"eagle2": 200, "eagle3": 200}) == " (shipped)"
    assert label(100, measured="2026-11-27") == ""  # an earlier report's point
    assert label(100, shipped=None, final=True) == " (shipped)"  # a report written before shipped_tokens
    card = eval_family.card_section({"date": "d", "command": "c", "machine": {}, "answer_tokens": 8, "answers": [],
                                     "questions": 1, "curve_tokens": 8, "shipped_tokens": shipped,
                                     "learning_curve": [{"answer_tokens": 200, "final": True, "equal_to_plain": True,
                                                         "eagle2_mt_bench": 1.5, "eagle3_mt_bench": 1.75}]})
    assert "| 200 (EAGLE-3's shipped) | 1.50 | 1.75 |" in card


def test_same_as_names_where_each_differing_output_first_leaves_the_reference():
    def run(label, outputs):
        results = [bench.RequestResult(task_id=i, input_len=3, submit_s=0.0, output_ids=list(ids))
                   for i, ids in enumerate(outputs)]
        return bench.Run(label=label, tree="-", results=results, wall_s=1.0)

    plain = run("none", [[5, 6, 7, 8], [1, 2, 3], [9, 9]])
    tree = run("eagle2", [[5, 6, 0, 8], [1, 2, 3], [9]])  # flips at token 2; equal; a prefix of length 1
    same = bench.same_as(tree, plain)
    assert (same["equal"], same["total"], same["same"]) == (1, 3, False)
    assert same["first_differences"] == [1, 2]
    assert bench._differ_text(same) == "2/3 differ, first at token 1"
    assert bench.same_as(run("eagle3", [[5, 6, 7, 8], [1, 2, 3], [9, 9]]), plain)["first_differences"] == []


def test_reports_carry_no_machine_paths():
    """Committed reports write the checkout as `.`, its folder as `..` and the home folder
    as `~` (the engine's load note names the calibration cache under the home folder)."""
    from pathlib import Path
    root = Path(bench.__file__).resolve().parents[2]
    note = f"weights {root}/.cache/smollm2/base; saved to {Path.home()}/.cache/specdec/calibration-0.json"
    assert bench.portable(note) == "weights ./.cache/smollm2/base; saved to ~/.cache/specdec/calibration-0.json"
    assert bench.portable(root.parent / "shared" / "data") == "../shared/data"
    # and what is committed says so: no report or log names this checkout, its folder or home
    machine = [m for m in (str(root) + "/", str(root.parent) + "/", str(Path.home()) + "/", "/root/")
               if m.strip("/")]  # a checkout or home at / would match every URL's "//"
    leaks = [f.name for f in (root / "docs" / "bench").iterdir()
             if f.suffix in (".json", ".md", ".txt", ".log") and any(m in f.read_text() for m in machine)]
    assert leaks == []


def test_load_footprint_loads_medusa_with_and_without_its_drafting_vocabulary(tmp_path, capsys):
    """Each configuration loads in its own process; without the file the heads keep their
    full-vocabulary projections, with it only the vocabulary's rows."""
    import load_footprint
    import torch
    from safetensors.torch import save_file

    family = tmp_path / "family"
    family.mkdir()
    (family / "base").symlink_to(FAMILY / "base")
    shutil.copytree(FAMILY / "medusa", family / "medusa")
    save_file({"token_ids": torch.arange(0, 64, 2)}, str(family / "medusa" / load_footprint.DRAFT_VOCAB_FILE))
    report = tmp_path / "footprint.md"
    assert load_footprint.main(["--family", str(family), "--repeats", "1", "--markdown", str(report)]) == 0
    kept, full = [int(line.split(" | ")[3].strip(" |").replace(",", ""))  # "with" first, then "without"
                  for line in report.read_text().splitlines() if line.startswith("| with")]
    heads = json.loads((FAMILY / "medusa" / "config.json").read_text())["medusa_num_heads"]
    base = json.loads((FAMILY / "base" / "config.json").read_text())
    assert full - kept == heads * (base["vocab_size"] - 32) * base["hidden_size"]  # 32 of the rows kept
    # the heads alone, cut as they load and loaded whole: the same parameters either way
    assert load_footprint.main(["--family", str(family), "--repeats", "1", "--heads-only",
                                "--markdown", str(report)]) == 0
    counts = [int(line.split(" | ")[3].strip(" |").replace(",", ""))
              for line in report.read_text().splitlines() if line.startswith("| heads alone")]
    assert counts == [kept, kept]


def test_bench_chunked_prefill_runs_each_setting_in_turns(tmp_path):
    """Every setting runs (with `--apart`, each also with mixed prefill off), the tokens are
    compared (greedy: equal), and with chunked prefill off the running requests get
    nothing while the long prompt is prefilled."""
    import bench_chunked_prefill

    report = tmp_path / "chunked.md"
    bench_chunked_prefill.main(["--family", str(FAMILY), "--running", "2", "--running-output", "80",
                                "--long-tokens", "48", "--long-output", "2", "--warm-steps", "2",
                                "--piece-sizes", "8,16", "--repeats", "1", "--apart", "--report-md", str(report)])
    rows = [line.split(" | ") for line in report.read_text().splitlines() if line.startswith("| o")]
    assert [r[0] for r in rows] == ["| off", "| off, apart", "| on, 8 tokens", "| on, 8 tokens, apart",
                                    "| on, 16 tokens", "| on, 16 tokens, apart"]
    assert float(rows[0][3]) == 0.0 and float(rows[1][3]) == 0.0 and float(rows[2][3]) > 0
