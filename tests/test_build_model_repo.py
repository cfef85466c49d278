"""tools/build_model_repo.py writes complete repositories and refuses unusable choices;
tools/launch_triton_server.py refuses what it cannot serve."""
from __future__ import annotations

import pytest

import build_model_repo
from fill_template import TemplateError

from conftest import ROOT


@pytest.fixture
def base(tmp_path):
    """A base model directory (only its existence is checked while building)."""
    (tmp_path / "base").mkdir()
    return tmp_path / "base"


def test_build_writes_every_model_both_entries_included(tmp_path, base):
    values = build_model_repo.repo_values(base, method="none", extra={"max_tokens_limit": "16"})
    repo = build_model_repo.build(tmp_path / "repo", values)
    assert {"ensemble", "tensorrt_llm_bls"} <= set(build_model_repo.MODELS)
    for model in build_model_repo.MODELS:
        text = (repo / model / "config.pbtxt").read_text()
        assert "${" not in text, model
        assert (repo / model / "1").is_dir()
    spec = (repo / "speculative_decoding" / "config.pbtxt").read_text()
    assert 'key: "max_tokens_limit" value: { string_value: "16" }' in spec
    assert "decoupled: true" in spec
    bls = (repo / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    assert "decoupled: true" in bls and (repo / "tensorrt_llm_bls" / "1" / "model.py").is_file()
    assert 'key: "tensorrt_llm_model_name" value: { string_value: "speculative_decoding" }' in bls


def test_method_needing_a_missing_checkpoint_is_an_error(tmp_path, base):
    with pytest.raises(TemplateError, match="--method medusa needs"):
        build_model_repo.repo_values(base, method="medusa", drafters={"medusa_dir": tmp_path / "nothing"})


def test_unknown_key_is_an_error(tmp_path, base):
    values = build_model_repo.repo_values(base, method="none", extra={"max_tokens_limt": "16"})
    with pytest.raises(TemplateError, match="max_tokens_limt"):
        build_model_repo.build(tmp_path / "repo", values)


def test_cli(tmp_path, base):
    assert build_model_repo.main(["--out", str(tmp_path / "r"), "--base", str(base), "--method", "none",
                                  "--decoupled", "false", "--set", "dtype:float32"]) == 0
    for model in ("speculative_decoding", "tensorrt_llm_bls"):
        assert "decoupled: false" in (tmp_path / "r" / model / "config.pbtxt").read_text()
    assert build_model_repo.main(["--out", str(tmp_path / "r2"), "--base", str(base),
                                  "--set", "nonsense_key:1"]) == 1


def test_launcher_refuses_world_size_above_one(tmp_path):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "launch_triton_server.py"), "--world_size=2",
                          f"--model_repo={tmp_path}"], capture_output=True, text=True)
    assert out.returncode == 2 and "--world_size=2: only 1 is supported" in out.stderr
