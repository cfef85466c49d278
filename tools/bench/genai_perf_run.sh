#!/usr/bin/env bash
# Plain decoding vs speculative serving under GenAI-Perf, one server at a time on the same
# ports. For each label: build its model repository, start tritonserver, run
# `genai_perf_compare.py profile` at --concurrency 1 (and at one --request-rate when RATE is
# set), HumanEval first turns, a fixed output length; stop the server. Then compare the
# labels, the first (plain) as the base.
#   bash tools/bench/genai_perf_run.sh OUT_DIR [more `profile` options]
# Labels (LABELS, default "plain eagle2 eagle3"): see tools/bench/serving_labels.sh.
# OUT_DIR gets the repositories, server logs and GenAI-Perf artifacts, plus
# comparison.json and comparison.md. Knobs (environment): REQUESTS (40, concurrency run),
# RATE (unset: no request-rate run; e.g. 0.4 req/s) and INTERVAL (30000 ms windows, rate
# run), OUTPUT_TOKENS (128), QUESTIONS ($SPECDEC_DATA_DIR/eagle_humaneval_question.jsonl;
# SPECDEC_DATA_DIR defaults to ../shared/data), BUILD_ARGS (more build_model_repo.py
# options for every label), OMP_NUM_THREADS (2, server).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bash tools/bench/genai_perf_run.sh OUT_DIR [profile options]}; shift
PY=.venv/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# shellcheck source=tools/bench/serving_labels.sh
source tools/bench/serving_labels.sh
read -r -a LABELS <<< "${LABELS:-plain eagle2 eagle3}"
RATE_ARGS=()
[ -z "${RATE:-}" ] || RATE_ARGS=(--request-rate "$RATE" --measurement-interval "${INTERVAL:-30000}")

mkdir -p "$OUT"
$PY tools/bench/genai_perf_compare.py install
QUESTIONS=${QUESTIONS:-${SPECDEC_DATA_DIR:-../shared/data}/eagle_humaneval_question.jsonl}
$PY tools/dataset_converter.py --input_file "$QUESTIONS" --output_file "$OUT/prompts.jsonl"
for label in "${LABELS[@]}"; do
    start_server "$label" "$OUT"
    $PY tools/bench/genai_perf_compare.py profile --label "$label" --tokenizer .cache/smollm2/base \
        --input-file "$OUT/prompts.jsonl" --output-tokens-mean "${OUTPUT_TOKENS:-128}" \
        --output-tokens-mean-deterministic \
        --concurrency 1 --request-count "${REQUESTS:-40}" --warmup-request-count 2 \
        "${RATE_ARGS[@]}" \
        --out-dir "$OUT" --json-out "$OUT/$label.json" "$@"
    stop_server
done
RUNS=()
for label in "${LABELS[@]}"; do RUNS+=("$label=$OUT/$label"); done
$PY tools/bench/genai_perf_compare.py compare "${RUNS[@]}" \
    --json-out "$OUT/comparison.json" --markdown "$OUT/comparison.md"
