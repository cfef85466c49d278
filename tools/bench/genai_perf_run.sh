#!/usr/bin/env bash
# Plain vs EAGLE-2 serving under GenAI-Perf, one server at a time on the same ports.
# For each label: build its model repository, start tritonserver, run
# `genai_perf_compare.py profile` at --concurrency 1 and at one --request-rate (HumanEval
# first turns, a fixed output length), stop the server. Then compare the labels.
#   bash tools/bench/genai_perf_run.sh OUT_DIR [more `profile` options]
# OUT_DIR gets the repositories, server logs and GenAI-Perf artifacts, plus
# comparison.json and comparison.md. Knobs (environment): RATE (0.4 req/s), REQUESTS (40,
# concurrency run), INTERVAL (30000 ms windows, request-rate run), OUTPUT_TOKENS (128),
# QUESTIONS ($SPECDEC_DATA_DIR/eagle_humaneval_question.jsonl; SPECDEC_DATA_DIR defaults to
# ../shared/data), OMP_NUM_THREADS (2, server).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bash tools/bench/genai_perf_run.sh OUT_DIR [profile options]}; shift
PY=.venv/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
declare -A METHOD=([plain]="--method none" [eagle2]="--method eagle2 --set eagle_total_tokens:16,adaptive_speculation:false")
SERVER=""

stop_server() {  # the launcher leads its own process group: server and model stubs
    [ -n "$SERVER" ] || return 0
    kill -TERM -- "-$SERVER" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 -- "-$SERVER" 2>/dev/null || { SERVER=""; return 0; }; sleep 1; done
    # A stub still decoding requests of a client that went away ignores SIGTERM.
    kill -KILL -- "-$SERVER" 2>/dev/null || true
    SERVER=""
}
trap stop_server EXIT

mkdir -p "$OUT"
$PY tools/bench/genai_perf_compare.py install
QUESTIONS=${QUESTIONS:-${SPECDEC_DATA_DIR:-../shared/data}/eagle_humaneval_question.jsonl}
$PY tools/dataset_converter.py --input_file "$QUESTIONS" --output_file "$OUT/prompts.jsonl"
for label in plain eagle2; do
    # shellcheck disable=SC2086  # METHOD holds several options
    $PY tools/build_model_repo.py --out "$OUT/repo_$label" ${METHOD[$label]}
    setsid $PY tools/launch_triton_server.py --world_size=1 --model_repo="$OUT/repo_$label" \
        --exit_timeout_secs 3 --log-file "$OUT/server_$label.log" 2>"$OUT/launch_$label.err" &
    SERVER=$!
    until curl -sf localhost:8000/v2/health/ready >/dev/null; do
        kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/launch_$label.err" >&2; exit 1; }
        sleep 1
    done
    $PY tools/bench/genai_perf_compare.py profile --label "$label" --tokenizer .cache/smollm2/base \
        --input-file "$OUT/prompts.jsonl" --output-tokens-mean "${OUTPUT_TOKENS:-128}" \
        --output-tokens-mean-deterministic \
        --concurrency 1 --request-count "${REQUESTS:-40}" --warmup-request-count 2 \
        --request-rate "${RATE:-0.4}" --measurement-interval "${INTERVAL:-30000}" \
        --out-dir "$OUT" --json-out "$OUT/$label.json" "$@"
    stop_server
done
$PY tools/bench/genai_perf_compare.py compare plain="$OUT/plain" eagle2="$OUT/eagle2" \
    --json-out "$OUT/comparison.json" --markdown "$OUT/comparison.md"
