#!/usr/bin/env python3
"""Starts `tritonserver` on a model repository (TensorRT-LLM's command line).

    python3 tools/launch_triton_server.py --world_size=1 --model_repo=/tmp/repo

Uses `tritonserver` from PATH (NVIDIA's containers) or the one in the
nvidia-pytriton wheel, set up by `tools/triton_env.py`. Runs in the foreground until
the server exits or Ctrl-C. Only `--world_size=1` is supported: the engine runs on
one device.
"""
from __future__ import annotations

import argparse
import signal
import sys
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
                          extra_args=("--log-verbose=1",) if args.log else ())
    print(" ".join(server.command()), file=sys.stderr)
    server.start()
    # Only signal here: the main thread, interrupted inside Popen.wait, holds its lock and
    # reaps the server itself once it exits (within --exit_timeout_secs).
    signal.signal(signal.SIGTERM, lambda *_: server.process.terminate())
    try:
        return server.process.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the server too (same process group)
        server.stop()
        return 130


if __name__ == "__main__":
    sys.exit(main())
