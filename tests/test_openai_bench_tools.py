"""AIPerf's comparison tool, the front door's overhead bench and lm-evaluation-harness's
comparison, without a server: AIPerf's command shape per endpoint, reading its exports
into GenAI-Perf's tables, the overhead summary (ratios within a repeat, CPU per 1000
tokens), and which lm_eval samples answer as the reference run."""
from __future__ import annotations

import argparse
import json
import os

import pytest

import aiperf_compare as apc
import lm_eval_compare as lec
import openai_overhead as ovh

STATS = ("avg", "min", "max", "p99", "p90", "p75", "p50")


def _export(scale: float) -> dict:
    """An AIPerf `profile_export_aiperf.json` in 0.13.0's shape (a few of its metrics)."""
    def metric(unit, value):
        return {"unit": unit, **{s: value for s in STATS}, "std": 0.0, "count": 8}
    return {"schema_version": "1", "aiperf_version": "0.13.0",
            "request_latency": metric("ms", 1000 * scale), "time_to_first_token": metric("ms", 50 * scale),
            "inter_token_latency": metric("ms", 8 * scale), "output_sequence_length": metric("tokens", 128),
            "input_sequence_length": metric("tokens", 64),
            "output_token_throughput": {"unit": "tokens/sec", "avg": 100 / scale},
            "request_throughput": {"unit": "requests/sec", "avg": 0.8 / scale},
            "request_count": {"unit": "requests", "avg": 8.0},
            "input_config": {"endpoint": {"type": "chat"}}}


def _write_label(root, label, scales):
    for (endpoint, stimulus), scale in scales.items():
        folder = root / label / endpoint / stimulus
        folder.mkdir(parents=True)
        (folder / apc.EXPORT).write_text(json.dumps(_export(scale)))
    return root / label


def _args(**kw) -> argparse.Namespace:
    base = dict(tokenizer="tok", random_seed=0, output_tokens=32, request_count=4, no_streaming=False,
                triton_model="ensemble", http_port=8000, openai_port=9000, openai_model="speculative_decoding",
                api_key_env="NO_SUCH_ENV", input_file=None, triton_input_file=None, input_tokens=16, temperature=0.0, deterministic=True,
                warmup_request_count=0, aiperf_args="")
    return argparse.Namespace(**{**base, **kw})


def test_aiperf_commands_per_endpoint(tmp_path):
    venv = tmp_path / "venv"
    triton = apc.aiperf_command(_args(), venv, "triton", "host", ("concurrency", "1"), tmp_path / "a")
    joined = " ".join(triton)
    assert triton[:2] == [str(venv / "bin" / "aiperf"), "profile"]
    assert "--endpoint-type template --custom-endpoint /v2/models/ensemble/generate_stream" in joined
    assert f"payload_template:{apc.TRITON_TEMPLATE}" in triton and "response_field:text_output" in triton
    assert "--url http://host:8000" in joined and "--streaming" in triton and "--concurrency 1" in joined
    assert "min_tokens:32" in triton and "temperature:0.0" in triton and "--isl 16" in joined
    # a concurrency run paces its polling (AIPerf alone would busy-poll a core for a free slot)
    assert f"--request-rate {apc.POLL_RATE} --arrival-pattern constant" in joined
    openai = apc.aiperf_command(_args(input_file="p.jsonl", deterministic=False, no_streaming=True), venv,
                                "openai", "host", ("request_rate", "0.5"), tmp_path / "b")
    joined = " ".join(openai)
    assert "-m speculative_decoding --url http://host:9000 --endpoint-type chat" in joined
    assert "--input-file p.jsonl --custom-dataset-type single_turn" in joined and "--request-rate 0.5" in joined
    assert joined.count("--request-rate") == 1
    assert "--streaming" not in openai and not any(a.startswith("min_tokens") for a in openai)


def test_triton_gets_the_prompts_the_front_door_renders(tmp_path, tokenizer):
    from conftest import TOKENIZER_DIR

    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"text": "Name a river."}) + "\n\n" + json.dumps({"text": "Why?"}) + "\n")
    out = apc.templated_prompts(src, str(TOKENIZER_DIR), tmp_path / "out" / "t.jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["text"] for r in rows] == [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                                       add_generation_prompt=True)
                                         for q in ("Name a river.", "Why?")]
    cmd = apc.aiperf_command(_args(input_file=src, triton_input_file=out), tmp_path, "triton", "h", ("concurrency", "1"),
                             tmp_path / "a")
    assert cmd[cmd.index("--input-file") + 1] == str(out)


def test_the_triton_template_renders_the_ensembles_json():
    import jinja2

    text = apc.TRITON_TEMPLATE.read_text()
    body = json.loads(jinja2.Environment(autoescape=True).from_string(text).render(
        text='say "hi" <b>\n', max_tokens=7, stream=True))
    assert body == {"text_input": 'say "hi" <b>\n', "max_tokens": 7, "stream": True, "exclude_input_in_output": True}


