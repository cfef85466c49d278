#!/usr/bin/env bash
# Every CPU benchmark of the default family whose results docs/benchmarks.md, the README
# and the model card quote, into docs/bench/ (each output records its own command line,
# machine and date). Run it on an otherwise idle machine; stages can be named to rerun
# only those.
#   bash tools/bench/cpu_family.sh [latency] [small-trees] [large-trees] [tree-sizes] [lookup] [adaptive] [family]
#     [concurrency] [genai-perf] (and the stages below that the default list leaves out)
#
# latency      tools/bench/bench.py latency --compare: every method, plain decoding and the
#              transformers references (generate, assisted generation with the draft
#              model, prompt lookup) side by side, on the first $QUESTIONS questions of
#              each EAGLE set (first turn, chat template), up to 128 new tokens stopping at
#              the end of the turn, batch 1, temperature 0, adaptive speculation off
# small-trees  the same requests: plain decoding, EAGLE-3, EAGLE-2, Medusa and the draft
#              model with 2-node trees (one drafted token) and 3-node trees (two), generate
#              and prompt lookup
# large-trees  the same requests: plain decoding, EAGLE-3 (with prompt lookup and without) and
#              EAGLE-2 with the EAGLE repository's default tree (EaModel.from_pretrained:
#              total_token 60, depth 7, top_k 10), the size the papers' acceptance lengths were
#              measured with
# tree-sizes   the same requests: plain decoding, EAGLE-3 and EAGLE-2 with trees of 3, 4, 8 and 16
#              nodes, once as the engine routes CPU matmuls (MKL packs included) and once with
#              SPECDEC_CPU_MKL_PACKS=0 (F.linear and oneDNN only), into latency_tree_sizes_*
#              and latency_tree_sizes_no_packs_*
# lookup       the same requests: plain decoding, EAGLE-3 with trees of 3, 8 and 16 nodes and EAGLE-2
#              with 8, each with prompt lookup (the default) and without (+nolookup), and
#              transformers' prompt lookup
# repeats      the same requests, $REPEATS paired passes (default 12; the configurations taking
#              turns request by request in each): plain decoding, EAGLE-3 with trees of 3, 8 and
#              16 nodes (prompt lookup on), transformers' generate and prompt lookup ($REPEATS_COMPARE
#              names other entries, as bench.py's --compare); each speedup
#              per pass, its median and the median's 95 % confidence interval, into
#              latency_repeats_<set>.md (the JSON, 60 KB a set with every request of every pass,
#              goes to .cache/bench/)
# amx          the repeats' requests and configurations (plain decoding, EAGLE-3 with trees of 3, 4
#              and 8 nodes, transformers' prompt lookup), the engine's each also with
#              SPECDEC_CPU_AMX=0 (the AMX kernel off), all taking turns in one process
#              (bench.py --env-variant), into amx_<set>.md
# layer-ops    the same with SPECDEC_CPU_LAYER_OPS=0 (norms, SiLU and RoPE through torch's operators
#              instead of the CPU layer operations) as the variant, into layer_ops_<set>.md
# cpu-tree     the same passes (plain decoding, EAGLE-3 with trees of 3, 4 and 8 nodes) with
#              SPECDEC_CPU_TREE=0 (trees built and verified by the torch twins instead of
#              kernels/cpu_tree.cpp) as the variant, into cpu_tree_<set>.md
# tree-depths  bench.py latency on held-out chat and code requests (docs/bench/heldout_*; what tree
#              shapes may be tuned on), 2 paired passes: plain decoding and EAGLE-3 trees of 4, 8 and
#              16 nodes drafted as adaptive speculation drafts them and one depth deeper (eagle3@8/4),
#              into tree_depths_<kind>.md (policy.smaller_tree_shape)
# adaptive-lookup  the same requests, adaptive speculation on: plain decoding, EAGLE-3 and EAGLE-2
#              with prompt lookup and without, and EAGLE-3 with a pinned 3-node tree (the best
#              fixed tree at batch 1 on these CPUs) beside them
# adaptive-heldout  bench.py latency on 14 chat requests that no drafter trained on and no
#              benchmark table reads (docs/bench/heldout_chat_questions.jsonl: user turns the
#              model wrote with tools/data/self_distill.py --first 50000, seeds no training round
#              used), adaptive speculation on: plain decoding, EAGLE-3, and a pinned 3-node tree;
#              what the adaptive policy's constants may be tuned on
# adaptive-vs-pinned  bench.py latency on the held-out requests of three kinds, adaptive speculation on:
#              chat (above), steered chat (heldout_steered_questions.jsonl, 13) and code (heldout_code_questions.jsonl:
#              functions of installed packages no training source read, tools/data/heldout_code.py); plain
#              decoding, EAGLE-3 and EAGLE-2 as served, and EAGLE-3 pinned to 3, 4, 8 and 16 nodes beside them
# sampled-heldout  the same 14 requests sampled (temperature 0.8, top-p 0.95, seeded): plain decoding,
#              EAGLE-3 with 3 and 16 nodes, EAGLE-2 with 16, transformers' sampling; then unseeded (as
#              OpenAI clients send them), adaptive speculation on: plain decoding, EAGLE-3 as served, and
#              a pinned 3-node tree
# sampling-truncation  tools/bench/bench_overheads.py --measure sampling: top-k/top-p ranking only
#              what they can keep against ranking the whole vocabulary, side by side
# concurrency-lookup  bench_concurrency.py: plain vs EAGLE-3 adaptive with prompt lookup and without,
#              at 1-32 concurrent requests, one run
# adaptive     the same requests: plain decoding, EAGLE-3 and EAGLE-2 with adaptive
#              speculation on (the served default), full trees of 16 nodes
# family       tools/bench/eval_family.py: sample answers and the learning curve (model card)
# concurrency  tools/bench/bench_concurrency.py: plain vs EAGLE-2 and EAGLE-3 adaptive vs
#              EAGLE-3 with a fixed 16-node tree at 1-32 concurrent requests, one run;
#              then plain vs EAGLE-2 and EAGLE-3 adaptive, three repeats at every level
# concurrency-varied  the same three repeats with each request's length drawn from 16-48
#              tokens (the same for every configuration), as served traffic varies: equal
#              lengths keep plain decoding's requests in step (docs/benchmarks.md 2.1)
# concurrency-packs  bench_concurrency.py: plain vs EAGLE-3 adaptive vs EAGLE-3 with a fixed
#              16-node tree at 1-32 concurrent requests, once as the engine routes CPU matmuls
#              (MKL packs included) and once with SPECDEC_CPU_MKL_PACKS=0
# genai-perf   tools/bench/genai_perf_run.sh: GenAI-Perf at concurrency 1 against the served
#              ensemble: plain decoding, EAGLE-2 and EAGLE-3 as tools/serve.sh serves them
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
DATA=${SPECDEC_DATA_DIR:-../shared/data}
QUESTIONS=${QUESTIONS:-4}
SETS=${SETS:-humaneval mt_bench gsm8k alpaca}  # the EAGLE question sets the latency stages run
OUT=docs/bench
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
stages=("$@")
[ ${#stages[@]} -gt 0 ] ||
  stages=(latency small-trees large-trees tree-sizes lookup adaptive family concurrency genai-perf)
mkdir -p "$OUT"

# latency_on_every_set NAME [--plot] [bench.py options...]: the first $QUESTIONS questions
# of each EAGLE set, 128 new tokens stopping at the end of the turn, into $OUT/NAME_<set>.*
latency_on_every_set() {
  local name=$1 plot=false set; shift
  if [ "${1:-}" = --plot ]; then plot=true; shift; fi
  for set in $SETS; do
    local png=()
    if $plot; then png=(--plot "$OUT/${name}_$set.png"); fi
    $PY tools/bench/bench.py latency --question-set "$DATA/eagle_${set}_question.jsonl" \
      --num-requests "$QUESTIONS" --output-tokens 128 --stop-at-eos --warmup 1 --no-progress "$@" \
      --report-json "$OUT/${name}_$set.json" --markdown "$OUT/${name}_$set.md" "${png[@]}"
  done
}

# bench.py latency in paired passes on every set: $1 names the outputs (its markdown in
# docs/bench/, its JSON with every request of every pass in .cache/bench/), $2 the
# configurations unless $REPEATS_COMPARE names others, $3 the passes unless $REPEATS says;
# the rest goes to bench.py.
repeats_on_every_set() {
  local name=$1 compare=$2 repeats=$3
  shift 3
  mkdir -p .cache/bench
  for set in $SETS; do
    $PY tools/bench/bench.py latency --question-set "$DATA/eagle_${set}_question.jsonl" \
      --num-requests "$QUESTIONS" --output-tokens 128 --stop-at-eos --warmup 1 --no-progress \
      --eagle-total-tokens 16 --compare "${REPEATS_COMPARE:-$compare}" --repeats "${REPEATS:-$repeats}" "$@" \
      --markdown "$OUT/${name}_$set.md" --report-json ".cache/bench/${name}_$set.json"
  done
}

for stage in "${stages[@]}"; do
  case "$stage" in
    latency)
      latency_on_every_set latency --plot --eagle-total-tokens 16 \
        --compare none,eagle2,eagle3,eagle,medusa,draft_model,hf,hf-assisted,hf-prompt-lookup
      $PY tools/bench/bench.py plot-speedups "$OUT"/latency_{humaneval,mt_bench,gsm8k,alpaca}.json \
        --plot "$OUT/speedup.png" ;;
    small-trees)
      latency_on_every_set latency_small_tree \
        --compare none,eagle3@2,eagle3@3,eagle2@2,eagle2@3,medusa@2,medusa@3,draft_model@2,draft_model@3,hf,hf-prompt-lookup ;;
    large-trees)
      latency_on_every_set latency_large_tree --eagle-total-tokens 60 --eagle-depth 7 --eagle-top-k 10 \
        --compare none,eagle3,eagle3+nolookup,eagle2 ;;
    tree-sizes)
      sizes=none,eagle3@3,eagle3@4,eagle3@8,eagle3,eagle2@4,eagle2@8,eagle2
      latency_on_every_set latency_tree_sizes --eagle-total-tokens 16 --compare $sizes
      SPECDEC_CPU_MKL_PACKS=0 latency_on_every_set latency_tree_sizes_no_packs --eagle-total-tokens 16 \
        --compare $sizes ;;
    adaptive)
      latency_on_every_set latency_adaptive --adaptive on --compare none,eagle3,eagle2 ;;
    lookup)
      entries=none,eagle3+nolookup@3,eagle3@3,eagle3+nolookup@8,eagle3@8,eagle3+nolookup,eagle3
      entries+=,eagle2+nolookup@8,eagle2@8,hf-prompt-lookup
      latency_on_every_set latency_lookup --eagle-total-tokens 16 --compare $entries ;;
    repeats)
      repeats_on_every_set latency_repeats none,eagle3@3,eagle3@8,eagle3,hf,hf-prompt-lookup 12 ;;
    amx)
      repeats_on_every_set amx none,eagle3@3,eagle3@4,eagle3@8,hf-prompt-lookup 3 --env-variant SPECDEC_CPU_AMX=0 ;;
    layer-ops)
      repeats_on_every_set layer_ops none,eagle3@3,eagle3@4,eagle3@8,hf-prompt-lookup 3 \
        --env-variant SPECDEC_CPU_LAYER_OPS=0 ;;
    cpu-tree)
      repeats_on_every_set cpu_tree none,eagle3@3,eagle3@4,eagle3@8 3 --env-variant SPECDEC_CPU_TREE=0 ;;
    adaptive-lookup)
      latency_on_every_set latency_adaptive_lookup --adaptive on \
        --compare none,eagle3+nolookup,eagle3,eagle2+nolookup,eagle2,eagle3@3 ;;
    tree-depths)
      mkdir -p .cache/bench
      for held in chat code; do
        $PY tools/bench/bench.py latency --question-set "docs/bench/heldout_${held}_questions.jsonl" \
          --num-requests 12 --output-tokens 128 --stop-at-eos --warmup 1 --no-progress --repeats 2 \
          --compare none,eagle3@4,eagle3@4/3,eagle3@8,eagle3@8/4,eagle3@16,eagle3@16/5 \
          --report-json ".cache/bench/tree_depths_$held.json" --markdown "$OUT/tree_depths_$held.md"
      done ;;
    adaptive-heldout)
      $PY tools/bench/bench.py latency --question-set docs/bench/heldout_chat_questions.jsonl --num-requests 14 \
        --output-tokens 128 --stop-at-eos --warmup 1 --no-progress --adaptive on --compare none,eagle3,eagle3@3 \
        --report-json "$OUT/latency_adaptive_heldout.json" --markdown "$OUT/latency_adaptive_heldout.md" ;;
    adaptive-vs-pinned)
      # JSON (25 KB a set) to .cache/bench/, the tables to docs/bench/
      mkdir -p .cache/bench
      for held in chat steered code; do
        $PY tools/bench/bench.py latency --question-set "docs/bench/heldout_${held}_questions.jsonl" \
          --num-requests 14 --output-tokens 128 --stop-at-eos --warmup 1 --no-progress --adaptive on \
          --compare none,eagle3,eagle2,eagle3@3,eagle3@4,eagle3@8,eagle3@16 \
          --report-json ".cache/bench/latency_adaptive_vs_pinned_$held.json" \
          --markdown "$OUT/latency_adaptive_vs_pinned_$held.md"
      done ;;
    sampled-heldout)
      $PY tools/bench/bench.py latency --question-set docs/bench/heldout_chat_questions.jsonl --num-requests 14 \
        --output-tokens 128 --stop-at-eos --warmup 1 --no-progress --temperature 0.8 --top-p 0.95 \
        --eagle-total-tokens 16 --compare none,eagle3@3,eagle3,eagle2,hf \
        --report-json "$OUT/latency_sampled_heldout.json" --markdown "$OUT/latency_sampled_heldout.md"
      $PY tools/bench/bench.py latency --question-set docs/bench/heldout_chat_questions.jsonl --num-requests 14 \
        --output-tokens 128 --stop-at-eos --warmup 1 --no-progress --temperature 0.8 --top-p 0.95 --unseeded \
        --adaptive on --compare none,eagle3,eagle3@3 --report-json "$OUT/latency_sampled_adaptive_heldout.json" \
        --markdown "$OUT/latency_sampled_adaptive_heldout.md" ;;
    sampling-truncation)
      $PY tools/bench/bench_overheads.py --measure sampling --report-json "$OUT/sampling_truncation.json" ;;
    concurrency-lookup)
      $PY tools/bench/bench_concurrency.py --question-set "$DATA/eagle_mt_bench_question.jsonl" \
        --configs plain,eagle3-nolookup,eagle3 --concurrency 1,2,4,8,16,32 --num-requests 32 --output-tokens 32 \
        --eagle-total-tokens 16 --report-json "$OUT/concurrency_lookup.json" --plot "$OUT/concurrency_lookup.png" ;;
    family)
      $PY tools/bench/eval_family.py --questions 4 --curve-tokens 48 --json "$OUT/family.json" \
        --snapshots .cache/train/heads/snapshots .cache/train/round4_work/snapshots .cache/train/round5_work/snapshots \
          .cache/train/round7_work/snapshots \
        --model-card checkpoints/smollm2-135m-instruct/MODEL_CARD.md ;;
    concurrency)
      $PY tools/bench/bench_concurrency.py --question-set "$DATA/eagle_mt_bench_question.jsonl" \
        --configs plain,eagle2,eagle3,eagle3-fixed --concurrency 1,2,4,8,16,32 --num-requests 32 \
        --output-tokens 32 --eagle-total-tokens 16 \
        --report-json "$OUT/concurrency.json" --plot "$OUT/concurrency.png"
      $PY tools/bench/bench_concurrency.py --question-set "$DATA/eagle_mt_bench_question.jsonl" \
        --configs plain,eagle2,eagle3 --concurrency 1,2,4,8,16,32 --num-requests 32 \
        --output-tokens 32 --eagle-total-tokens 16 --repeats 3 \
        --report-json "$OUT/concurrency_repeats.json" --plot "$OUT/concurrency_repeats.png" ;;
    concurrency-varied)
      $PY tools/bench/bench_concurrency.py --question-set "$DATA/eagle_mt_bench_question.jsonl" \
        --configs plain,eagle2,eagle3 --concurrency 1,2,4,8,16,32 --num-requests 32 \
        --output-tokens 16-48 --eagle-total-tokens 16 --repeats 3 \
        --report-json "$OUT/concurrency_varied.json" --plot "$OUT/concurrency_varied.png" ;;
    concurrency-packs)
      for packs in 3 0; do
        name=concurrency_mkl_packs; [ "$packs" = 0 ] && name=concurrency_no_packs
        SPECDEC_CPU_MKL_PACKS=$packs $PY tools/bench/bench_concurrency.py \
          --question-set "$DATA/eagle_mt_bench_question.jsonl" --configs plain,eagle3,eagle3-fixed \
          --concurrency 1,2,4,8,16,32 --num-requests 32 --output-tokens 32 --eagle-total-tokens 16 \
          --report-json "$OUT/$name.json" --plot "$OUT/$name.png"
      done ;;
    genai-perf)  # its repositories, logs and artifacts stay in .cache; the comparison comes here
      REQUESTS=${REQUESTS:-12} bash tools/bench/genai_perf_run.sh .cache/genai_perf
      cp .cache/genai_perf/comparison.json "$OUT/genai_perf.json"
      cp .cache/genai_perf/comparison.md "$OUT/genai_perf.md" ;;
    *) echo "unknown stage $stage: the stages are listed at the top of $0" >&2; exit 2 ;;
  esac
done
