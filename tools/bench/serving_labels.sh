# Sourced by the serving benchmarks (genai_perf_run.sh, aiperf_run.sh): one tritonserver at
# a time on the default ports, one model repository per label.
#   start_server LABEL OUT_DIR [launch_triton_server.py options]
#       builds OUT_DIR/repo_LABEL (METHOD[LABEL], then $BUILD_ARGS), starts the server with
#       its log in OUT_DIR/server_LABEL.log and waits until it is ready (and the OpenAI front
#       door too, when the options include --openai_port)
#   stop_server
# Labels: plain = no speculation; eagle2, eagle3 = that method as tools/serve.sh serves it
# (adaptive speculation, the tree size timed at load); eagle2-fixed = EAGLE-2 with a 16-node
# tree on every step (adaptive off), what speculation costs and buys when always on.
# shellcheck shell=bash
declare -A METHOD=([plain]="--method none" [eagle2]="--method eagle2" [eagle3]="--method eagle3"
                   [eagle2-fixed]="--method eagle2 --set eagle_total_tokens:16,adaptive_speculation:false")
SERVER=""

stop_server() {  # the launcher leads its own process group: server, model stubs, front door
    [ -n "$SERVER" ] || return 0
    kill -TERM -- "-$SERVER" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 -- "-$SERVER" 2>/dev/null || { SERVER=""; return 0; }; sleep 1; done
    # A stub still decoding requests of a client that went away ignores SIGTERM.
    kill -KILL -- "-$SERVER" 2>/dev/null || true
    SERVER=""
}
trap stop_server EXIT

start_server() {
    local label=$1 out=$2; shift 2
    [ -n "${METHOD[$label]:-}" ] || { echo "unknown label $label (${!METHOD[*]})" >&2; exit 2; }
    # shellcheck disable=SC2086  # METHOD and BUILD_ARGS hold several options
    "$PY" tools/build_model_repo.py --out "$out/repo_$label" ${METHOD[$label]} ${BUILD_ARGS:-}
    setsid "$PY" tools/launch_triton_server.py --world_size=1 --model_repo="$out/repo_$label" \
        --exit_timeout_secs 3 --log-file "$out/server_$label.log" "$@" 2>"$out/launch_$label.err" &
    SERVER=$!
    local front_door=false
    [[ " $* " != *" --openai_port "* ]] || front_door=true
    until curl -sf localhost:8000/v2/health/ready >/dev/null \
            && { ! $front_door || curl -sf localhost:9000/health >/dev/null; }; do
        kill -0 "$SERVER" 2>/dev/null || { cat "$out/launch_$label.err" >&2; exit 1; }
        sleep 1
    done
}
