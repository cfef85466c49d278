#!/usr/bin/env bash
# Retrains every drafter of the default family (SmolLM2-135M-Instruct) from scratch,
# reproducibly (fixed seeds), into checkpoints/smollm2-135m-instruct/ in the layouts
# tools/setup_model.py completes. CPU, 2 cores: see the model card for what each step
# cost. Each step resumes where it stopped when rerun. Training is not part of the tests.
#   bash tools/train/train_family.sh [CONVERSATIONS]      # default 1488 self-distilled
# The shipped heads are this script's, in rounds (the model card's table):
# - round 3: EAGLE-1/2, EAGLE-3 and Medusa from scratch, three epochs over the committed
#   self-distilled conversations (1,400 answered of 1,488) and 310 pieces of local
#   documentation (an hour on 2 cores: the target's features 11 minutes, the epochs 49).
#   Medusa's training does not touch the EAGLE heads' (separate parameters, optimiser
#   state and clipping; same batches). Round 8 goes on from its Medusa heads.
# - round 4: the EAGLE heads go on from round 3's, 1.5 epochs over the same data with the
#   standard library's documented functions appended (local_code.py); the features of
#   round 3's conversations are kept in the cache, only the new ones are computed.
# - round 5: on from round 4's, 0.6 epochs with 2,320 more
#   self-distilled conversations (indexes 1,488-3,907 but for 100 of the last; committed
#   as their own xz, 0.39 MB).
#   Their indexes sort before the local sources'; the feature cache was then reused only
#   as a prefix, so all of it was computed again (35 minutes; features.py now copies the
#   rows it has by content and computes only the new conversations), then 856 steps
#   (25 minutes).
# - round 6 (not shipped): 2,027 more self-distilled conversations, committed as
#   training_data/self_distill_round6.jsonl.xz (indexes 3,908-6,043) for the next round;
#   0.6 epochs over rounds 5 and 6's conversations alone lowered HumanEval's τ (model card).
# - round 7: on from round 5's, 0.5 epochs over every source with
#   round 6's conversations added (features of the new ones ~35 minutes, then 920 steps
#   in 33 minutes). train_heads.py also writes eagle/draft_vocab.safetensors, the 8,192
#   tokens EAGLE-1/2 drafting scores; the committed one was written for round 7's heads
#   with --draft-vocab-only from the same data, which gives the same tokens.
# - round 8 (the shipped Medusa heads and draft model): the same data as round 7, from
#   round 7's feature cache. Medusa's heads go on from round 3's for one epoch
#   (--medusa-only, 1,841 steps, ~28 minutes); the draft model is trained anew from the
#   target's first two layers for one epoch (1,360 steps, 53 minutes). Both write the
#   same 8,192-token draft_vocab.safetensors as EAGLE-1's.
# - round 9 (EAGLE-1/2's head was shipped until round 12): on from round 7's, 0.8 epochs
#   over 2,000 more self-distilled conversations whose user turns go on from an opener
#   (self_distill.py --steered, indexes 6,044-8,043; committed), with round 6's
#   conversations and the library functions of even index and the documentation replayed
#   (the features of those 1.31 M tokens 40 minutes, 757 steps 33 minutes);
#   --keep-train-vocab keeps the drafting vocabulary Medusa's heads and the draft model share.
# - round 10 (EAGLE-3's head was shipped until round 11; EAGLE-1/2's stayed round 9's): on
#   from round 9's, 0.8 epochs over 1,600 more steered conversations (indexes 8,044-9,643;
#   committed) with round 9's, the documentation and a quarter of the library functions
#   replayed (the features of those ~1.2 M tokens about 26 minutes, 736 steps 22 minutes,
#   on a 2-core AMD EPYC VM).
# - round 11 (EAGLE-3's head was shipped until round 12): the same on from round 10's over
#   1,600 more (indexes 9,644-11,243; committed) with round 10's and another quarter of the
#   library replayed (the features not cached yet about 14 minutes, 683 steps 20 minutes,
#   on the same VM).
# - round 12 (its EAGLE-1/2 head was shipped until round 14, its EAGLE-3 head until round 13): the
#   same on from round 11's over 1,600 more (indexes 11,244-12,843; committed) with round
#   11's and the last quarter of the library replayed, and round 6's unsteered conversations
#   of odd index too, since rounds 10 and 11 had cost general chat ~0.02 τ (the features not
#   cached yet about 16 minutes, 849 steps 25 minutes, on the same VM).
# - round 13 (its EAGLE-3 head was shipped until round 14; its EAGLE-1/2 head fell 0.012 τ
#   short of the shipping rule): the same on from round 12's over 1,600 more (indexes 12,844-14,443;
#   committed) with round 12's, the library quarter of index 0 modulo 4 and round 5's
#   unsteered conversations of odd index replayed (the features not cached yet about 19
#   minutes, 881 steps 26 minutes, on the same VM).
# - round 14 (both shipped heads): the same on from round 13's over 1,600 more (indexes
#   14,444-16,043; committed) with round 13's, the library quarter of index 1 modulo 4 and
#   round 5's unsteered conversations of even index replayed (data 25 minutes, the features
#   not cached yet about 25 minutes, 858 steps 25 minutes, on the same VM, sharing it).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tools/setup_env.sh
PY=.venv/bin/python
BASE=.cache/smollm2/base
OUT=checkpoints/smollm2-135m-instruct
DATA=(.cache/data/self_distill.jsonl .cache/data/local_text.jsonl)
# 1. data: conversations the target writes itself, and chat-shaped local documentation.
#    The self-distilled conversations the shipped heads saw are committed (xz without the
#    answers' text and the prompts' ids, which unpacking rebuilds; 0.27 MB) and unpacked
#    here instead of written again (40 minutes on 2 cores; batched float32 decoding does
#    not repeat bit for bit from machine to machine, so a rewrite differs in a few
#    conversations). self_distill.py then writes only what the file lacks.
#    FRESH_DATA=1 skips the unpacking, so that all of it is written anew.
unpack() {  # unpack XZ JSONL: the committed conversations, unless JSONL is there already
  if [[ -z ${FRESH_DATA:-} && ! -s $2 && -f $1 ]]; then
    $PY tools/data/packed_conversations.py unpack --tokenizer "$BASE" "$1" "$2"
  fi
}
unpack "$OUT/training_data/self_distill.jsonl.xz" .cache/data/self_distill.jsonl
$PY tools/data/self_distill.py --model "$BASE" --out .cache/data/self_distill.jsonl \
    --conversations "${1:-1488}" --batch-size 96 --max-answer-tokens 320 --seed 0
