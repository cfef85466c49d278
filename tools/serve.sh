#!/usr/bin/env bash
# One command from a fresh clone to a running server: installs the pinned
# environment, fills the templates for the shipped model family (EAGLE-2 by default)
# into .cache/model_repo, and starts tritonserver on HTTP 8000, gRPC 8001, metrics 8002,
# with the OpenAI-compatible front door on 9000 (set SPECDEC_API_KEY to require a key;
# SPECDEC_OPENAI_ARGS passes it options, e.g. '--generation-config openai').
#   bash tools/serve.sh [build_model_repo.py options, e.g. --method medusa]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
REPO=.cache/model_repo
rm -rf "$REPO"
.venv/bin/python tools/build_model_repo.py --out "$REPO" "$@"
exec .venv/bin/python tools/launch_triton_server.py --world_size=1 --model_repo="$REPO" \
    --http_port 8000 --grpc_port 8001 --metrics_port 8002 --openai_port 9000 \
    --openai_args "${SPECDEC_OPENAI_ARGS:-}"
