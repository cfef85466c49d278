#!/usr/bin/env python3
"""Starts `tritonserver` on a model repository (TensorRT-LLM's command line).

    python3 tools/launch_triton_server.py --world_size=1 --model_repo=/tmp/repo

Uses `tritonserver` from PATH (NVIDIA's containers) or the one in the
nvidia-pytriton wheel, set up by `tools/triton_env.py`. Runs in the foreground until
the server exits or Ctrl-C. Only `--world_size=1` is supported: the engine runs on
one device.

With `--openai_port N` the OpenAI-compatible front door (`tools/openai_frontend`)
runs beside the server on port N, talking to it over gRPC; it is stopped with the
server, and if it fails the server is stopped too. Its API key comes from
$SPECDEC_API_KEY; other options go through `--openai_args`, and tritonserver's own
(e.g. its restricted-API options, docs/DESIGN.md) through `--tritonserver_args`.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_env import TritonServer  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world_size", type=int, default=1, help="must be 1")
    p.add_argument("--model_repo", type=Path, required=True, help="a filled model repository")
    p.add_argument("--http_port", type=int, default=8000)
    p.add_argument("--grpc_port", type=int, default=8001)
    p.add_argument("--metrics_port", type=int, default=8002)
    p.add_argument("--log", action="store_true", help="verbose server log (--log-verbose=1)")
    p.add_argument("--log-file", type=Path, default=None, help="write the server log here")
    p.add_argument("--exit_timeout_secs", type=int, default=30)
    p.add_argument("--openai_port", type=int, default=0,
                   help="also serve the OpenAI API on this port (0: off; tools/serve.sh uses 9000)")
    p.add_argument("--tritonserver_args", default="",
                   help="more tritonserver options, e.g. \"--grpc-address 127.0.0.1 --http-address 127.0.0.1\"")
    p.add_argument("--openai_args", default="",
                   help="more front door options, e.g. \"--served-model-name smollm2 --host 127.0.0.1\"")
    args = p.parse_args(argv)
    if args.world_size != 1:
        print(f"launch_triton_server: error: --world_size={args.world_size}: only 1 is supported "
              f"(the engine serves one model on one device; run more servers for more devices)",
              file=sys.stderr)
        return 2
    if not args.model_repo.is_dir():
        print(f"launch_triton_server: error: --model_repo {args.model_repo} is not a directory",
              file=sys.stderr)
        return 2
    server = TritonServer(args.model_repo.resolve(), http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, log_path=args.log_file,
                          exit_timeout_s=args.exit_timeout_secs,
                          extra_args=(("--log-verbose=1",) if args.log else ()) + tuple(shlex.split(args.tritonserver_args)))
    print(" ".join(server.command()), file=sys.stderr)
    server.start()
    frontend = None
    if args.openai_port:
        command = [sys.executable, str(Path(__file__).resolve().parent / "openai_frontend"),
                   "--port", str(args.openai_port), "--triton-url", f"localhost:{args.grpc_port}",
                   *shlex.split(args.openai_args)]
        print(shlex.join(command), file=sys.stderr)
        frontend = subprocess.Popen(command)  # it waits for the server to be READY
    processes = [p for p in (server.process, frontend) if p is not None]
    stopping = []

    def terminate(*_):  # only signal here: the loop below sees the processes exit and reaps them
        stopping.append(True)
        for process in processes:
            if process.poll() is None:
                process.terminate()

    signal.signal(signal.SIGTERM, terminate)
    try:
        while server.process.poll() is None:
            if frontend is not None and frontend.poll() is not None and not stopping:
                print(f"launch_triton_server: the OpenAI front door exited with {frontend.returncode}; "
                      f"stopping the server", file=sys.stderr)
                server.stop()
                return frontend.returncode or 1
            time.sleep(0.2)
        return server.process.returncode
    except KeyboardInterrupt:  # Ctrl-C reached both processes too (same process group)
        server.stop()
        return 130
    finally:
        if frontend is not None and frontend.poll() is None:
            frontend.terminate()
            try:
                frontend.wait(timeout=10)
            except subprocess.TimeoutExpired:
                frontend.kill()
                frontend.wait()


if __name__ == "__main__":
    sys.exit(main())