$PY tools/data/local_text.py --tokenizer "$BASE" --out .cache/data/local_text.jsonl --seed 0
# 2. round 3: EAGLE-1/2, EAGLE-3 and Medusa heads on the frozen target (features cached in .cache/train)
$PY tools/train/train_heads.py --base "$BASE" --data "${DATA[@]}" --out .cache/train/round3 \
    --work .cache/train/heads --epochs 3 --batch-tokens 1536 \
    --snapshots 10000,20000,40000,80000,160000,320000,410000,820000 --seed 0
# 3. round 4: the EAGLE heads on from round 3's, with the standard library's code appended
$PY tools/data/local_code.py --tokenizer "$BASE" --out .cache/data/local_code.jsonl --seed 0
$PY tools/train/train_heads.py --base "$BASE" --data "${DATA[@]}" .cache/data/local_code.jsonl \
    --out .cache/train/round4 --work .cache/train/round4_work --features .cache/train/heads/features \
    --init .cache/train/round3 --epochs 1.5 --batch-tokens 1536 --lr 5e-4 --medusa-heads 0 \
    --snapshots 1500000,1800000 --seed 0
# 4. round 5: the EAGLE heads on from round 4's, with a second round of self-distilled
#    conversations. The committed file is what the shipped heads saw: its writing was
#    stopped with the last batch in flight, so 100 of indexes 3,750-3,907 are missing and
#    are not filled in here. FRESH_DATA=1 writes all 2,420 anew (~40 minutes).
# later_round JSONL FIRST END [self_distill.py options]: the self-distilled conversations of
# indexes FIRST to END - 1, unpacked from the committed training_data/<JSONL's name>.xz, or
# written anew where that is missing or FRESH_DATA=1 asks for it.
later_round() {
  unpack "$OUT/training_data/$(basename "$1").xz" "$1"
  if [[ -n ${FRESH_DATA:-} || ! -s $1 ]]; then
    $PY tools/data/self_distill.py --model "$BASE" --out "$1" \
        --first "$2" --conversations "$3" --batch-size 96 --max-answer-tokens 320 --seed 0 "${@:4}"
  fi
}
ROUND5=.cache/data/self_distill_round5.jsonl
later_round "$ROUND5" 1488 3908
$PY tools/train/train_heads.py --base "$BASE" \
    --data "${DATA[@]}" .cache/data/local_code.jsonl "$ROUND5" --out .cache/train/round5 \
    --work .cache/train/round5_work --features .cache/train/heads/features --init .cache/train/round4 \
    --epochs 0.6 --batch-tokens 1536 --lr 5e-4 --medusa-heads 0 --snapshots 3000000 --seed 0
