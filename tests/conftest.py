"""Shared fixtures: the shipped tokenizer, the tiny model family and a real `tritonserver` harness.

`serve_repository(...)` builds a filled model repository into a temporary folder
with `tools/build_model_repo.py`'s functions and starts `tritonserver` on free ports
(`--exit-timeout-secs 3`) through `tools/triton_env.py`; the module-scoped `triton`
fixture serves the default decoupled repository once per test module.

End-to-end tests serve the tiny family that `tiny_family.py` writes once per test
process (SmolLM2's tokenizer; a base whose drafters it accepts often but not always),
not SmolLM2 itself, which is far too slow here. Environment knobs:
- `SPECDEC_E2E_BASE`: base checkpoint to serve instead of the tiny base;
- `SPECDEC_TEST_FAMILY`: the complete family (base + every drafter) that `e2e_family`
  serves instead of the tiny one, so requests can pick any `speculative_method`;
- `SPECDEC_E2E_PYTHONPATH`: prepended to the server's PYTHONPATH (e.g. a stub engine).
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "backend_src"))
for _tools in ("tools", "tools/bench", "tools/data", "tools/train"):  # the tools import as modules
    sys.path.insert(0, str(ROOT / _tools))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines built here, and the tritonserver processes the end-to-end tests start (they
# inherit this environment), save their load-time calibration under $SPECDEC_CACHE_DIR
# (specdec/calibration_cache.py): a folder of this session's, never the user's cache.
# (tools/triton_env.py copies Triton's Python backend there too, once per session.)
_CACHE_DIR = tempfile.mkdtemp(prefix="specdec-test-cache-")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
os.environ["SPECDEC_CACHE_DIR"] = _CACHE_DIR

import build_model_repo  # noqa: E402
import family  # noqa: E402
import triton_env  # noqa: E402

TOKENIZER_DIR = family.BASE_DIR  # SmolLM2's tokenizer (tools/setup_model.py)
E2E_BASE_ENV = os.environ.get("SPECDEC_E2E_BASE")
FAMILY_ENV = os.environ.get("SPECDEC_TEST_FAMILY")
E2E_LIMITS = {"max_tokens_limit": "64", "max_seq_len": "128", "triton_max_batch_size": "8"}


def pytest_configure(config):
    """The engine's tests draft for HumanEval prompts and the benchmarks' read all four EAGLE
    question sets, which the repository does not carry: without them the run stops here,
    saying where they go, instead of failing test by test with "no such file"."""
    from dataset_converter import data_dir, question_set_path
    from overlap import QUESTION_SETS

    missing = [question_set_path(name).name for name in QUESTION_SETS if not question_set_path(name).is_file()]
    if missing:
        raise pytest.UsageError(f"the EAGLE question sets {', '.join(missing)} are not in {data_dir()}: put them "
                                "there (../shared/data beside the repository) or set SPECDEC_DATA_DIR to their folder")


# The longest modules, run first: with two test processes (tools/run_tests.sh, pytest-xdist
# keeping each module in one process) the long ones overlap the rest instead of running
# last, alone. On a 2-core AMD EPYC VM, one process, test_smollm2.py took 12.5 minutes alone
# and the other two about 4.5 each in a whole run that kernel rebuilds slowed.
FIRST_MODULES = ("test_smollm2.py", "test_engine_sampling.py", "test_bench.py")


def pytest_collection_modifyitems(config, items):
    """Moves FIRST_MODULES' tests to the front, in that order, keeping every other order."""
    rank = {name: i for i, name in enumerate(FIRST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST_MODULES)))  # stable


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def model_family() -> Path:
    """`SPECDEC_TEST_FAMILY`, else the tiny family (written on the first call)."""
    if FAMILY_ENV:
        return Path(FAMILY_ENV)
    from tiny_family import tiny_family
    return tiny_family()


@pytest.fixture(scope="session")
def e2e_base() -> Path:
    """The base checkpoint end-to-end tests serve."""
    return Path(E2E_BASE_ENV) if E2E_BASE_ENV else model_family() / "base"


def e2e_skip_reason() -> str | None:
    """Why end-to-end serving cannot run here, or None."""
    try:
        triton_env.find_tritonserver()
    except FileNotFoundError as e:
        return str(e)
    return None


FAMILY_DRAFTERS = {"eagle_dir": "eagle", "eagle3_dir": "eagle3", "medusa_dir": "medusa", "draft_model_dir": "draft"}


@pytest.fixture(scope="session")
def e2e_family() -> Path:
    """The complete model family for end-to-end tests of every method (skips without one)."""
    family_dir = model_family()
    missing = [m for m in ("base", *FAMILY_DRAFTERS.values()) if not (family_dir / m / "config.json").is_file()]
    if missing:
        pytest.skip(f"no complete model family in {family_dir} (missing {', '.join(missing)}); "
                    f"set SPECDEC_TEST_FAMILY")
    return family_dir


def family_drafters(family: Path) -> dict[str, Path]:
    """`serve_repository(..., drafters=)` for every drafter of `family`."""
    return {key: family / name for key, name in FAMILY_DRAFTERS.items()}


@contextmanager
def serve_repository(tmp_dir: Path, base: Path, values: dict[str, str] | None = None, *, require_ready: bool = True,
                     edit=None, extra_args: tuple[str, ...] = (), drafters: dict[str, Path] | None = None,
                     tokenizer_dir: Path = TOKENIZER_DIR):
    """Builds a repository (method none, decoupled, `E2E_LIMITS` + `values`) into
    `tmp_dir/repo`, lets `edit(repo_path)` break it if given, serves it, yields the server.
    `drafters` ({"eagle_dir": path, ...}; default: the drafters of `base`'s family when
    `base` is `model_family()`'s, else none) replaces build_model_repo's defaults, the
    SmolLM2 family's, which do not fit another base."""
    if drafters is None:
        family_dir = model_family()
        same = Path(base).resolve() == (family_dir / "base").resolve()
        drafters = family_drafters(family_dir) if same else {key: None for key in FAMILY_DRAFTERS}
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
