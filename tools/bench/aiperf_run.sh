#!/usr/bin/env bash
# Plain vs EAGLE-2 serving under AIPerf, through Triton's own endpoint and through the
# OpenAI front door, one server at a time on the same ports. For each label: build its
# model repository, start tritonserver with the front door (launch_triton_server.py
# --openai_port 9000), run `aiperf_compare.py profile` on both endpoints, stop the server.
# Then compare the labels (and, per label, the front door against Triton's endpoint).
#   bash tools/bench/aiperf_run.sh OUT_DIR [more `profile` options]
# OUT_DIR gets the repositories, server logs and AIPerf artifacts, plus comparison.json and
# comparison.md. Knobs (environment): LABELS ("plain eagle2"; see tools/bench/serving_labels.sh), CONCURRENCY ("1"), REQUESTS (40),
# OUTPUT_TOKENS (128), MODEL (ensemble: the Triton model both endpoints reach), QUESTIONS ($SPECDEC_DATA_DIR/eagle_humaneval_question.jsonl; SPECDEC_DATA_DIR
# defaults to ../shared/data), TOKENIZER (.cache/smollm2/base), BUILD_ARGS (more
# build_model_repo.py options for every label, e.g. "--base DIR"), OMP_NUM_THREADS (2, server).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bash tools/bench/aiperf_run.sh OUT_DIR [profile options]}; shift
PY=.venv/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
TOKENIZER=${TOKENIZER:-.cache/smollm2/base}
# shellcheck source=tools/bench/serving_labels.sh
source tools/bench/serving_labels.sh

mkdir -p "$OUT"
$PY tools/bench/aiperf_compare.py install
QUESTIONS=${QUESTIONS:-${SPECDEC_DATA_DIR:-../shared/data}/eagle_humaneval_question.jsonl}
$PY tools/dataset_converter.py --input_file "$QUESTIONS" --output_file "$OUT/prompts.jsonl"
labels=()
for label in ${LABELS:-plain eagle2}; do
    labels+=("$label=$OUT/$label")
    start_server "$label" "$OUT" --openai_port 9000
    # shellcheck disable=SC2086  # CONCURRENCY holds several values
    $PY tools/bench/aiperf_compare.py profile --label "$label" --tokenizer "$TOKENIZER" \
        --input-file "$OUT/prompts.jsonl" --output-tokens "${OUTPUT_TOKENS:-128}" --deterministic \
        --concurrency ${CONCURRENCY:-1} --request-count "${REQUESTS:-40}" --warmup-request-count 2 \
        --triton-model "${MODEL:-ensemble}" --openai-model "${MODEL:-ensemble}" \
        --out-dir "$OUT" --json-out "$OUT/$label.json" "$@"
    stop_server
done
$PY tools/bench/aiperf_compare.py compare "${labels[@]}" \
    --json-out "$OUT/comparison.json" --markdown "$OUT/comparison.md"