# 5. round 7: the EAGLE heads on from round 5's over every source, with a third round of
#    self-distilled conversations (round 6's, committed; FRESH_DATA=1 writes them anew,
#    ~50 minutes). Round 5's heads are the learning curve's first point of this round.
ROUND6=.cache/data/self_distill_round6.jsonl
later_round "$ROUND6" 3908 6044
$PY tools/train/train_heads.py --base "$BASE" \
    --data "${DATA[@]}" .cache/data/local_code.jsonl "$ROUND5" "$ROUND6" --out .cache/train/round7 \
    --work .cache/train/round7_work --features .cache/train/heads/features --init .cache/train/round5 \
    --epochs 0.5 --batch-tokens 1536 --lr 5e-4 --medusa-heads 0 --snapshots 3440402 --seed 0
# 6. round 8: Medusa's heads on from round 3's, and the draft model (the target's first two
#    layers, distilled), both over every source
$PY tools/train/train_heads.py --base "$BASE" \
    --data "${DATA[@]}" .cache/data/local_code.jsonl "$ROUND5" "$ROUND6" --out "$OUT" \
    --work .cache/train/medusa_r8_work --features .cache/train/heads/features --init .cache/train/round3 \
    --medusa-only --epochs 1 --batch-tokens 1536 --lr 5e-4 --seed 0
$PY tools/train/train_draft.py --base "$BASE" \
    --data "${DATA[@]}" .cache/data/local_code.jsonl "$ROUND5" "$ROUND6" --out "$OUT/draft" \
    --work .cache/train/draft_r8 --features .cache/train/heads/features --layers 2 --epochs 1 \
    --batch-tokens 2048 --seed 0
# 7. round 9: the EAGLE heads on from round 7's over steered self-distilled conversations,
#    half of the earlier ones replayed (every_second: the conversations of even index)
every_nth() {  # every_nth IN OUT N R: the conversations of IN whose index is R modulo N
  $PY -c 'import json, sys
n, r = int(sys.argv[3]), int(sys.argv[4])
with open(sys.argv[2], "w") as out:
    for line in open(sys.argv[1]):
        if line.strip() and json.loads(line)["index"] % n == r:
            out.write(line)' "$1" "$2" "$3" "$4"
}
every_second() { every_nth "$1" "$2" 2 0; }
ROUND9=.cache/data/self_distill_round9.jsonl
later_round "$ROUND9" 6044 8044 --steered
every_second "$ROUND6" .cache/data/self_distill_round6_even.jsonl
every_second .cache/data/local_code.jsonl .cache/data/local_code_even.jsonl
$PY tools/train/train_heads.py --base "$BASE" \
    --data .cache/data/local_text.jsonl .cache/data/local_code_even.jsonl .cache/data/self_distill_round6_even.jsonl \
    "$ROUND9" --out .cache/train/round9 --work .cache/train/round9_work --features .cache/train/heads/features \
    --init .cache/train/round7 --keep-train-vocab --epochs 0.8 --batch-tokens 1536 --lr 5e-4 --medusa-heads 0 \
    --snapshots 4752430 --seed 0
