"""Runs AIPerf (GenAI-Perf's successor) against labelled servers, through Triton and
through the OpenAI front door, and compares the runs.

Owns: installing AIPerf into its own virtual environment (AIPerf 0.13.0 pulls numpy 2
and about a hundred packages; the project's environment keeps numpy < 2 for Triton's
Python backend), the `aiperf profile` command per (label, endpoint, stimulus), and
reading AIPerf's exports into tables. The tables are genai_perf_compare's: AIPerf
exports the same metric names and statistics, so plain and speculative serving read
side by side as they do under GenAI-Perf. It starts no server (tools/bench/aiperf_run.sh
serves each label in turn).

Endpoints, per label (a host running tritonserver and the front door):

    triton  Triton's HTTP `POST /v2/models/<model>/generate_stream` on the ensemble (the
            KServe v2 generate extension). AIPerf 0.13.0, the newest on PyPI here, has
            an HTTP transport only and no KServe or gRPC endpoint type; its `template`
            endpoint sends the ensemble's inputs as JSON (tools/bench/aiperf_triton_generate.json)
            and reads `text_output` from every event.
    openai  the front door's `/v1/chat/completions` (`--endpoint-type chat`); the server
            applies the chat template.

    # once: .cache/aiperf-venv with aiperf==0.13.0
    python tools/bench/aiperf_compare.py install

    # plain and EAGLE-2 servers at once (or one label per call, as aiperf_run.sh does)
    python tools/bench/aiperf_compare.py profile --tokenizer .cache/smollm2/base \\
        --label plain=localhost --label eagle2=otherhost --input-file prompts.jsonl \\
        --output-tokens 128 --concurrency 1 4 --request-count 40 --out-dir artifacts/aiperf

    # re-read finished runs: LABEL=FOLDER, a label's folder of `profile`
    python tools/bench/aiperf_compare.py compare plain=artifacts/aiperf/plain eagle2=artifacts/aiperf/eagle2

With `--input-file`, Triton's endpoint gets each prompt rendered with the tokenizer's
chat template (as the front door renders it for chat), so both endpoints generate the
same tokens. Every request is greedy (`temperature` 0, which the ensemble also defaults to; the front
door's default is the model's sampling, `sampling_defaults.py`) and, with `--deterministic`,
generates exactly `--output-tokens` tokens (`min_tokens`). Token counts are AIPerf's own: the streamed text re-encoded with
`--tokenizer`, so they can differ from the tokens the server generated.
Artifacts: `<out-dir>/<label>/<endpoint>/<stimulus>/profile_export_aiperf.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import genai_perf_compare as gpc  # noqa: E402  (the tables, and CompareError)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".cache" / "aiperf-venv"
PINNED = "aiperf==0.13.0"
EXPORT = "profile_export_aiperf.json"
TRITON_TEMPLATE = Path(__file__).resolve().parent / "aiperf_triton_generate.json"
ENDPOINTS = ("triton", "openai")
# input_sequence_length is not among them: AIPerf 0.13.0's template endpoint with an input
# file does not report it.
REQUIRED_METRICS = ("request_latency", "output_sequence_length", "output_token_throughput", "request_throughput")


# ---------------------------------------------------------------- install


def install(venv: Path = DEFAULT_VENV) -> None:
    """Idempotent: the virtual environment and the pinned AIPerf."""
    aiperf = venv / "bin" / "aiperf"
    if aiperf.exists():
        version = subprocess.run([str(aiperf), "--version"], capture_output=True, text=True, check=False)
        if PINNED.split("==")[1] in version.stdout + version.stderr:
            print(f"AIPerf {PINNED.split('==')[1]} ready in {venv}", file=sys.stderr)
            return
    if not (venv / "bin" / "python").exists():
        print(f"creating {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(f"pip install {PINNED}", file=sys.stderr)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", PINNED], check=True)


# ---------------------------------------------------------------- artifacts


def load_export(export: Path) -> dict[str, dict[str, float]]:
    """{metric: {stat: value}} of one `profile_export_aiperf.json` (GenAI-Perf's layout)."""
    try:
        metrics = gpc.read_export_json(export)
    except (OSError, ValueError) as exc:
        raise gpc.CompareError(f"{export}: cannot parse: {exc}") from None
    missing = [m for m in REQUIRED_METRICS if m not in metrics]
    if missing:
        raise gpc.CompareError(f"{export}: missing metrics {missing}")
    return metrics


def load_label(path: str | Path) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
    """{(endpoint, stimulus): metrics} for a label's folder (`<endpoint>/<stimulus>/<export>`)."""
    path = Path(path)
    if not path.is_dir():
        raise gpc.CompareError(f"{path}: no such directory")
    runs = {}
    for export in sorted(path.glob(f"*/*/{EXPORT}")):
        endpoint, stimulus = export.parent.parent.name, export.parent.name
        runs[(endpoint, stimulus)] = load_export(export)
    if not runs:
        raise gpc.CompareError(f"{path}: no <endpoint>/<stimulus>/{EXPORT} inside (did aiperf finish?)")
    return runs


def tables(labelled: dict[str, dict[tuple[str, str], dict]]) -> dict[str, dict[str, dict]]:
    """{table title: {column: metrics}}: for every endpoint and stimulus the labels side by
    side (the first label is the base), and for every label with both endpoints, the front
    door against Triton's own endpoint."""
    labels = list(labelled)
    out: dict[str, dict[str, dict]] = {}
    for key in labelled[labels[0]]:
        lacking = [label for label in labels if key not in labelled[label]]
        if lacking:
            raise gpc.CompareError(f"{key[0]} {key[1]}: no run for {', '.join(lacking)}")
        out[f"{key[0]} {key[1]}"] = {label: labelled[label][key] for label in labels}
    for label in labels:
        for endpoint, stimulus in labelled[label]:
            if endpoint == "triton" and ("openai", stimulus) in labelled[label]:
                out[f"{label} {stimulus}: openai vs triton"] = {
                    "triton": labelled[label][("triton", stimulus)], "openai": labelled[label][("openai", stimulus)]}
    return out


# ---------------------------------------------------------------- profile


def parse_label(spec: str) -> tuple[str, str]:
    name, _, host = spec.partition("=")
    if not name or "/" in name or name.startswith("."):
        raise gpc.CompareError(f"--label {spec!r}: expected NAME or NAME=HOST")
    return name, host or "localhost"


def first_served_model(host: str, port: int, api_key: str | None) -> str:
    """The front door's preferred model: the first that `GET /v1/models` lists."""
    import urllib.request

    request = urllib.request.Request(f"http://{host}:{port}/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise gpc.CompareError(f"GET http://{host}:{port}/v1/models: {e}") from None


def templated_prompts(input_file: Path, tokenizer_dir: str, out: Path) -> Path:
    """A copy of a `{"text": prompt}` JSONL with each prompt rendered by the tokenizer's chat
    template, as the front door renders it: Triton's endpoint then sees the same tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    lines = []
    for line in Path(input_file).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            row["text"] = tokenizer.apply_chat_template([{"role": "user", "content": row["text"]}], tokenize=False,
                                                        add_generation_prompt=True)
            lines.append(json.dumps(row))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


# AIPerf 0.13.0 at a fixed concurrency alone polls for a free slot without sleeping
# (`RequestRateStrategy.execute_phase` yields to its event loop and retries at once), so
# its timing manager holds a whole core for the run: on a 2-core machine serving on both
# cores, that halved the server (a 128-token plain-decoding request had not returned
# after 90 s). Niceness does not help across the kernel's per-session autogroups. With a
# request rate beside the concurrency it polls at that rate instead: a slot that frees
# waits at most 1 / POLL_RATE s for its next request.
POLL_RATE = "20"


def aiperf_command(args: argparse.Namespace, venv: Path, endpoint: str, host: str, stimulus: tuple[str, str],
                   artifact_dir: Path) -> list[str]:
    kind, value = stimulus
    cmd = [str(venv / "bin" / "aiperf"), "profile", "--tokenizer", str(args.tokenizer),
           "--artifact-dir", str(artifact_dir), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
           "--random-seed", str(args.random_seed), f"--{kind.replace('_', '-')}", value,
           "--osl", str(args.output_tokens), "--request-count", str(args.request_count)]
    if kind == "concurrency":
        cmd += ["--request-rate", POLL_RATE, "--arrival-pattern", "constant"]
    if endpoint == "triton":
        route = "generate_stream" if not args.no_streaming else "generate"
        cmd += ["-m", args.triton_model, "--url", f"http://{host}:{args.http_port}", "--endpoint-type", "template",
                "--custom-endpoint", f"/v2/models/{args.triton_model}/{route}",
                "--extra-inputs", f"payload_template:{TRITON_TEMPLATE}", "--extra-inputs", "response_field:text_output"]
    else:
        api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
        model = args.openai_model or first_served_model(host, args.openai_port, api_key)
        cmd += ["-m", model, "--url", f"http://{host}:{args.openai_port}", "--endpoint-type", "chat"]
        if api_key:
            cmd += ["--api-key", api_key]
    if not args.no_streaming:
        cmd.append("--streaming")
    if args.input_file:
        input_file = args.triton_input_file if endpoint == "triton" and args.triton_input_file else args.input_file
        cmd += ["--input-file", str(input_file), "--custom-dataset-type", "single_turn"]
    else:
        cmd += ["--isl", str(args.input_tokens)]
    cmd += ["--extra-inputs", f"temperature:{args.temperature}"]
    if args.deterministic:
        cmd += ["--extra-inputs", f"min_tokens:{args.output_tokens}"]
    if args.warmup_request_count:
        cmd += ["--warmup-request-count", str(args.warmup_request_count)]
    return cmd + shlex.split(args.aiperf_args)


def profile(args: argparse.Namespace) -> dict[str, dict[tuple[str, str], dict]]:
    venv = Path(args.venv)
    if not (venv / "bin" / "aiperf").exists():
        raise gpc.CompareError(f"no AIPerf in {venv}: run `python tools/bench/aiperf_compare.py install`")
    if not Path(args.tokenizer).is_dir():
        raise gpc.CompareError(f"--tokenizer {args.tokenizer}: not a directory (AIPerf cannot download one here)")
    labels = [parse_label(s) for s in args.label]
    if len({name for name, _ in labels}) != len(labels):
        raise gpc.CompareError("label names must be unique")
    stimuli = [("concurrency", str(c)) for c in args.concurrency or []]
    stimuli += [("request_rate", str(r)) for r in args.request_rate or []]
    stimuli = stimuli or [("concurrency", "1")]
    args.triton_input_file = None
    if args.input_file and not args.raw_triton_prompts and "triton" in args.endpoint:
        args.triton_input_file = templated_prompts(args.input_file, args.tokenizer,
                                                   Path(args.out_dir) / "prompts_chat_template.jsonl")
    env = {**os.environ, "COLUMNS": os.environ.get("COLUMNS", "160")}
    results: dict[str, dict[tuple[str, str], dict]] = {}
    for name, host in labels:
        for endpoint in args.endpoint:
            port = args.http_port if endpoint == "triton" else args.openai_port
            gpc._check_reachable(f"{host}:{port}")
            for kind, value in stimuli:
                stim = f"{kind}{value}"
                artifact_dir = Path(args.out_dir) / name / endpoint / stim
                cmd = aiperf_command(args, venv, endpoint, host, (kind, value), artifact_dir)
                shown = ["***" if i and cmd[i - 1] == "--api-key" else a for i, a in enumerate(cmd)]
                print(f"[{name} {endpoint} {stim}] {shlex.join(shown)}", file=sys.stderr)
                done = subprocess.run(cmd, env=env, stdout=sys.stderr, check=False)
                if done.returncode != 0:
                    raise gpc.CompareError(f"[{name} {endpoint} {stim}] aiperf exited with {done.returncode}")
                results.setdefault(name, {})[(endpoint, stim)] = load_export(artifact_dir / EXPORT)
    return results


# ---------------------------------------------------------------- report


def report(labelled: dict[str, dict[tuple[str, str], dict]], json_out: Path | None, markdown: Path | None,
           footer: str = "") -> str:
    texts, export, md = [], {}, []
    for title, runs in tables(labelled).items():
        rows = gpc.compare(runs)
        texts.append(f"== {title} ==\n{gpc.format_table(rows)}")
        md.append(f"**{title}**\n\n{gpc.format_markdown(rows)}")
        export[title] = {"runs": runs, "rows": rows}
    for path, text in ((json_out, json.dumps(export, separators=(",", ":")) + "\n"),
                       (markdown, "\n\n".join(md + ([footer] if footer else [])) + "\n")):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return "\n\n".join(texts)


def provenance(argv: list[str], venv: Path) -> str:
    aiperf = venv / "bin" / "aiperf"
    version = subprocess.run([str(aiperf), "--version"], capture_output=True, text=True,
                             check=False).stdout.strip() if aiperf.exists() else "(not found)"
    return gpc.provenance(argv, venv, script="aiperf_compare.py", version=f"aiperf {version}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="AIPerf virtual environment")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help=f"install {PINNED} into --venv")

    p = sub.add_parser("profile", help="run aiperf per label, endpoint and stimulus, then compare")
    p.add_argument("--label", action="append", required=True, help="NAME or NAME=HOST; repeat (first: the base)")
    p.add_argument("--endpoint", nargs="+", choices=ENDPOINTS, default=list(ENDPOINTS))
    p.add_argument("--http-port", type=int, default=8000, help="Triton's HTTP port")
    p.add_argument("--openai-port", type=int, default=9000, help="the front door's port")
    p.add_argument("--triton-model", default="ensemble", help="the Triton model behind generate_stream")
    p.add_argument("--openai-model", default=None,
                   help="a model the front door serves (default: the first that GET /v1/models lists)")
    p.add_argument("--api-key-env", default="SPECDEC_API_KEY", help="environment variable holding the API key")
    p.add_argument("--tokenizer", required=True, help="local tokenizer directory")
    p.add_argument("--input-file", help="JSONL of {\"text\": prompt} (tools/dataset_converter.py); default synthetic")
    p.add_argument("--raw-triton-prompts", action="store_true",
                   help="send Triton's endpoint the --input-file prompts as they are (default: rendered with the "
                        "chat template, as the front door renders them)")
    p.add_argument("--input-tokens", type=int, default=128, help="synthetic prompt length (no --input-file)")
    p.add_argument("--output-tokens", type=int, default=128, help="max_tokens of every request")
    p.add_argument("--deterministic", action="store_true", help="every request generates exactly --output-tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, nargs="+", help="one run per value (default: 1)")
    p.add_argument("--request-rate", type=float, nargs="+", help="one run per value")
    p.add_argument("--request-count", type=int, default=40, help="requests measured per run")
    p.add_argument("--warmup-request-count", type=int, default=0)
    p.add_argument("--no-streaming", action="store_true", help="no TTFT/ITL")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--aiperf-args", default="", help="extra arguments for every aiperf run")
    p.add_argument("--out-dir", default="artifacts/aiperf-compare")
    p.add_argument("--json-out", default=None, help="default: <out-dir>/comparison.json")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown here")

    c = sub.add_parser("compare", help="compare finished runs")
    c.add_argument("runs", nargs="+", help="LABEL=FOLDER (a label's folder of `profile`); first is the base")
    c.add_argument("--json-out", default=None)
    c.add_argument("--markdown", default=None)

    args = parser.parse_args(argv)
    return gpc.run_command(args, argv, install, profile, lambda runs: gpc.labelled_paths(runs, load_label),
                           provenance, report)


if __name__ == "__main__":
    sys.exit(main())
