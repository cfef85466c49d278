"""tools/bench/gpu_session.sh, the one command a session lent a GPU runs: its CPU smoke mode
of the cheapest stage writes the files a device call brings back, and the question
sets are read from $SPECDEC_DATA_DIR (a copy inside the repository on a GPU machine,
where ../shared/data does not travel)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cpu_smoke_of_the_kernels_stage_collects_its_files(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    run = subprocess.run(["bash", "tools/bench/gpu_session.sh", "--cpu-smoke", "kernels"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_kernels.txt", "gpu_session.log"]
    log = (out / "gpu_session.log").read_text()
    assert "commit: " in log and "torch " in log and "nvidia-smi" in log
    assert "kernels: ok" in log
    kernels = (out / "gpu_kernels.txt").read_text()
    # Both GPU command lines parsed and refused for want of a GPU, with the tool's own message.
    assert kernels.count("skipped, needs a GPU (the command line parses): no CUDA GPU visible") == 2, kernels


def _fresh_engine_helpers():
    """tests/engine_helpers.py loaded anew (its paths are read at import), leaving the shared one alone."""
    spec = importlib.util.spec_from_file_location("engine_helpers_fresh", ROOT / "tests" / "engine_helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_question_sets_are_read_from_specdec_data_dir(tmp_path, monkeypatch):
    code = "def add(a, b):\n    return a + b\n"
    question = {"question_id": 0, "category": "code", "turns": ["Complete the code I provided.\n\n" + code]}
    (tmp_path / "eagle_humaneval_question.jsonl").write_text(json.dumps(question) + "\n")

    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path))
    helpers = _fresh_engine_helpers()
    assert helpers.HUMANEVAL == tmp_path / "eagle_humaneval_question.jsonl"
    assert helpers.code_prompts(5) == [helpers.tokenizer()(code).input_ids]

    monkeypatch.delenv("SPECDEC_DATA_DIR")
    assert _fresh_engine_helpers().HUMANEVAL == ROOT.parent / "shared" / "data" / "eagle_humaneval_question.jsonl"
