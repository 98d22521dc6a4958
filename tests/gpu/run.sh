#!/usr/bin/env bash
# One-shot GPU check, for a machine with a CUDA GPU and no internet (full mode ~20 minutes, quick ~10):
#   1. environment: GPU, and which of torch / cupy / ray / ... the python has;
#   2. every test marked `gpu` under tests/ (a test file that cannot import a missing
#      package, e.g. ray, is reported and skipped, not counted as a failure);
#   3. the CUDA IPC KV handoff micro-benchmark (tests/gpu/test_cupy_ipc.py --bench);
#   4. the engine benchmark (load_tests/bench/engine_bench.py, what `tokenmux bench engine` runs) on
#      the fast kernel path (fused weights, CUDA graphs for decode), with its metrics-overhead section
#      and `decode_vs_bw_limit`: decode at batch 1 of a 7B-shaped bf16 model against
#      (weight + KV bytes) / measured HBM bandwidth;
#   5. the colocate benchmark on 7B-shaped models (`tokenmux bench colocate`; full mode only);
#   6. the side-by-side load test with real-size models: 8 copies of a 7B shape (random bf16
#      weights) on the one GPU, token-level vs request-level vs Ray Serve multiplexed
#      (`tokenmux loadtest --published --gpu`, load_tests/published.py; ~6 min, quick ~3 min;
#      TOKENMUX_GPU_LOADTEST=0 skips it). Its JSON and records go to $OUT/loadtest-gpu/.
# Uses the python that already holds torch ($PYTHON, default python3); installs nothing.
# Results go to $OUT (or /tmp/tokenmux-gpu-check). Exit status: non-zero if a test failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
RESULTS="${OUT:-/tmp/tokenmux-gpu-check}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_USAGE_STATS_ENABLED=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
# TOKENMUX_GPU_QUICK=1: a shorter check (~4 minutes) for a nearly spent device budget: the gpu
# tests, the engine benchmark on llama-100m, and decode_vs_bw_limit on the mistral-7b shape only.
QUICK="${TOKENMUX_GPU_QUICK:-0}"
# A step's exit status: 124 = it ran out of time (its partial results stay), other non-zero = failed.
step_result() {  # NAME RC WHAT-IS-LEFT
    if [ "$2" -eq 124 ]; then
        echo "$1: timed out ($3)"
    elif [ "$2" -ne 0 ]; then
        echo "$1 failed"; status=1
    fi
}

echo "== environment"
{ nvidia-smi -L || echo "nvidia-smi: not found"; "$PY" - <<'PYEOF'
import importlib
for name in ("torch", "cupy", "msgpack", "pynvml", "ray", "transformers", "safetensors", "pytest"):
    try:
        print(f"{name}: {getattr(importlib.import_module(name), '__version__', 'present')}")
    except Exception as exc:
        print(f"{name}: MISSING ({type(exc).__name__})")
import torch
print("cuda:", torch.cuda.is_available(), torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
PYEOF
} 2>&1 | tee "$RESULTS/env.txt"

echo "== gpu tests"
timeout "$([ "$QUICK" = 1 ] && echo 80 || echo 200)" "$PY" -m pytest -m gpu tests/ -q -rs -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$RESULTS/pytest-gpu.xml" 2>&1 | tee "$RESULTS/pytest-gpu.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 124 ]; then
    echo "gpu tests: TIMED OUT"; status=1
else
    # pytest says 1 both for failed tests and for files it could not collect; only the former count.
    "$PY" - "$RESULTS/pytest-gpu.xml" <<'PYEOF' || status=1
import re, sys, xml.etree.ElementTree as ET
OUR_PACKAGES = {"scheduler", "actors", "cluster", "deploy", "load_tests"}   # missing = a real bug
failed, missing = [], []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    for bad in list(case.findall("failure")) + list(case.findall("error")):
        message = bad.get("message") or ""
        where = f"{case.get('classname')}::{case.get('name')}"
        missing_name = re.search(r"No module named '([\w.]+)'", bad.text or "")
        if "collection failure" in message and missing_name \
                and missing_name.group(1).split(".")[0] not in OUR_PACKAGES:
            missing.append(where)
        else:
            failed.append(where)
for m in missing:
    print(f"skipped (missing package): {m}")
for f in failed:
    print(f"FAILED: {f}")
sys.exit(1 if failed else 0)
PYEOF
fi

echo "== KV handoff benchmark (CUDA IPC)"
if [ "$QUICK" = 1 ]; then
    echo "skipped: quick mode"
