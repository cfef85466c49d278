#!/usr/bin/env bash
# Retrains every drafter of the default family (SmolLM2-135M-Instruct) from scratch,
# reproducibly (fixed seeds), into checkpoints/smollm2-135m-instruct/ in the layouts
# tools/setup_model.py completes. CPU, 2 cores: see the model card for what each step
# cost. Each step resumes where it stopped when rerun. Training is not part of the tests.
#   bash tools/train/train_family.sh [CONVERSATIONS]      # default 1488 self-distilled
# The shipped EAGLE heads are this script's (1,488 self-distilled conversations, one
# epoch). The shipped Medusa heads and draft model are from an earlier, smaller round
# (the conversations then written, two epochs for Medusa; their training.json says what
# they saw); this script retrains them on the current data. Medusa's training does not
# touch the EAGLE heads' (separate parameters, optimiser state and clipping; same batches).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tools/setup_env.sh
PY=.venv/bin/python
BASE=.cache/smollm2/base
OUT=checkpoints/smollm2-135m-instruct
DATA=(.cache/data/self_distill.jsonl .cache/data/local_text.jsonl)
# 1. data: conversations the target writes itself, and chat-shaped local documentation
$PY tools/data/self_distill.py --model "$BASE" --out .cache/data/self_distill.jsonl \
    --conversations "${1:-1488}" --batch-size 96 --max-answer-tokens 320 --seed 0
$PY tools/data/local_text.py --tokenizer "$BASE" --out .cache/data/local_text.jsonl --seed 0
# 2. EAGLE-1/2, EAGLE-3 and Medusa heads on the frozen target (features cached in .cache/train)
$PY tools/train/train_heads.py --base "$BASE" --data "${DATA[@]}" --out "$OUT" --work .cache/train/heads \
    --epochs 1 --batch-tokens 1536 --snapshots 10000,20000,40000,80000,160000,320000 --seed 0
# 3. the draft model: the target's first two layers, distilled
$PY tools/train/train_draft.py --base "$BASE" --data "${DATA[@]}" --out "$OUT/draft" --work .cache/train/heads \
    --layers 2 --epochs 1 --batch-tokens 2048 --seed 0