def test_tables_compare_labels_and_endpoints(tmp_path, capsys):
    plain = _write_label(tmp_path, "plain", {("triton", "concurrency1"): 1.0, ("openai", "concurrency1"): 1.1})
    eagle = _write_label(tmp_path, "eagle2", {("triton", "concurrency1"): 0.5, ("openai", "concurrency1"): 0.6})
    md, out = tmp_path / "cmp.md", tmp_path / "cmp.json"
    assert apc.main(["compare", f"plain={plain}", f"eagle2={eagle}", "--markdown", str(md),
                     "--json-out", str(out)]) == 0
    export = json.loads(out.read_text())
    assert set(export) == {"triton concurrency1", "openai concurrency1", "plain concurrency1: openai vs triton",
                           "eagle2 concurrency1: openai vs triton"}
    row = next(r for r in export["triton concurrency1"]["rows"]
               if r["metric"] == "output_token_throughput")
    assert row["ratios"]["eagle2"] == pytest.approx(2.0)
    row = next(r for r in export["plain concurrency1: openai vs triton"]["rows"] if r["metric"] == "request_latency"
               and r["stat"] == "avg")
    assert row["ratios"]["openai"] == pytest.approx(1.1)
    text = md.read_text()
    assert "| metric | stat | plain | eagle2 | eagle2/plain |" in text and "aiperf_compare.py compare" in text
    assert "eagle2/plain" in capsys.readouterr().out


def test_compare_names_what_is_missing(tmp_path, capsys):
    plain = _write_label(tmp_path, "plain", {("triton", "concurrency1"): 1.0, ("openai", "concurrency1"): 1.0})
    eagle = _write_label(tmp_path, "eagle2", {("triton", "concurrency1"): 1.0})
    assert apc.main(["compare", f"plain={plain}", f"eagle2={eagle}"]) == 2
    assert "openai concurrency1: no run for eagle2" in capsys.readouterr().err
    assert apc.main(["compare", f"x={tmp_path / 'nothing'}"]) == 2
    assert apc.main(["compare", str(plain)]) == 2
    assert "expected LABEL=PATH" in capsys.readouterr().err


def test_overhead_summary_takes_ratios_within_repeats():
    runs = []
    for repeat, (grpc_s, openai_s) in enumerate([(10.0, 10.5), (20.0, 20.0)]):
        runs.append(ovh.RouteRun("grpc:ensemble", 16, 1000, grpc_s, 50.0, {"front_door": 0.0, "client": 1.0}))
        runs.append(ovh.RouteRun("openai:ensemble", 16, 1000, openai_s, 60.0, {"front_door": 0.5, "client": 0.5}))
    rows = ovh.summarize(runs)
    assert [r["route"] for r in rows] == ["grpc:ensemble", "openai:ensemble"]
    openai = rows[1]
    assert openai["ratios"] == pytest.approx([10 / 10.5, 1.0])
    assert openai["ratio_to_grpc"] == pytest.approx((10 / 10.5 + 1.0) / 2)
    assert openai["cpu_s_per_1k_tokens"] == {"front_door": pytest.approx(0.5), "client": pytest.approx(0.5)}
    table = ovh.format_rows(rows)
    assert "vs grpc" in table.splitlines()[0] and "openai:ensemble" in table


def test_cpu_accounting_sees_this_process():
    busy = sum(i * i for i in range(300_000))  # some CPU
    assert busy > 0 and ovh.tree_cpu(os.getpid()) > 0
    assert ovh.tree_cpu(os.getpid(), exclude=os.getpid()) == 0 and ovh.tree_cpu(None) == 0


def _lm_eval_run(root, name, loglikelihoods, texts):
    """An lm_eval --output_path folder with --log_samples output for two tasks."""
    folder = root / name / "model_name"
    folder.mkdir(parents=True)
    choice = [{"doc_id": i, "resps": [[[str(v), "False"]] for v in values], "acc": float(i == 0)}
              for i, values in enumerate(loglikelihoods)]
    gen = [{"doc_id": i, "resps": [[t]], "exact_match": float(t == "5")} for i, t in enumerate(texts)]
    for task, samples in (("specdec_capitals", choice), ("specdec_arithmetic", gen)):
        (folder / f"samples_{task}_2026-11-26T10-00-00.jsonl").write_text(
            "\n".join(json.dumps(s) for s in reversed(samples)) + "\n")
    return root / name


def test_lm_eval_compare_counts_the_answers_that_match_the_reference(tmp_path):
    ref = _lm_eval_run(tmp_path, "hf", [[-1.0, -2.0], [-3.0, -0.5]], ["5", "7"])
    near = _lm_eval_run(tmp_path, "served", [[-1.0004, -2.0], [-3.0, -0.5]], ["5", "8"])
    far = _lm_eval_run(tmp_path, "other", [[-1.01, -2.0], [-3.0, -0.5]], ["5", "7"])
    rows = {(r["task"], r["run"]): r for r in lec.compare([ref, near, far], tolerance=1e-3)}
    assert rows[("specdec_capitals", "served")]["same_as_reference"] == 2
    assert rows[("specdec_capitals", "other")]["same_as_reference"] == 1
    assert rows[("specdec_arithmetic", "served")]["same_as_reference"] == 1
    assert rows[("specdec_arithmetic", "hf")]["value"] == 0.5 and rows[("specdec_capitals", "hf")]["value"] == 0.5
    text = lec.markdown(list(rows.values()), "cmd", "hf", 1e-3)
    assert "| specdec_capitals | other | acc | 0.5000 | 1 / 2 |" in text