elif "$PY" -c "import cupy, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    timeout 90 "$PY" tests/gpu/test_cupy_ipc.py --bench "$RESULTS/kv_ipc_bench.json" || { echo "kv bench failed"; status=1; }
else
    echo "skipped: cupy or CUDA missing"
fi

echo "== engine benchmark"
# llama-100m (bf16) through every section, then random-weight models of real shapes: PCIe
# swap-in vs raw pinned->device copy, engine vs HF generate, scheduler overhead, decode at
# batch 1 vs the bandwidth limit. ~6 minutes (quick ~3); the JSON is rewritten after each
# section, so a timeout still leaves the figures so far. Never run yet: no GPU was lent to
# the session that wrote the fast path (CUDA graphs, bandwidth section).
# Run as a module: the GPU machine may have no `tokenmux` script, ray or fastapi.
if "$PY" -c "import torch, transformers, safetensors; assert torch.cuda.is_available()" 2>/dev/null; then
    if [ "$QUICK" = 1 ]; then
        BENCH=(--repeats 2 --swap-repeats 5 --cold-repeats 1 --sections swap,decode,overhead,bandwidth
               --shapes mistral-7b --shape-sections bandwidth --shape-repeats 1 --max-seconds 150); LIMIT=240
    else
        BENCH=(--repeats 3 --swap-repeats 7 --cold-repeats 1 --sections swap,cold,decode,overhead,bandwidth
               --shapes llama3-1b,qwen2.5-7b,mistral-7b --shape-sections swap,decode,overhead,bandwidth
               --shape-repeats 2 --shape-overhead-models 4 --max-seconds 300); LIMIT=420
    fi
    timeout "$LIMIT" "$PY" -m load_tests.bench.engine_bench -v --device cuda --dtype bfloat16 \
        "${BENCH[@]}" --json "$RESULTS/bench-engine.json" 2>&1 \
        | tee "$RESULTS/bench-engine.log"
    step_result "engine bench" "${PIPESTATUS[0]}" "partial results in bench-engine.json"
else
    echo "skipped: CUDA, transformers or safetensors missing"
fi
echo "== colocate benchmark (7B-shaped agents: time-sliced processes vs one tokenmux engine)"
# Each agent's model is a random-weight qwen2.5-7b (bf16, ~15 GB): 1, 2 and 4 agents (8 would need
# ~120 GB of host cache on top of the device). ~4 minutes; skipped in quick mode.
if [ "$QUICK" = 1 ]; then
    echo "skipped: quick mode"
elif "$PY" -c "import torch, psutil; assert torch.cuda.is_available()" 2>/dev/null; then
    timeout 300 "$PY" -m load_tests.bench.colocate -v --device cuda --dtype bfloat16 --shape qwen2.5-7b \
        --agents 1,2,4 --repeats 1 --turns 3 --new-tokens 48 --json "$RESULTS/bench-colocate.json" \
        --plot "$RESULTS/colocate-gpu.png" 2>&1 | tee "$RESULTS/bench-colocate.log"
    step_result "colocate bench" "${PIPESTATUS[0]}" "partial results in bench-colocate.json"
else
    echo "skipped: CUDA or psutil missing"
fi
echo "== side-by-side load test (8 x qwen2.5-7b shape on one GPU: token vs request vs Serve multiplexed)"
# Needs ray (the contenders are Ray actors and a Serve app); the shape is built once (~15 GB,
# under ~/.cache/tokenmux/shapes) and its host-cache copy lives in /dev/shm.
if [ "${TOKENMUX_GPU_LOADTEST:-1}" = 0 ]; then
    echo "skipped: TOKENMUX_GPU_LOADTEST=0"
elif "$PY" -c "import ray, torch, transformers; assert torch.cuda.is_available()" 2>/dev/null; then
    LT=(--published --gpu --out "$RESULTS/loadtest-gpu"); LIMIT=480
    if [ "$QUICK" = 1 ]; then LT+=(--quick); LIMIT=240; fi
    timeout "$LIMIT" "$PY" -m deploy.cli.main loadtest "${LT[@]}" 2>&1 | tail -60 | tee "$RESULTS/loadtest-gpu.log"
    step_result "gpu load test" "${PIPESTATUS[0]}" "records so far in loadtest-gpu/loadtest-records.jsonl.gz"
else
    echo "skipped: ray, transformers or CUDA missing"
fi
exit $status
