#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, checks that every
# CUDA kernel compiles for sm_80 and sm_90 (when nvcc is on PATH), lints the
# Dockerfile (when hadolint is installable), then runs pytest. GPU tests skip
# themselves without a GPU.
#   bash tools/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
if command -v nvcc >/dev/null 2>&1; then
  bash tools/check_kernels.sh
else
  echo "nvcc not found: skipping the kernel compile check"
fi
bash tools/check_dockerfile.sh --install
# Two test processes (pytest-xdist), each module kept in one of them (its fixtures, such as
# an engine or a server, are made once), one thread each; SPECDEC_TEST_WORKERS=0 runs one.
workers=${SPECDEC_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@" tests
