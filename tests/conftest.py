"""Shared fixtures: the shipped tokenizer and a real `tritonserver` harness.

`serve_repository(...)` builds a filled model repository into a temporary folder
with `tools/build_model_repo.py`'s functions and starts `tritonserver` on free ports
(`--exit-timeout-secs 3`) through `tools/triton_env.py`; the module-scoped `triton`
fixture serves the default decoupled repository once per test module.

End-to-end tests serve `checkpoints/base` when it holds weights, else a tiny random
Llama written once per session with the shipped tokenizer (the serving layer's
behaviour does not depend on what the model says). Environment knobs:
- `SPECDEC_E2E_BASE`: base checkpoint to serve instead;
- `SPECDEC_TEST_FAMILY`: the complete family (base + every drafter) that `e2e_family`
  serves, so requests can pick any `speculative_method` (default `checkpoints/`);
- `SPECDEC_E2E_PYTHONPATH`: prepended to the server's PYTHONPATH (e.g. a stub engine).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "backend_src"))
for _tools in ("tools", "tools/bench", "tools/data", "tools/train"):  # the tools import as modules
    sys.path.insert(0, str(ROOT / _tools))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import build_model_repo  # noqa: E402
import family  # noqa: E402
import triton_env  # noqa: E402

TOKENIZER_DIR = family.BASE_DIR  # SmolLM2's tokenizer (tools/setup_model.py)
E2E_BASE_ENV = os.environ.get("SPECDEC_E2E_BASE")
E2E_LIMITS = {"max_tokens_limit": "64", "max_seq_len": "128", "triton_max_batch_size": "8"}


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def tiny_base_checkpoint(directory: Path) -> Path:
    """A random 2-layer Llama over the shipped tokenizer's vocabulary, in HF layout."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def e2e_base(tmp_path_factory) -> Path:
    """The base checkpoint end-to-end tests serve."""
    if E2E_BASE_ENV:
        return Path(E2E_BASE_ENV)
    shipped = ROOT / "checkpoints" / "base"
    if (shipped / "config.json").is_file():
        return shipped
    return tiny_base_checkpoint(tmp_path_factory.mktemp("tiny_base"))


def e2e_skip_reason() -> str | None:
    """Why end-to-end serving cannot run here, or None."""
    try:
        triton_env.find_tritonserver()
    except FileNotFoundError as e:
        return str(e)
    return None


FAMILY = Path(os.environ.get("SPECDEC_TEST_FAMILY", ROOT / "checkpoints"))
FAMILY_DRAFTERS = {"eagle_dir": "eagle", "eagle3_dir": "eagle3", "medusa_dir": "medusa", "draft_model_dir": "draft"}


@pytest.fixture(scope="session")
def e2e_family() -> Path:
    """The complete model family for end-to-end tests of every method (skips without one)."""
    missing = [m for m in ("base", *FAMILY_DRAFTERS.values()) if not (FAMILY / m / "config.json").is_file()]
    if missing:
        pytest.skip(f"no complete model family in {FAMILY} (missing {', '.join(missing)}); "
                    f"set SPECDEC_TEST_FAMILY")
    return FAMILY


def family_drafters(family: Path) -> dict[str, Path]:
    """`serve_repository(..., drafters=)` for every drafter of `family`."""
    return {key: family / name for key, name in FAMILY_DRAFTERS.items()}


@contextmanager
def serve_repository(tmp_dir: Path, base: Path, values: dict[str, str] | None = None, *, require_ready: bool = True,
                     edit=None, extra_args: tuple[str, ...] = (), drafters: dict[str, Path] | None = None,
                     tokenizer_dir: Path = TOKENIZER_DIR):
    """Builds a repository (method none, decoupled, `E2E_LIMITS` + `values`) into
    `tmp_dir/repo`, lets `edit(repo_path)` break it if given, serves it, yields the server.
    `drafters` ({"eagle_dir": path, ...}) replaces the default `checkpoints/` drafters."""
    merged = {**E2E_LIMITS, **(values or {})}
    decoupled = merged.pop("decoupled_mode", "true") == "true"
    repo = build_model_repo.build(tmp_dir / "repo", build_model_repo.repo_values(
        base, method=merged.pop("speculative_method", "none"), tokenizer_dir=tokenizer_dir,
        drafters=drafters, decoupled=decoupled, extra=merged))
    if edit is not None:
        edit(repo)
    extra_path = os.environ.get("SPECDEC_E2E_PYTHONPATH")
    server = triton_env.TritonServer(repo, log_path=tmp_dir / "server.log", extra_args=extra_args,
                                     python_paths_first=(extra_path,) if extra_path else ())
    server.start()
    try:
        server.wait_ready(timeout_s=240, require_ready=require_ready)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def triton(tmp_path_factory, e2e_base):
    """A READY server on the default decoupled repository, for one test module."""
    reason = e2e_skip_reason()
    if reason:
        pytest.skip(reason)
    with serve_repository(tmp_path_factory.mktemp("triton"), e2e_base) as server:
        yield server