# 8. rounds 10 to 14: each round's EAGLE heads on from the round before's, 0.8 epochs over
#    1,600 more steered conversations, with the round before's conversations, the
#    documentation and a quarter of the library functions replayed.
#    steered_round N FIRST END SNAPSHOT [JSONL...]: round N's conversations are indexes FIRST
#    to END - 1 (END and up unused), its library quarter the functions whose index is N - 9
#    modulo 4, it saves the heads at SNAPSHOT answer tokens too, and it replays the JSONL files
#    given.
steered_round() {
  local n=$1 q=$(( ($1 - 9) % 4 ))
  local quarter=.cache/data/local_code_quarter$q.jsonl
  later_round ".cache/data/self_distill_round$n.jsonl" "$2" "$3" --steered
  every_nth .cache/data/local_code.jsonl "$quarter" 4 "$q"
  $PY tools/train/train_heads.py --base "$BASE" \
      --data .cache/data/local_text.jsonl "$quarter" ".cache/data/self_distill_round$(( n - 1 )).jsonl" \
      ".cache/data/self_distill_round$n.jsonl" "${@:5}" \
      --out ".cache/train/round$n" --work ".cache/train/round${n}_work" \
      --features .cache/train/heads/features --init ".cache/train/round$(( n - 1 ))" --keep-train-vocab \
      --epochs 0.8 --batch-tokens 1536 --lr 5e-4 --medusa-heads 0 --snapshots "$4" --seed 0
}
steered_round 10 8044 9644 5500000
steered_round 11 9644 11244 6250000
every_nth "$ROUND6" .cache/data/self_distill_round6_odd.jsonl 2 1
steered_round 12 11244 12844 6900000 .cache/data/self_distill_round6_odd.jsonl
every_nth "$ROUND5" .cache/data/self_distill_round5_odd.jsonl 2 1
steered_round 13 12844 14444 7800000 .cache/data/self_distill_round5_odd.jsonl
every_nth "$ROUND5" .cache/data/self_distill_round5_even.jsonl 2 0
steered_round 14 14444 16044 8800000 .cache/data/self_distill_round5_even.jsonl
# 9. round 15: EAGLE-3's draft vocabulary widened from 4,096 to 8,192 tokens (round 14's
#    and the 4,096 most frequent answer tokens it lacked), on from round 14's heads over
#    the conversations rounds 11 and 12 wrote, round 6's of odd index, the documentation
#    and library quarter 2 replayed (no new conversations).
every_nth "$ROUND6" .cache/data/self_distill_round6_odd.jsonl 2 1
every_nth .cache/data/local_code.jsonl .cache/data/local_code_quarter2.jsonl 4 2
$PY tools/train/train_heads.py --base "$BASE" \
    --data .cache/data/local_text.jsonl .cache/data/local_code_quarter2.jsonl .cache/data/self_distill_round11.jsonl \
    .cache/data/self_distill_round12.jsonl .cache/data/self_distill_round6_odd.jsonl \
    --out .cache/train/round15 --work .cache/train/round15_work --features .cache/train/heads/features \
    --init .cache/train/round14 --keep-train-vocab --widen-draft-vocab 8192 --epochs 0.8 --batch-tokens 1536 \
    --lr 5e-4 --medusa-heads 0 --snapshots 9900000 --seed 0
# the shipped heads are round 15's, EAGLE-3's weight matrices committed as int8 rows with a
# scale each (tools/packed_rows.py; setup writes their products back in float32)
cp .cache/train/round15/eagle/* "$OUT/eagle/"
rm -f "$OUT/eagle3/"*
$PY tools/packed_rows.py pack .cache/train/round15/eagle3 "$OUT/eagle3"
# 10. round 16's data: 1,600 more steered conversations (indexes 16,044-17,643; committed,
#     written 2026-12-02 in 22 minutes), unpacked for the next round; no head has trained on
#     them yet (checkpoints/smollm2-135m-instruct/MODEL_CARD.md)
later_round .cache/data/self_distill_round16.jsonl 16044 17644 --steered
