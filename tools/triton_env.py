"""How to start a real `tritonserver` on this machine: the one importable place for it.

Owns: finding the server binary (PATH first, else the one inside the
`nvidia-pytriton` wheel), building a backend directory for the wheel's Python
backend, the environment the Python-backend stub needs, and a small `TritonServer`
handle (start, wait for READY, stop) used by `tools/launch_triton_server.py` and by
the tests' fixture. Does not own model repositories (see `tools/build_model_repo.py`).

Why the environment looks like this (see ../shared/ENVIRONMENT.md beside the checkout):
- the wheel's stub links `libpython3.x.so`; the running interpreter's own LIBDIR
  must come first on LD_LIBRARY_PATH or a system libpython of another patch
  release is picked up and imports fail;
- PYTHONPATH = this interpreter's site-packages + `backend_src`, so models see
  torch, transformers and the `specdec` package;
- OMP_NUM_THREADS, unless set, = the cores this process may use: torch's threads in
  the engine's stub;
- inside NVIDIA's containers `tritonserver` is on PATH and none of this is needed.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
BACKEND_SRC = REPO_ROOT / "backend_src"
_PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def _pytriton_dir() -> Optional[Path]:
    try:
        import pytriton  # only used to locate its bundled server
    except ImportError:
        return None
    return Path(pytriton.__file__).resolve().parent


def find_tritonserver() -> tuple[Path, Optional[Path]]:
    """Returns (server binary, backend directory or None for the binary's default).

    A `tritonserver` on PATH (NVIDIA's containers) is used as is; otherwise the one in
    the nvidia-pytriton wheel, with a backend directory built by `build_backend_dir`.
    """
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path), None
    pkg = _pytriton_dir()
    if pkg is None or not (pkg / "tritonserver" / "bin" / "tritonserver").exists():
        raise FileNotFoundError(
            "no tritonserver: not on PATH and nvidia-pytriton is not installed "
            "(pip install nvidia-pytriton==0.7.0)")
    return pkg / "tritonserver" / "bin" / "tritonserver", build_backend_dir()


def build_backend_dir(cache_dir: Optional[Path] = None) -> Path:
    """Copies the wheel's Python backend plus this interpreter's stub into
    `<cache>/triton-backends-py3.x/python/` (once) and returns `<cache>/triton-backends-py3.x`."""
    pkg = _pytriton_dir()
    assert pkg is not None
    cache_dir = Path(cache_dir or os.environ.get("SPECDEC_CACHE_DIR") or REPO_ROOT / ".cache")
    root = cache_dir / f"triton-backends-py{_PY_VERSION}"
    python_dir = root / "python"
    stub = pkg / "tritonserver" / "python_backend_stubs" / _PY_VERSION / "triton_python_backend_stub"
    if not stub.exists():
        raise FileNotFoundError(f"the pytriton wheel has no Python-backend stub for Python {_PY_VERSION}")
    marker = python_dir / "triton_python_backend_stub"
    if not marker.exists():
        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "python").mkdir(parents=True)
        for item in (pkg / "tritonserver" / "backends" / "python").iterdir():
            if item.is_file():
                shutil.copy2(item, tmp / "python" / item.name)
        shutil.copy2(stub, tmp / "python" / stub.name)
        shutil.rmtree(root, ignore_errors=True)
        os.replace(tmp, root)  # atomic: parallel builders never see half a directory
    return root


def server_env(base: Optional[dict] = None, python_paths_first: tuple[str, ...] = ()) -> dict:
    """The environment for `tritonserver` and its Python-backend stubs; `python_paths_first`
    go before everything on PYTHONPATH (the model.py files put PYTHONPATH on sys.path)."""
    env = dict(os.environ if base is None else base)
    pkg = _pytriton_dir()
    lib_dirs = [sysconfig.get_config_var("LIBDIR") or ""]
    if pkg is not None:
        lib_dirs.append(str(pkg.parent / "nvidia_pytriton.libs"))
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(d for d in lib_dirs if d)
    py_paths = [*python_paths_first, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                str(BACKEND_SRC)]
    if env.get("PYTHONPATH"):
        py_paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = ":".join(dict.fromkeys(py_paths))
    # torch's threads in the engine's stub: every core this process may use, unless the caller
    # says otherwise (the tests run two at a time with 1). With 1, as here until 2026-12-02,
    # `tools/serve.sh` decoded plainly at 21 ms a token on the 2-core Xeon VM against 15.8
    # with 2 (SmolLM2, one streamed request; ad hoc).
    env.setdefault("OMP_NUM_THREADS", str(usable_cores()))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TritonServer:
    """One `tritonserver` process: `start()`, `wait_ready()`, `stop()`; usable as a context manager."""

    model_repo: Path
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    log_path: Optional[Path] = None  # server stdout+stderr; None: inherit
    exit_timeout_s: int = 3
    extra_args: tuple[str, ...] = ()
    python_paths_first: tuple[str, ...] = ()  # e.g. a stub engine for serving tests
    process: Optional[subprocess.Popen] = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def command(self) -> list[str]:
        binary, backend_dir = find_tritonserver()
        cmd = [str(binary), f"--model-repository={self.model_repo}",
               f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
               f"--metrics-port={self.metrics_port}", f"--exit-timeout-secs={self.exit_timeout_s}",
               "--disable-auto-complete-config"]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        return cmd + list(self.extra_args)

    def start(self) -> "TritonServer":
        out = open(self.log_path, "wb") if self.log_path else None
        env = server_env(python_paths_first=self.python_paths_first)
        self.process = subprocess.Popen(self.command(), env=env, stdout=out,
                                        stderr=subprocess.STDOUT if out else None)
        if out:
            out.close()
        return self

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as r:
                return r.status
        except Exception:  # connection refused while starting, HTTP 400 while loading
            return 0

    def is_ready(self) -> bool:
        return self._get("/v2/health/ready") == 200

    def is_live(self) -> bool:
        return self._get("/v2/health/live") == 200

    def wait_ready(self, timeout_s: float = 180.0, require_ready: bool = True) -> bool:
        """Waits until the server is READY (all models loaded). With `require_ready=False`
        returns once it is live and the repository settled (for broken-model tests)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}; see {self.log_path}")
            if self.is_ready():
                return True
            if not require_ready and self.is_live() and self._repository_settled():
                return False
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout_s}s; see {self.log_path}")

    def _repository_settled(self) -> bool:
        import json
        try:
            req = urllib.request.Request(f"http://{self.http_url}/v2/repository/index", data=b"{}",
                                         method="POST")
            with urllib.request.urlopen(req, timeout=2) as r:
                index = json.loads(r.read())
        except Exception:
            return False
        return bool(index) and all(m.get("state") in ("READY", "UNAVAILABLE") for m in index)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
