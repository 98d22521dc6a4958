#!/usr/bin/env bash
# The GPU check, one call, at most ~9 minutes (TOKENMUX_GPU_BUDGET_S, default 510 s), on a machine
# with a CUDA GPU and no package registry. Each step gets what is left of the budget (capped);
# a step that fails or runs out of time says so and the next still runs.
#   0. the bundle (.gpu-bundle/, from tests/gpu/bundle.sh; git-ignored, carried along) is
#      installed into /tmp/site when present; then at once: `ray.init()` and `from ray import serve`;
#   1. every test marked `gpu` under tests/ (the Ray-actor CUDA IPC handoff among them);
#   2. the CUDA IPC KV handoff micro-benchmark, bytes verified (tests/gpu/test_cupy_ipc.py --bench);
#   3. the engine benchmark on the fast path (fused weights, CUDA graphs): decode against the HBM
#      bandwidth limit (`decode_vs_bw_limit`) for the mistral-7b and llama3-1b shapes (random bf16
#      weights), and swap-in against a raw pinned copy (`swap_vs_memcpy`);
#   4. the end-to-end load test: 8 x qwen2.5-7b shapes on the GPU, token vs request vs Ray Serve
#      multiplexed, goodput (`tokenmux loadtest --published --gpu`; its quick form when less than
#      TOKENMUX_GPU_FULL_LOADTEST_S is left; TOKENMUX_GPU_LOADTEST=0 skips it).
# TOKENMUX_GPU_STEPS (comma list of step names, default all: ray_check, gpu_tests, kv_ipc_bench,
# engine_bench, gpu_loadtest) runs only those: a session that has measured the rest gives the
# load test the whole budget with TOKENMUX_GPU_STEPS=ray_check,gpu_loadtest.
# Results: $OUT (or /tmp/tokenmux-gpu-check): gpu-check.json (every figure and each step's outcome)
# and detail.tgz (logs, junit xml, each benchmark's own JSON and records): two files, so that they
# fit what one device call brings back. Exit status: non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
RESULTS="${OUT:-/tmp/tokenmux-gpu-check}"
DETAIL="$RESULTS/detail"
mkdir -p "$DETAIL"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ -d .gpu-bundle/data ] && export TOKENMUX_DATA_DIR="$PWD/.gpu-bundle/data"   # the traces (bundle.sh leaves them out)
START=$(date +%s)
BUDGET="${TOKENMUX_GPU_BUDGET_S:-510}"
status=0
STEPS="$DETAIL/steps.jsonl"
: > "$STEPS"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# Seconds for the next step: its cap, or what is left of the budget (less a reserve for packing).
allow() { local l; l=$(( $(left) - 15 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
# step NAME RC SECONDS: one line of steps.jsonl; 124 = out of time (partial results stay).
step() {
    local outcome=ok
    if [ "$2" -eq 124 ]; then outcome=timed_out; status=1
    elif [ "$2" -ne 0 ]; then outcome=failed; status=1; fi
    echo "== $1: $outcome (rc $2, $3 s)"
    printf '{"step": "%s", "outcome": "%s", "rc": %d, "seconds": %d}\n' "$1" "$outcome" "$2" "$3" >> "$STEPS"
}
run_step() {   # NAME CAP CMD...: runs CMD under the time it is allowed, logs to detail/NAME.log
    local name=$1 cap=$2 t0 rc secs; shift 2
    case ",${TOKENMUX_GPU_STEPS:-$name}," in *",$name,"*) ;; *) echo "== $name: skipped (TOKENMUX_GPU_STEPS)"; return;; esac
    secs=$(allow "$cap")
    if [ "$secs" -lt 20 ]; then echo "== $name: skipped (budget spent)"; step "$name" 124 0; return; fi
    echo "== $name (up to $secs s)"
    t0=$(date +%s)
    timeout "$secs" "$@" > "$DETAIL/$name.log" 2>&1
    rc=$?
    tail -25 "$DETAIL/$name.log"
    step "$name" "$rc" $(( $(date +%s) - t0 ))
}

echo "== environment"
if [ -d .gpu-bundle ]; then
    mkdir -p /tmp/site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu-bundle/*.whl 2>&1 | tail -3
    tar xzf .gpu-bundle/ray-min.tgz -C /tmp/site
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi -L || echo "nvidia-smi: not found"; "$PY" - <<'PYEOF'
import importlib
for name in ("torch", "cupy", "msgpack", "pynvml", "ray", "fastapi", "pydantic", "transformers", "safetensors", "pytest"):
    try:
        print(f"{name}: {getattr(importlib.import_module(name), '__version__', 'present')}")
    except Exception as exc:
        print(f"{name}: MISSING ({type(exc).__name__})")
import torch
print("cuda:", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PYEOF
} > "$DETAIL/env.txt" 2>&1
cat "$DETAIL/env.txt"

run_step ray_check 60 "$PY" -c "
import ray
from ray import serve
ray.init(include_dashboard=False, log_to_driver=False)
print('ray', ray.__version__, ray.cluster_resources())
ray.shutdown()"

# -v: each test's name is in the log as it ends (a step cut short by its time still says how far it
# got); --timeout: one hung test or fixture teardown fails alone (a run on the H200 hung after its
# last test, and its -q log could not say which test had errored)
run_step gpu_tests 170 "$PY" -m pytest -m gpu tests/ -v -rA -p no:cacheprovider --continue-on-collection-errors \
    --timeout 100 --junitxml="$DETAIL/pytest-gpu.xml"

if "$PY" -c "import cupy, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    run_step kv_ipc_bench 70 "$PY" tests/gpu/test_cupy_ipc.py --bench "$DETAIL/kv_ipc_bench.json"
else
    echo "== kv_ipc_bench: skipped (cupy or CUDA missing)"
fi

# --max-seconds lets the bench stop between sections and keep what it has.
run_step engine_bench 170 "$PY" -m load_tests.bench.engine_bench -v --device cuda --dtype bfloat16 --kernels fast \
    --repeats 1 --swap-repeats 3 --cold-repeats 1 --sections bandwidth \
    --shapes mistral-7b,llama3-1b --shape-sections swap,bandwidth --shape-repeats 1 \
    --max-seconds "$(( $(allow 170) - 20 ))" --json "$DETAIL/bench-engine.json"

if [ "${TOKENMUX_GPU_LOADTEST:-1}" = 0 ]; then
    echo "== gpu_loadtest: skipped (TOKENMUX_GPU_LOADTEST=0)"
elif "$PY" -c "import ray, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    LT=(--published --gpu --out "$DETAIL/loadtest-gpu")
    [ "$(left)" -lt "${TOKENMUX_GPU_FULL_LOADTEST_S:-400}" ] && LT+=(--quick)
    run_step gpu_loadtest 480 "$PY" -m deploy.cli.main -v loadtest "${LT[@]}"
else
    echo "== gpu_loadtest: skipped (ray or CUDA missing)"
fi

"$PY" tests/gpu/summarize.py "$DETAIL" "$RESULTS/gpu-check.json" || status=1
tar czf "$RESULTS/detail.tgz" -C "$RESULTS" detail && rm -rf "$DETAIL"
exit $status
