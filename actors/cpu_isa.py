"""Which of this CPU's vector instruction sets tokenmux may use: what /proc/cpuinfo lists,
less AVX-512 (and AVX512-BF16, AMX) where torch or oneDNN were told to stay below it.

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 make test   # run as on an AVX2-only CPU

Both variables are the libraries' own: torch dispatches its vectorised kernels by
`torch.backends.cpu.get_cpu_capability()` (which honours ATEN_CPU_CAPABILITY), and oneDNN
caps its kernels at ONEDNN_MAX_CPU_ISA, which `torch.ops.mkldnn._is_mkldnn_bf16_supported()`
reflects (ideep asks oneDNN for its effective ISA: bf16 needs AVX512_CORE, or AVX2_VNNI_2,
which no AVX-512 CPU has). Either cap hides AVX-512 from every decision tokenmux makes:
the packed bf16 path, the blocked fp32 kernel, and the flags our C++ kernels are built with
(actors/paged_attention_cpu.py), so an AVX-512 host reproduces an AVX2 one.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
WIDE_FLAGS = ("avx512", "amx")   # the prefixes of what a cap below AVX-512 hides


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo (empty where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    first = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in lines[:64])}
    return first.get("model name", ""), frozenset(first.get("flags", "").split())


@functools.lru_cache(maxsize=1)
def avx512_hidden() -> str:
    """Why this AVX-512 CPU is to be used as an AVX2 one ("" when it is not: no AVX-512 here,
    or nothing capped it)."""
    if "avx512f" not in _cpuinfo()[1]:
        return ""
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return f"torch dispatches {capability} kernels (ATEN_CPU_CAPABILITY)"
    if torch.backends.mkldnn.is_available() and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN is capped below AVX512_CORE (ONEDNN_MAX_CPU_ISA)"
    return ""


def features() -> dict:
    """The CPU's model, torch's dispatch level and CPU_FLAGS as tokenmux may use them."""
    model, flags = _cpuinfo()
    hidden = avx512_hidden()
    out = {"model": model, "torch_capability": torch.backends.cpu.get_cpu_capability(),
           **{flag: flag in flags and not (hidden and flag.startswith(WIDE_FLAGS)) for flag in CPU_FLAGS}}
    if hidden:
        out["avx512_hidden"] = hidden
    return out
