#!/usr/bin/env bash
# Compiles every kernels/*.cu to a cubin for sm_80 and sm_90 with warnings as errors, as
# CuPy will compile them at run time (extern "C" kernels, no host code). Needs only nvcc,
# no GPU. Exit status: 0 when every file builds without a warning, 1 otherwise.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc_bin="${NVCC:-nvcc}"
command -v "$nvcc_bin" >/dev/null || { echo "check_kernels: $nvcc_bin not found on PATH" >&2; exit 1; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

shopt -s nullglob
sources=("$root"/kernels/*.cu)
(( ${#sources[@]} )) || { echo "check_kernels: no kernels/*.cu" >&2; exit 1; }

failed=0
for src in "${sources[@]}"; do
  name="$(basename "$src" .cu)"
  for arch in sm_80 sm_90; do
    # --fmad=false matches the options the ops pass to NVRTC (_cupy.NVRTC_OPTIONS).
    if log="$("$nvcc_bin" -arch="$arch" -cubin -std=c++17 --fmad=false \
        -Werror all-warnings -Xptxas -Werror \
        -o "$out/$name.$arch.cubin" "$src" 2>&1)" && [[ -z "$log" ]]; then
      echo "ok    $name ($arch)"
    else
      echo "FAIL  $name ($arch)"
      [[ -n "$log" ]] && printf '%s\n' "$log" | sed 's/^/      /'
      failed=1
    fi
  done
done
exit "$failed"
