"""Cold load: `AutoModelForCausalLM.from_pretrained` of the checkpoint in a fresh process.

This is what a system without a host weight cache pays to bring a model in. Each load
runs in its own subprocess (`python -m load_tests.bench.cold_load`), which imports torch
and transformers (and creates the CUDA context) BEFORE its timer: `load_s` covers the
from_pretrained call only (onto the device, synchronised); `process_s`, measured by the
parent, is the whole process.

The page cache decides what "from disk" means, so both states are measured:
  warm     the safetensors files were just read, so the load comes from memory;
  evicted  `posix_fadvise(DONTNEED)` on each file right before the call. The kernel drops
           only clean pages nobody maps, so the child also reports the fraction of the
           file that was still resident (mincore) when the timer started.
"""
from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


def measure_cold_load(path: Path, *, device: str, dtype: str | None, repeats: int) -> dict:
    warm, evicted = [], []
    for _ in range(repeats):
        _read_files(path)   # warm the page cache
        warm.append(_load_in_subprocess(path, device, dtype, evict=False))
        evicted.append(_load_in_subprocess(path, device, dtype, evict=True))
    result = {
        "cold_load_warm_s": _median([r["load_s"] for r in warm]),
        "cold_load_warm_process_s": _median([r["process_s"] for r in warm]),
        "cold_load_evicted_s": _median([r["load_s"] for r in evicted]),
        "cold_load_evicted_process_s": _median([r["process_s"] for r in evicted]),
        "cold_load_evicted_resident_frac": max(r["resident_frac"] for r in evicted),
        "cold_load_warm_resident_frac": min(r["resident_frac"] for r in warm),
        "cold_load_samples": {"warm": warm, "evicted": evicted},
    }
    # Evicted counts only if the kernel really dropped (nearly) the whole file.
    if result["cold_load_evicted_resident_frac"] <= 0.05:
        result["cold_load_s"], result["cold_load_kind"] = result["cold_load_evicted_s"], "evicted_page_cache"
    else:
        result["cold_load_s"], result["cold_load_kind"] = result["cold_load_warm_s"], "warm_page_cache"
        logger.warning("page cache could not be evicted (%.0f%% still resident); cold_load_s is the warm figure",
                       100 * result["cold_load_evicted_resident_frac"])
    return result


def _median(values: list[float]) -> float:
    from load_tests.bench.common import median

    return median(values)


def _safetensors(path: Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    return files


def _read_files(path: Path) -> None:
    for file in _safetensors(path):
        with open(file, "rb") as f:
            while f.read(16 * (1 << 20)):
                pass


def _load_in_subprocess(path: Path, device: str, dtype: str | None, evict: bool) -> dict:
    cmd = [sys.executable, "-m", "load_tests.bench.cold_load", str(path), device, dtype or "auto"]
    if evict:
        cmd.append("--evict")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    process_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"cold load subprocess failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = process_s
    return result


def resident_fraction(files: list[Path]) -> float:
    """Share of the files' pages in the page cache (mincore over a fresh read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    total = resident = 0
    for file in files:
        size = file.stat().st_size
        pages = -(-size // mmap.PAGESIZE)
        fd = os.open(file, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {file} failed")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {file} failed")
                resident += sum(b & 1 for b in bytes(vec))
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
        total += pages
    return resident / max(1, total)


def _evict(files: list[Path]) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _child(argv: list[str]) -> None:
    """In the fresh process: imports first, then time from_pretrained alone; one JSON line out."""
    path, device, dtype = Path(argv[0]), argv[1], argv[2]
    evict = "--evict" in argv[3:]
    start = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.empty(1, device=device)   # CUDA context now, not inside the timed load
    files = _safetensors(path)
    if evict:
        _evict(files)
    resident = resident_fraction(files)
    imports_s = time.perf_counter() - start
    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if on_cuda:
        kwargs["device_map"] = device
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if on_cuda:
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - t0
    num_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"load_s": load_s, "imports_s": imports_s, "resident_frac": resident,
                      "evicted": evict, "num_params": num_params}))


if __name__ == "__main__":
    _child(sys.argv[1:])
