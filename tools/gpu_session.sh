#!/usr/bin/env bash
# The GPU checks and benchmarks for a session lent a GPU machine: tools/bench/gpu_session.sh,
# whose header says how to prepare here (--prepare) and which device calls to make.
exec bash "$(dirname "${BASH_SOURCE[0]}")/bench/gpu_session.sh" "$@"
