"""tools/fill_template.py: escapes, unknown keys, leftovers, defaults, TensorRT-LLM command lines."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from conftest import TOKENIZER_DIR  # noqa: E402
from fill_template import (TemplateError, fill_file, fill_text, main,  # noqa: E402
                           parse_substitutions, placeholders)

TEMPLATES = ROOT / "model_repository"


def test_parse_substitutions_escapes_and_colons():
    assert parse_substitutions("a:1,b:x\\,y,c:/p:q,d:") == {"a": "1", "b": "x,y", "c": "/p:q", "d": ""}
    assert parse_substitutions("choices:{0\\,0}\\,{0\\,1}") == {"choices": "{0,0},{0,1}"}
    assert parse_substitutions("k:a\\:b\\\\c") == {"k": "a:b\\c"}
    assert parse_substitutions("") == {}


@pytest.mark.parametrize("bad", ["novalue", "a:1,a:2", "bad-key:1"])
def test_parse_substitutions_rejects(bad):
    with pytest.raises(TemplateError):
        parse_substitutions(bad)


def test_placeholders_and_defaults():
    text = 'a: ${x} b: "${y:7}" c: "${z:}" d: ${x}'
    assert placeholders(text) == {"x": None, "y": "7", "z": ""}
    filled, ignored, missing = fill_text(text, {"x": "1"}, known_keys=set())
    assert (filled, ignored, missing) == ('a: 1 b: "7" c: "" d: 1', [], [])
    filled, _, _ = fill_text(text, {"x": "1", "y": "8"}, known_keys=set())
    assert filled == 'a: 1 b: "8" c: "" d: 1'


def test_missing_required_is_reported_and_nothing_written(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('k: "${needed}" o: ${opt:1}')
    with pytest.raises(TemplateError, match="needed"):
        fill_file(path, {}, out=path)
    assert path.read_text() == 'k: "${needed}" o: ${opt:1}'
    fill_file(path, {}, out=path, partial=True)  # keeps the default placeholder for later
    assert path.read_text() == 'k: "${needed}" o: ${opt:1}'


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(TemplateError, match="'tokenizer_dri'"):
        fill_text("x: ${tokenizer_dir}", {"tokenizer_dri": "/a"})


def test_known_foreign_key_is_ignored(capsys, tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text("x: ${a}")
    assert fill_file(path, {"a": "1", "engine_dir": "/e"}) == "x: 1"
    assert "ignoring key 'engine_dir'" in capsys.readouterr().err


def test_cli_in_place_and_exit_status(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('k: "${a}" m: "${b:d}"')
    assert main(["-i", str(path), "a:x\\,y"]) == 0
    assert path.read_text() == 'k: "x,y" m: "d"'
    path.write_text('k: "${a}" m: "${b:d}"')
    assert main(["-i", str(path), "b:1"]) == 1  # a left
    assert main(["-i", str(path), "zzz_unknown:1"]) == 1
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "fill_template.py"), str(path), "a:1"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == 'k: "1" m: "d"'


# TensorRT-LLM tutorials' command lines, unchanged (docs of tensorrtllm_backend).
TUTORIAL_COMMANDS = {
    "preprocessing": [
        "tokenizer_dir:{tok},triton_max_batch_size:64,preprocessing_instance_count:1",
        "tokenizer_dir:{tok},tokenizer_type:llama,triton_max_batch_size:64,preprocessing_instance_count:1",
        "tokenizer_dir:{tok},tokenizer_type:auto,triton_max_batch_size:64,preprocessing_instance_count:1",
        "tokenizer_dir:{tok},triton_max_batch_size:4,preprocessing_instance_count:1,"
        "max_queue_delay_microseconds:0,max_queue_size:0,add_special_tokens:False",
    ],
    "postprocessing": [
        "tokenizer_dir:{tok},triton_max_batch_size:64,postprocessing_instance_count:1",
        "tokenizer_dir:{tok},tokenizer_type:llama,triton_max_batch_size:64,postprocessing_instance_count:1",
        "tokenizer_dir:{tok},triton_max_batch_size:4,postprocessing_instance_count:1,max_queue_size:0,"
        "skip_special_tokens:True",
    ],
    "ensemble": [
        "triton_max_batch_size:64",
        "triton_max_batch_size:4,logits_datatype:TYPE_FP32",
    ],
    # the tensorrt_llm line, pointed at our model, plus the one key it needs of ours
    "speculative_decoding": [
        "triton_backend:tensorrtllm,triton_max_batch_size:64,decoupled_mode:False,max_beam_width:1,"
        "engine_dir:/engines,max_tokens_in_paged_kv_cache:2560,max_attention_window_size:2560,"
        "kv_cache_free_gpu_mem_fraction:0.5,exclude_input_in_output:True,enable_kv_cache_reuse:False,"
        "batching_strategy:inflight_fused_batching,max_queue_delay_microseconds:0,"
        "encoder_input_features_data_type:TYPE_FP16,logits_datatype:TYPE_FP32,base_model_dir:{tok}",
    ],
}


@pytest.mark.parametrize("model,command", [(m, c) for m, cs in TUTORIAL_COMMANDS.items() for c in cs])
def test_tutorial_command_lines_leave_complete_configs(tmp_path, model, command):
    path = tmp_path / "config.pbtxt"
    shutil.copy(TEMPLATES / model / "config.pbtxt", path)
    tok = str(TOKENIZER_DIR)
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "fill_template.py"), "-i", str(path),
                             command.format(tok=tok)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "${" not in path.read_text()


def test_every_template_has_only_known_required_keys():
    required = {m: sorted(k for k, d in placeholders((TEMPLATES / m / "config.pbtxt").read_text()).items()
                          if d is None) for m in ("preprocessing", "postprocessing", "speculative_decoding",
                                                  "ensemble")}
    assert required == {"preprocessing": ["tokenizer_dir"], "postprocessing": ["tokenizer_dir"],
                        "speculative_decoding": ["base_model_dir"], "ensemble": []}
