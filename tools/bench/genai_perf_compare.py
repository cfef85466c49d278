"""Runs GenAI-Perf 0.0.16 against labelled servers and compares the runs.

Owns three things: installing GenAI-Perf into its own virtual environment, running
the tutorials' `genai-perf profile` command once per (label, stimulus), and reading
GenAI-Perf's exported artifacts into one comparison table (plus a JSON export).
It starts no server: each label points at one that is already running.

    # once: venv + genai-perf==0.0.16 + tritonclient[all]==2.51.0 (perf_analyzer)
    #       + nvidia-cuda-runtime-cu12 + Debian's libb64-0d
    python tools/bench/genai_perf_compare.py install

    # plain and EAGLE-2 servers side by side (or one port, --pause between labels,
    # or one label per call: tools/bench/genai_perf_run.sh starts each server in turn)
    python tools/bench/genai_perf_compare.py profile --tokenizer .cache/smollm2/base \\
        --label plain=localhost:8001 --label eagle2=localhost:9001 \\
        --input-file converted.jsonl --concurrency 1 --request-rate 2 \\
        --request-count 40 --warmup-request-count 2 --out-dir artifacts/compare

    # re-read finished runs: LABEL=PATH, PATH an export file, one run's folder, or a
    # label's folder of `profile` (every stimulus in it is compared)
    python tools/bench/genai_perf_compare.py compare \\
        plain=artifacts/compare/plain eagle2=artifacts/compare/eagle2 --markdown cmp.md

Measurement, as perf_analyzer 2.51 (tritonclient 2.51.0) allows it:
- `--request-count N` measures N requests (concurrency runs, and request rates >= 1).
- A request rate below 1 needs `--measurement-interval MS` (3 windows of MS): with a
  single `--request-rate-range R` perf_analyzer keeps its default end 1.0, so R < 1
  is "multiple request-rate values" and `--request-count` is refused (GenAI-Perf
  passes one, 10, unless told otherwise).
- `--warmup-request-count` goes to concurrency runs only: with a request rate,
  perf_analyzer 2.51 never leaves the warm-up; it keeps sending at the rate until
  killed, and the server goes on decoding what it was sent.

Where 0.0.16 writes (`config/generate/perf_analyzer_config.py`, `export_data/`):
`<--artifact-dir>/<model>-triton-<backend>-<stimulus>/profile_export_genai_perf.json`
(each metric `{"unit", "avg", "min", "max", "std", "p1".."p99"}`, plus
`input_config`) and `..._genai_perf.csv` (a request-metrics block
`Metric,avg,min,max,p99,...,p1` with names like `Request Latency (ms)` and
thousands separators, a blank line, then a `Metric,Value` block for
`Output Token Throughput (tokens/sec)`, `Request Throughput (per sec)`,
`Request Count (count)`). The JSON is read when present, the CSV otherwise. The
stimulus of a run is its folder name's last part (`concurrency1`, `request_rate0.4`).
Ratios in the table are each label's value over the first label's. Sequence lengths
are GenAI-Perf's: the streamed text re-tokenized with `--tokenizer`, so they can be
below the tokens the server generated (runs of spaces merge into one token).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".cache" / "genai-perf-venv"
PINNED = ["genai-perf==0.0.16", "tritonclient[all]==2.51.0", "nvidia-cuda-runtime-cu12==12.9.79"]
EXPORT_STEM = "profile_export_genai_perf"

# (metric key, unit, stats shown). System metrics have one value ("avg").
PERCENTILE_STATS = ("avg", "min", "max", "p99", "p90", "p75")
TABLE_METRICS = (
    ("request_latency", "ms", PERCENTILE_STATS),
    ("time_to_first_token", "ms", PERCENTILE_STATS),
    ("inter_token_latency", "ms", PERCENTILE_STATS),
    ("output_sequence_length", "tokens", PERCENTILE_STATS),
    ("input_sequence_length", "tokens", PERCENTILE_STATS),
    ("output_token_throughput", "tokens/s", ("avg",)),
    ("request_throughput", "req/s", ("avg",)),
    ("request_count", "count", ("avg",)),
)
REQUIRED_METRICS = ("request_latency", "output_sequence_length", "input_sequence_length",
                    "output_token_throughput", "request_throughput")


class CompareError(RuntimeError):
    """A setup, run or artifact problem, reported as one line."""


# ---------------------------------------------------------------- artifacts


def _metric_key(display_name: str) -> str:
    """'Request Latency (ms)' -> 'request_latency' (inverse of GenAI-Perf's title())."""
    name = display_name.split(" (", 1)[0]
    return name.strip().lower().replace(" ", "_")


def _number(cell: str) -> float | None:
    cell = cell.strip()
    if cell in ("", "N/A"):
        return None
    return float(cell.replace(",", ""))


def read_export_json(path: Path) -> dict[str, dict[str, float]]:
    data = json.loads(path.read_text())
    return {
        name: {k: float(v) for k, v in stats.items() if k != "unit" and isinstance(v, (int, float))}
        for name, stats in data.items()
        if isinstance(stats, dict) and "avg" in stats
    }


def read_export_csv(path: Path) -> dict[str, dict[str, float]]:
    """Both blocks of a `*_genai_perf.csv`; other blocks (GPU telemetry) are skipped."""
    metrics: dict[str, dict[str, float]] = {}
    header: list[str] | None = None
    with path.open(newline="") as f:
        for row in csv.reader(f):
            if not row or not any(cell.strip() for cell in row):
                header = None
                continue
            if header is None:
                header = row
                continue
            if header[0] != "Metric" or header[1] == "GPU":
                continue  # telemetry blocks: per-GPU rows
            stat_names = ["avg"] if header[1:] == ["Value"] else header[1:]
            values = {s: _number(c) for s, c in zip(stat_names, row[1:])}
            metrics[_metric_key(row[0])] = {s: v for s, v in values.items() if v is not None}
    return metrics


def stimulus_of(export: Path) -> str:
    """'.../ensemble-triton-tensorrtllm-request_rate0.4/x.json' -> 'request_rate0.4'."""
    return export.parent.name.rsplit("-", 1)[-1]


def find_exports(path: str | Path) -> dict[str, Path]:
    """{stimulus: export file} for a file, one run's folder, or a folder of runs.

    JSON exports are preferred; CSV is used where a run has no JSON."""
    path = Path(path)
    if path.is_file():
        return {stimulus_of(path): path}
    if not path.is_dir():
        raise CompareError(f"{path}: no such file or directory")
    found: dict[str, Path] = {}
    runs = {p.parent: p for p in sorted(path.rglob(EXPORT_STEM + ".csv"))}
    runs.update({p.parent: p for p in sorted(path.rglob(EXPORT_STEM + ".json"))})
    for run_dir, export in sorted(runs.items()):
        stim = stimulus_of(export)
        if stim in found:
            raise CompareError(f"{path}: 2 runs for {stim} inside ({found[stim].parent}, {run_dir}); pass one")
        found[stim] = export
    if not found:
        raise CompareError(f"{path}: no {EXPORT_STEM}.json or .csv inside (did genai-perf finish?)")
    return found


def load_export(export: Path) -> dict[str, dict[str, float]]:
    try:
        metrics = read_export_json(export) if export.suffix == ".json" else read_export_csv(export)
    except (OSError, ValueError) as exc:
        raise CompareError(f"{export}: cannot parse: {exc}") from None
    missing = [m for m in REQUIRED_METRICS if m not in metrics]
    if missing:
        raise CompareError(f"{export}: missing metrics {missing}")
    return metrics


def load_runs(path: str | Path) -> dict[str, dict[str, dict[str, float]]]:
    """{stimulus: metrics} for every run under `path` (see `find_exports`)."""
    return {stim: load_export(export) for stim, export in find_exports(path).items()}


def load_run(path: str | Path) -> dict[str, dict[str, float]]:
    """The metrics of the one run at `path`."""
    runs = find_exports(path)
    if len(runs) > 1:
        raise CompareError(f"{path}: {len(runs)} runs inside ({', '.join(runs)}); pass one")
    return load_export(next(iter(runs.values())))


def by_stimulus(labelled: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """{label: {stimulus: metrics}} -> {stimulus: {label: metrics}}, stimuli of the
    first label; every other label must have each of them."""
    labels = list(labelled)
    results: dict[str, dict[str, dict]] = {}
    for stim in labelled[labels[0]]:
        lacking = [label for label in labels if stim not in labelled[label]]
        if lacking:
            raise CompareError(f"{stim}: no run for {', '.join(lacking)} "
                               f"({lacking[0]} has {', '.join(sorted(labelled[lacking[0]])) or 'none'})")
        results[stim] = {label: labelled[label][stim] for label in labels}
    return results


# ---------------------------------------------------------------- table


def compare(runs: dict[str, dict[str, dict[str, float]]]) -> list[dict]:
    """One row per (metric, stat) found in the first run: values per label and
    ratios label/first (None where a value is missing or the base is 0)."""
    if not runs:
        raise CompareError("nothing to compare")
    labels = list(runs)
    base = runs[labels[0]]
    rows = []
    for metric, unit, stats in TABLE_METRICS:
        if metric not in base:
            continue  # e.g. no TTFT/ITL without --streaming
        for stat in stats:
            values = {label: runs[label].get(metric, {}).get(stat) for label in labels}
            b = values[labels[0]]
            ratios = {
                label: (v / b if v is not None and b not in (None, 0) else None)
                for label, v in values.items() if label != labels[0]
            }
            rows.append({"metric": metric, "unit": unit, "stat": stat, "values": values, "ratios": ratios})
    return rows


def format_table(rows: list[dict]) -> str:
    labels = list(rows[0]["values"])
    others = labels[1:]
    header = ["metric", "stat"] + labels + [f"{o}/{labels[0]}" for o in others]
    body = []
    for r in rows:
        fmt = (lambda v: "n/a" if v is None else f"{v:,.2f}")
        body.append(
            [f"{r['metric']} ({r['unit']})", r["stat"]]
            + [fmt(r["values"][label]) for label in labels]
            + ["n/a" if r["ratios"][o] is None else f"{r['ratios'][o]:.3f}x" for o in others]
        )
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    lines = []
    for n, line in enumerate([header] + body):
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    """The same table in Markdown; values with GenAI-Perf's own 2 decimals."""
    labels = list(rows[0]["values"])
    others = labels[1:]
    lines = ["| metric | stat | " + " | ".join(labels + [f"{o}/{labels[0]}" for o in others]) + " |",
             "| --- | --- |" + " ---: |" * (len(labels) + len(others))]
    for r in rows:
        cells = [f"{r['metric']} ({r['unit']})", r["stat"]]
        cells += ["n/a" if r["values"][label] is None else f"{r['values'][label]:,.2f}" for label in labels]
        cells += ["n/a" if r["ratios"][o] is None else f"{r['ratios'][o]:.3f}x" for o in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- install


def _venv_paths(venv: Path) -> tuple[Path, Path]:
    """(bin dir, nvidia-cuda-runtime-cu12 lib dir) of the GenAI-Perf venv."""
    libs = sorted(venv.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    return venv / "bin", (libs[0] if libs else venv / "missing-cuda-runtime-lib")


def run_env(venv: Path) -> dict[str, str]:
    """PATH finds perf_analyzer; LD_LIBRARY_PATH finds libcudart.so.12 (linked even on CPU)."""
    bin_dir, cuda_lib = _venv_paths(venv)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(cuda_lib), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def _missing_libs(venv: Path) -> list[str]:
    out = subprocess.run(["ldd", str(venv / "bin" / "perf_analyzer")], env=run_env(venv),
                         capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if "not found" in line]


def install(venv: Path = DEFAULT_VENV) -> None:
    """Idempotent: venv, pinned packages, libb64-0d; then checks perf_analyzer links."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    version = subprocess.run([str(venv / "bin" / "genai-perf"), "--version"], capture_output=True, text=True,
                             check=False) if (venv / "bin" / "genai-perf").exists() else None
    if version is None or "0.0.16" not in version.stdout + version.stderr:
        print(f"pip install {' '.join(PINNED)}", file=sys.stderr)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PINNED], check=True)
    if "libb64.so.0d" in _missing_libs(venv):
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            raise CompareError("perf_analyzer needs libb64.so.0d: run `apt-get install libb64-0d` as root")
        print("apt-get install libb64-0d", file=sys.stderr)
        apt = ["apt-get", "install", "-y", "--no-install-recommends", "libb64-0d"]
        if subprocess.run(apt, check=False).returncode != 0:
            subprocess.run(["apt-get", "update"], check=True)
            subprocess.run(apt, check=True)
    missing = _missing_libs(venv)
    if missing:
        raise CompareError(f"perf_analyzer still cannot load {missing}")
    print(f"GenAI-Perf 0.0.16 ready in {venv}", file=sys.stderr)


# ---------------------------------------------------------------- profile


def parse_label(spec: str, default_url: str) -> tuple[str, str]:
    name, _, url = spec.partition("=")
    if not name or "/" in name or name.startswith("."):
        raise CompareError(f"--label {spec!r}: expected NAME or NAME=HOST:PORT")
    return name, url or default_url


def _check_reachable(url: str) -> None:
    host, _, port = url.rpartition(":")
    try:
        socket.create_connection((host or "localhost", int(port)), timeout=3).close()
    except (OSError, ValueError):
        raise CompareError(f"no server at {url} (start it first; gRPC is port 8001 by default)") from None


def genai_perf_command(args: argparse.Namespace, venv: Path, url: str, stimulus: tuple[str, str],
                       artifact_dir: Path) -> list[str]:
    """The tutorials' command shape, one stimulus (concurrency N or request rate R)."""
    cmd = [str(venv / "bin" / "genai-perf"), "profile", "-m", args.model,
           "--endpoint-type", "kserve", "--backend", "tensorrtllm",
           "--tokenizer", str(args.tokenizer), "--url", url,
           f"--{stimulus[0].replace('_', '-')}", stimulus[1], "--artifact-dir", str(artifact_dir)]
    if not args.no_streaming:
        cmd.append("--streaming")
    if args.input_file:
        cmd += ["--input-file", str(args.input_file)]
    if args.output_tokens_mean:
        cmd += ["--output-tokens-mean", str(args.output_tokens_mean)]
        if getattr(args, "output_tokens_mean_deterministic", False):
            cmd.append("--output-tokens-mean-deterministic")  # min_length = max_tokens
    return cmd + measurement_args(args, stimulus) + shlex.split(args.genai_perf_args)


# Routed per stimulus by measurement_args, so not accepted in --genai-perf-args.
MEASUREMENT_FLAGS = ("--request-count", "--num-requests", "--measurement-interval", "-p",
                     "--warmup-request-count", "--num-warmup-requests")


def measurement_args(args: argparse.Namespace, stimulus: tuple[str, str]) -> list[str]:
    """How long one stimulus is measured (see the module docstring for perf_analyzer's rules)."""
    kind, value = stimulus
    rate = float(value) if kind == "request_rate" else None
    out = []
    if rate is None and getattr(args, "warmup_request_count", None):
        out += ["--warmup-request-count", str(args.warmup_request_count)]
    request_count = getattr(args, "request_count", None)
    interval = getattr(args, "measurement_interval", None)
    if request_count and (rate is None or rate >= 1):
        out += ["--request-count", str(request_count)]
    elif interval:
        out += ["--measurement-interval", str(interval)]
    elif rate is not None and rate < 1:
        raise CompareError(f"--request-rate {value}: perf_analyzer 2.51 refuses a request count with a rate "
                           f"below 1 (GenAI-Perf sends 10 by default); give --measurement-interval MS")
    return out


def labelled_paths(specs: list[str], load):
    """`LABEL=PATH` arguments -> {label: load(path)}, in order; a malformed or repeated label
    is a CompareError."""
    loaded = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise CompareError(f"{spec!r}: expected LABEL=PATH")
        if label in loaded:
            raise CompareError(f"label {label!r} given twice")
        loaded[label] = load(path)
    return loaded


def profile(args: argparse.Namespace) -> dict[str, dict]:
    venv = Path(args.venv)
    if not (venv / "bin" / "genai-perf").exists():
        raise CompareError(f"no GenAI-Perf in {venv}: run `python tools/bench/genai_perf_compare.py install`")
    if not Path(args.tokenizer).is_dir():
        raise CompareError(f"--tokenizer {args.tokenizer}: not a directory (GenAI-Perf cannot download one)")
    labels = [parse_label(s, args.url) for s in args.label]
    if len({name for name, _ in labels}) != len(labels):
        raise CompareError("label names must be unique")
    stimuli = [("concurrency", str(c)) for c in args.concurrency or []]
    stimuli += [("request_rate", str(r)) for r in args.request_rate or []]
    stimuli = stimuli or [("concurrency", "1")]
    routed = [a for a in shlex.split(args.genai_perf_args) if a.split("=", 1)[0] in MEASUREMENT_FLAGS]
    if routed:
        raise CompareError(f"--genai-perf-args {' '.join(routed)}: use this tool's --request-count, "
                           f"--measurement-interval and --warmup-request-count (chosen per stimulus)")
    for stimulus in stimuli:
        measurement_args(args, stimulus)  # refuse an impossible measurement before any run
    # GenAI-Perf's table is drawn for the terminal width: 80 columns when logged to a file.
    env = {**run_env(venv), "COLUMNS": os.environ.get("COLUMNS", "160")}
    out_dir = Path(args.out_dir)
    results: dict[str, dict] = {}
    for name, url in labels:
        if args.pause:
            input(f"start the '{name}' server at {url}, then press Enter ")
        _check_reachable(url)
        for kind, value in stimuli:
            stim = f"{kind}{value}"
            artifact_dir = out_dir / name / stim
            cmd = genai_perf_command(args, venv, url, (kind, value), artifact_dir)
            print(f"[{name} {stim}] {shlex.join(cmd)}", file=sys.stderr)
            # genai-perf prints its own table and logs: keep stdout for the comparison.
            done = subprocess.run(cmd, env=env, stdout=sys.stderr, check=False)
            if done.returncode != 0:
                raise CompareError(f"[{name} {stim}] genai-perf exited with {done.returncode}")
            results.setdefault(stim, {})[name] = load_run(artifact_dir)
    return results


def provenance(argv: list[str], venv: Path, script: str = "genai_perf_compare.py",
               version: str | None = None) -> str:
    """Command, client machine and date lines for a Markdown table (as tools/bench/bench.py writes);
    `version` names the client (default: this venv's genai-perf)."""
    if version is None:
        genai_perf = venv / "bin" / "genai-perf"
        version = subprocess.run([str(genai_perf), "--version"], capture_output=True, text=True,
                                 check=False).stdout.strip() if genai_perf.exists() else "genai-perf (not found)"
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return (f"Command: `python tools/bench/{script} {shlex.join(argv)}`  \n"
            f"Client: {version} on {cpu} ({cores} usable cores)  \nDate: {date}")


def report(results: dict[str, dict], json_out: Path | None, markdown: Path | None = None,
           footer: str = "") -> str:
    """Returns one table per stimulus; writes {stimulus: {runs, rows}} as JSON and the
    tables (then `footer`) as Markdown."""
    texts, export, md = [], {}, []
    for stim, runs in results.items():
        rows = compare(runs)
        texts.append(f"== {stim} ==\n{format_table(rows)}")
        md.append(f"**{stim}**\n\n{format_markdown(rows)}")
        export[stim] = {"runs": runs, "rows": rows}
    md_text = "\n\n".join(md + ([footer] if footer else [])) + "\n"
    for path, text in ((json_out, json.dumps(export, separators=(",", ":")) + "\n"), (markdown, md_text)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return "\n\n".join(texts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=str(DEFAULT_VENV), help="GenAI-Perf virtual environment")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="install GenAI-Perf 0.0.16 and perf_analyzer's libraries")

    p = sub.add_parser("profile", help="run genai-perf per label and stimulus, then compare")
    p.add_argument("--label", action="append", required=True, help="NAME or NAME=HOST:PORT (gRPC); repeat")
    p.add_argument("--url", default="localhost:8001", help="server for labels given without one")
    p.add_argument("--tokenizer", required=True, help="local tokenizer directory")
    p.add_argument("-m", "--model", default="ensemble")
    p.add_argument("--input-file", help="GenAI-Perf input JSONL (tools/dataset_converter.py); default synthetic")
    p.add_argument("--output-tokens-mean", type=int, default=None)
    p.add_argument("--output-tokens-mean-deterministic", action="store_true",
                   help="every request generates exactly --output-tokens-mean tokens (sends min_length)")
    p.add_argument("--concurrency", type=int, nargs="+", help="one run per value (default: 1)")
    p.add_argument("--request-rate", type=float, nargs="+", help="one run per value")
    p.add_argument("--no-streaming", action="store_true", help="drop --streaming (no TTFT/ITL)")
    p.add_argument("--request-count", type=int, help="requests measured per run (concurrency; rates >= 1)")
    p.add_argument("--measurement-interval", type=int, metavar="MS",
                   help="time windows instead (rates below 1 need it; used where --request-count is not)")
    p.add_argument("--warmup-request-count", type=int, help="unmeasured requests first (concurrency runs only)")
    p.add_argument("--genai-perf-args", default="", help="extra arguments, e.g. '--random-seed 7'")
    p.add_argument("--pause", action="store_true", help="wait for Enter before each label (one port, swap servers)")
    p.add_argument("--out-dir", default="artifacts/genai-perf-compare")
    p.add_argument("--json-out", default=None, help="default: <out-dir>/comparison.json")
    p.add_argument("--markdown", default=None, help="also write the tables as Markdown here")

    c = sub.add_parser("compare", help="compare finished runs")
    c.add_argument("runs", nargs="+", help="LABEL=PATH (export file, run or label folder); first is the base")
    c.add_argument("--json-out", default=None)
    c.add_argument("--markdown", default=None, help="also write the tables as Markdown here")

    args = parser.parse_args(argv)
    return run_command(args, argv, install, profile, lambda runs: by_stimulus(labelled_paths(runs, load_runs)),
                       provenance, report)


def run_command(args: argparse.Namespace, argv: list[str] | None, install, profile, load_compared,
                provenance, report) -> int:
    """The `install`, `profile` and `compare` commands, for this script and aiperf_compare.py
    (each passes its own steps); 2 with the message on a `CompareError` or a failed tool."""
    try:
        if args.command == "install":
            install(Path(args.venv))
            return 0
        if args.command == "profile":
            results = profile(args)
            json_out = Path(args.json_out) if args.json_out else Path(args.out_dir) / "comparison.json"
        else:
            results = load_compared(args.runs)
            json_out = Path(args.json_out) if args.json_out else None
        markdown = Path(args.markdown) if args.markdown else None
        footer = provenance(sys.argv[1:] if argv is None else argv, Path(args.venv)) if markdown else ""
        print(report(results, json_out, markdown, footer))
    except (CompareError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
