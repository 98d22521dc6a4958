"""`tokenmux bench engine` end to end on a tiny zoo model with tiny counts: every section
runs (swap, cold load in fresh processes, engine vs HF decode, scheduler overhead, and the
random-weight --shapes path the GPU run uses) and the JSON holds every figure, finite and
in its range (durations and speeds positive, shares in [0, 1]). What a figure is worth on a
loaded machine is the benchmark's result, never asserted here: a timed share may read 0.0."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from actors.kernel_path import KernelPath

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "llama-tiny-a", "--new-tokens", "8", "--repeats", "1", "--swap-repeats", "3",
        "--cold-repeats", "1", "--overhead-requests", "2", "--overhead-tokens", "3", "--overhead-repeats", "2", "--threads", "1",
        "--metrics-pairs", "2", "--metrics-window", "0.3"]


# torch's and oneDNN's own caps: an AVX-512 host runs as an AVX2-only one (actors/cpu_isa.py)
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _bench(*args: str, timeout: float = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run([sys.executable, "-m", "deploy.cli.main", "bench", "engine", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _share(value) -> bool:
    """A measured share of time: finite and in [0, 1] (a CPU-time share can read 0.0)."""
    return isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1


def test_bench_engine_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    shm_before = _bench_shm_files()
    proc = _bench(*TINY, "--shapes", "test-tiny", "--shape-repeats", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())

    for key in ("swap_s", "memcpy_limit_s", "swap_vs_memcpy", "cold_load_s", "cold_load_warm_s",
                "cold_load_evicted_s", "decode_tps", "hf_generate_tps", "decode_vs_hf"):
        assert _positive(r[key]), (key, r.get(key))
    for key in ("scheduler_overhead_frac", "scheduler_overhead_frac_model", "scheduler_overhead_frac_model_swapping",
                "metrics_record_frac", "metrics_flush_frac"):
        assert _share(r[key]), (key, r.get(key))
    # 1 - swap / cold load: a share saved, below 1 (negative only if a swap were slower than a cold load)
    assert math.isfinite(r["swap_vs_cold_reduction"]) and r["swap_vs_cold_reduction"] < 1
    assert r["swap_vs_memcpy"] == pytest.approx(r["swap_s"] / r["memcpy_limit_s"])
    assert r["decode_vs_hf"] == pytest.approx(r["decode_tps"] / r["hf_generate_tps"])
    assert r["swap_vs_cold_reduction"] == pytest.approx(1 - r["swap_s"] / r["cold_load_s"])
    assert r["cold_load_kind"] in ("evicted_page_cache", "warm_page_cache")
    # like for like: both sides produced the same greedy tokens for every request (float32)
    assert r["decode_greedy_match"] == "8/8"
    assert r["overhead_tiny"]["num_models"] == 8 and r["overhead_tiny"]["num_swaps"] == 0
    tiny = r["overhead_tiny"]   # the mean of the uninstrumented runs, with its interval
    assert len(tiny["scheduler_overhead_frac_runs"]) == 2
    lo, hi = tiny["scheduler_overhead_frac_ci95"]
    assert r["scheduler_overhead_frac"] == pytest.approx(sum(tiny["scheduler_overhead_frac_runs"]) / 2)
    assert lo <= r["scheduler_overhead_frac"] <= hi
    assert r["overhead_model_swapping"]["num_swaps"] > 0
    m = r["machine"]
    assert m["cpu_count"] >= 1 and m["torch_threads"] == 1 and m["device"] == "cpu"
    assert set(r["floors"]) == {"swap_vs_memcpy", "swap_vs_cold_reduction", "decode_vs_hf", "scheduler_overhead_frac",
                                "metrics_overhead_frac"}
    assert r["metrics_pairs"] == 2

    shape = r["shapes"]["test-tiny"]
    for key in ("swap_s", "memcpy_limit_s", "swap_vs_memcpy", "decode_tps", "hf_generate_tps", "decode_vs_hf"):
        assert _positive(shape[key]), (key, shape.get(key))
    assert _share(shape["scheduler_overhead_frac"]), shape.get("scheduler_overhead_frac")
    # the shape's bf16 runs as bf16 where this CPU has the kernels for it, else in float32, saying why
    refusal = KernelPath("fast", "cpu").refusal(torch.bfloat16)
    assert bool(shape.get("dtype_fallback")) == bool(refusal), (shape.get("dtype_fallback"), refusal)
    for line in ("swap_vs_memcpy", "decode_vs_hf", "scheduler_overhead_frac", "shape test-tiny"):
        assert line in proc.stdout
    assert _bench_shm_files() <= shm_before, "the benchmark left host-cache files in /dev/shm"


@pytest.mark.skipif("avx2" not in Path("/proc/cpuinfo").read_text(), reason="not an x86-64 CPU with AVX2")
def test_bench_engine_measures_bf16_in_float32_on_an_avx2_cpu(tmp_path):
    """With AVX-512 hidden (as on an AVX2-only CPU) the random-weight shape's bf16 has no fast
    kernels: its figures are measured in float32 and the JSON and the table say why."""
    out = tmp_path / "bench.json"
    proc = _bench(*TINY, "--sections", "swap", "--shapes", "test-tiny", "--shape-sections", "swap,decode",
                  "--shape-repeats", "1", "--json", str(out), env=AVX2_ONLY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["kernel_path"]["cpu"]["avx512f"] is False and r["kernel_path"]["cpu"]["onednn_bf16"] is False
    shape = r["shapes"]["test-tiny"]
    assert shape["dtype_fallback"].startswith("float32 instead of bfloat16: ")
    assert "AVX512-BF16 or AMX" in shape["dtype_fallback"]
    for key in ("swap_s", "decode_tps", "hf_generate_tps"):
        assert _positive(shape[key]), (key, shape.get(key))
    assert "dtype: float32 instead of bfloat16" in proc.stdout


def _bench_shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("tokenmux-bench-*")}


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--sections", "swap,warp"], "unknown or empty ['warp']"),
    (["--shapes", "llama-huge"], "unknown ['llama-huge']"),
    (["--model", "no-such-model", "--sections", "swap"], "'no-such-model' is neither a zoo model"),
])
def test_bench_engine_bad_input_is_one_clear_line(args, message):
    proc = _bench(*args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
