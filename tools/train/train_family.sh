#!/usr/bin/env bash
# Retrains the whole shipped model family, reproducibly (fixed seeds), into
# checkpoints/ in the upstream layouts. CPU: about 1.5 hours on 2 cores; a GPU is
# not needed. Training is not part of the test suite.
#   bash tools/train/train_family.sh [OUT_DIR]     # default: checkpoints
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-checkpoints}
bash tools/setup_env.sh
PY=.venv/bin/python
mkdir -p .cache/train "$OUT"
# 1. byte-level BPE tokenizer (vocab 2048, <unk> 0, <s> 1, </s> 2)
$PY tools/train/train_tokenizer.py --out .cache/train/tokenizer --vocab-size 2048
# 2. base model (12 layers, ~10 M parameters) and draft model (3 layers, ~0.9 M)
$PY tools/train/train_lm.py --tokenizer .cache/train/tokenizer --base-out "$OUT/base" \
    --draft-out "$OUT/draft" --steps 420 --batch-size 8 --seq-len 512 --lr 1e-3 --draft-lr 2e-3 --seed 0
# 3. EAGLE-1/2 head, EAGLE-3 head and Medusa heads on the frozen base
$PY tools/train/train_heads.py --base "$OUT/base" --out "$OUT" --steps 600 --batch-size 8 --seq-len 256 \
    --lr 3e-3 --ttt-steps 4 --seed 0
# 4. the report (perplexity, acceptance) and the model card's results
$PY tools/bench/eval_family.py --family "$OUT" --model-card "$OUT/MODEL_CARD.md"
