#!/usr/bin/env bash
# lm-evaluation-harness, unchanged, against the OpenAI front door of a running server
# (`bash tools/serve.sh`), beside lm_eval's own `hf` backend on the same weights in
# process. Its `local-completions` model scores log-likelihoods through completions with
# echo and logprobs (token-id prompts, so on speculative_decoding) and generates with
# stop strings (on speculative_decoding, and on the text model ensemble with
# tokenized_requests=False). Tasks: tools/bench/lm_eval/*.yaml (written here; their data
# beside them). Then tools/bench/lm_eval_compare.py: every served answer against the
# in-process one.
#   bash tools/bench/lm_eval_run.sh OUT_DIR
# Knobs (environment): URL (http://localhost:9000/v1/completions), BASE (.cache/smollm2/base).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bash tools/bench/lm_eval_run.sh OUT_DIR}
PY=.venv/bin/python
URL=${URL:-http://localhost:9000/v1/completions}
BASE=${BASE:-.cache/smollm2/base}
TASKS=specdec_capitals,specdec_arithmetic
$PY tools/bench/lm_eval_compare.py install
lm_eval() {
  PYTHONPATH=.cache/lmeval/pkgs HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    $PY -m lm_eval --include_path tools/bench/lm_eval --tasks "$TASKS" --log_samples "$@"
}
served() {  # served MODEL [more model_args]
  local model=$1; shift
  lm_eval --model local-completions --output_path "$OUT/$model" \
    --model_args "model=$model,base_url=$URL,tokenizer=$BASE,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1$*"
}
rm -rf "$OUT"
lm_eval --model hf --model_args "pretrained=$BASE,dtype=float32" --device cpu --output_path "$OUT/hf"
served speculative_decoding
TASKS=specdec_arithmetic served ensemble ",tokenized_requests=False"  # a text model takes no token ids
$PY tools/bench/lm_eval_compare.py compare "$OUT/hf" "$OUT/speculative_decoding" "$OUT/ensemble" \
  --markdown "$OUT/comparison.md" --json-out "$OUT/comparison.json"
