"""lm-evaluation-harness against the served model, unchanged, beside its own `hf`
backend on the same weights: the served answers must be the in-process ones.

    python tools/bench/lm_eval_compare.py install
    python tools/bench/lm_eval_compare.py compare RUN_DIR... --markdown FILE

`install` puts the pinned lm_eval and the packages it needs that this repository's
environment lacks into .cache/lmeval/pkgs (run with PYTHONPATH pointing there): the
environment's own torch, transformers and numpy (< 2) stay, so pandas and pyarrow are
pinned to releases built for that numpy. `compare` reads each run's per-sample output
(`--log_samples`), the first run being the reference, and writes one table: each
task's metric per run, and how many samples answered as the reference did
(log-likelihoods within `--tolerance`, generated text equal).
tools/bench/lm_eval_run.sh runs the whole comparison.
"""
from __future__ import annotations

import argparse
import json
import shutil
import site
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKGS = ROOT / ".cache" / "lmeval" / "pkgs"
PINNED = "lm_eval==0.4.13"
# lm_eval's requirements that the environment lacks (its `api` extra: tenacity).
NEEDED = ["datasets>=2.16.0", "evaluate", "jsonlines", "numexpr", "pytablewriter", "rouge-score", "sacrebleu",
          "scikit-learn", "sqlitedict", "tqdm-multiprocess", "zstandard", "dill", "word2number", "more_itertools",
          "tenacity"]
FOR_NUMPY_1 = ["pandas==2.2.3", "pyarrow<21"]  # the newest wheels need numpy 2


def install(target: Path = PKGS) -> None:
    """Idempotent: lm_eval and what it needs into `target`, never shadowing a package
    the environment has."""
    if (target / "lm_eval").is_dir() and any(target.glob(PINNED.replace("==", "-") + ".dist-info")):
        print(f"{PINNED} ready in {target}", file=sys.stderr)
        return
    pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(target)]
    subprocess.run(pip + ["--no-deps", PINNED], check=True)
    subprocess.run(pip + NEEDED, check=True)
    have = Path(site.getsitepackages()[0])
    for entry in list(target.iterdir()):  # what pip brought again (numpy 2, another hub client, ...)
        name = entry.name.split("-")[0] if entry.name.endswith(".dist-info") else entry.name
        twins = list(have.glob(f"{name}-*.dist-info")) if entry.name.endswith(".dist-info") else [have / name]
        if entry.name != "bin" and any(t.exists() for t in twins):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    for pin in FOR_NUMPY_1:
        name = pin.split("=")[0].split("<")[0]
        for entry in target.glob(f"{name}*"):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        subprocess.run(pip + ["--no-deps", pin], check=True)


def load_run(run_dir: Path) -> dict[str, list[dict]]:
    """{task: its samples, by doc_id} of one lm_eval output folder (`--log_samples`)."""
    runs = {}
    for path in sorted(run_dir.glob("**/samples_*.jsonl")):
        task = path.name[len("samples_"):].rsplit("_", 1)[0]
        samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs[task] = sorted(samples, key=lambda s: s["doc_id"])
    if not runs:
        raise SystemExit(f"{run_dir}: no samples_*.jsonl inside (was lm_eval run with --log_samples?)")
    return runs


def metric(samples: list[dict]) -> tuple[str, float]:
    """The task's metric (acc or exact_match) averaged over its samples."""
    name = next(m for m in ("acc", "exact_match") if m in samples[0])
    return name, sum(float(s[name]) for s in samples) / len(samples)


def same_answer(a: dict, b: dict, tolerance: float) -> bool:
    """Two runs' responses to one sample agree: log-likelihoods within `tolerance` (and the
    same greedy flags), generated text equal."""
    for x, y in zip(a["resps"], b["resps"]):
        x, y = x[0], y[0]
        if isinstance(x, list):  # a log-likelihood: [value, is_greedy]
            if abs(float(x[0]) - float(y[0])) > tolerance or str(x[1]) != str(y[1]):
                return False
        elif x != y:
            return False
    return len(a["resps"]) == len(b["resps"])


def compare(run_dirs: list[Path], tolerance: float) -> list[dict]:
    """One row per (task, run that has it): the metric and the samples that agree with
    the first run."""
    runs = {d.name: load_run(d) for d in run_dirs}
    reference = runs[run_dirs[0].name]
    rows = []
    for task, ref_samples in reference.items():
        for label, run in runs.items():
            samples = run.get(task)
            if samples is None:  # a run may leave a task out (a text model scores no token ids)
                continue
            name, value = metric(samples)
            agree = sum(same_answer(a, b, tolerance) for a, b in zip(ref_samples, samples))
            rows.append({"task": task, "run": label, "metric": name, "value": value,
                         "same_as_reference": agree, "samples": len(ref_samples)})
    return rows


def markdown(rows: list[dict], command: str, reference: str, tolerance: float) -> str:
    lines = ["| task | run | metric | value | answers as the reference |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['run']} | {r['metric']} | {r['value']:.4f} | "
                     f"{r['same_as_reference']} / {r['samples']} |")
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return "\n".join(lines) + (f"\n\nReference: `{reference}`; log-likelihoods agree within {tolerance}, "
                               f"generated text exactly.  \nCommand: `{command}`  \nDate: {date}\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="lm_eval into .cache/lmeval/pkgs")
    cmp = sub.add_parser("compare", help="the runs' answers against the first run's")
    cmp.add_argument("runs", nargs="+", type=Path, help="lm_eval --output_path folders, the reference first")
    cmp.add_argument("--tolerance", type=float, default=1e-3)
    cmp.add_argument("--markdown", type=Path)
    cmp.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "install":
        install()
        return 0
    rows = compare(args.runs, args.tolerance)
    text = markdown(rows, "bash tools/bench/lm_eval_run.sh OUT_DIR", args.runs[0].name, args.tolerance)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
