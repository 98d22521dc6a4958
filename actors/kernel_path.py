"""Which kernels a forward runs: what the device offers, and the path EngineConfig chose.

    reference  the checkpoint's tensors, one F.linear per projection (MKL on CPU, cuBLAS on
               CUDA): transformers' arithmetic, token for token (the oracle tests' path)
    fast       q/k/v and gate/up fused; on CPU the large matrices packed (fp32: our blocked
               kernel, oneDNN where it does not apply; bf16, where the CPU has AVX512-BF16
               or AMX: oneDNN), on CUDA decode from CUDA graphs

The CPU's features come from torch (`get_cpu_capability`: the vectorised kernels it
dispatches to) and /proc/cpuinfo (AVX-512, AVX512-BF16, AMX), so a benchmark can say
which path ran and why.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from actors import packed_linear, paged_attention_cpu
from actors.layer_kernels import fast_plan
from actors.model_spec import ModelSpec
from actors.weight_layout import WeightLayout

KERNELS = ("reference", "fast")
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def cpu_features() -> dict:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    first = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in lines[:64])}
    flags = set(first.get("flags", "").split())
    onednn = packed_linear.available()
    return {
        "model": first.get("model name", ""),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        **{flag: flag in flags for flag in _CPU_FLAGS},
        "onednn": onednn,
        "blocked_f32": packed_linear.blocked_available(),
        "onednn_bf16": onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    }


@dataclass(frozen=True)
class KernelPath:
    kernels: str          # "reference" | "fast"
    device: str           # "cpu" | "cuda"

    def __post_init__(self) -> None:
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {self.kernels!r}")

    @property
    def cuda_graphs(self) -> bool:
        return self.kernels == "fast" and self.device == "cuda"

    def packs(self, dtype: torch.dtype) -> bool:
        """Whether this path packs `dtype` linear weights (actors/packed_linear.py: oneDNN is
        the form every packed matrix can take, so packing needs it); ValueError where the
        fast path was asked for a dtype this CPU has no fast kernels for."""
        if self.kernels != "fast" or self.device != "cpu":
            return False
        features = cpu_features()
        if not features["onednn"]:
            return False   # plain fused F.linear: still correct, just without the packed kernels
        if dtype == torch.float32:
            return True
        if dtype == torch.bfloat16:
            if not features["onednn_bf16"]:
                raise ValueError("dtype bfloat16 with kernels 'fast' needs a CPU with AVX512-BF16 or AMX "
                                 f"(this one: {features['torch_capability']}, no bf16 support in oneDNN); "
                                 "use dtype float32")
            return True
        raise ValueError(f"kernels 'fast' on CPU runs float32 or bfloat16, not {dtype}")

    def weight_layout(self, path: str | Path, dtype: torch.dtype) -> WeightLayout:
        """The flat layout of the checkpoint at `path` that this path's runner reads."""
        plan = fast_plan(ModelSpec.from_dir(path), self.packs(dtype)) if self.kernels == "fast" else None
        return WeightLayout.from_dir(path, dtype=dtype, plan=plan)

    def describe(self, dtype: torch.dtype) -> dict:
        """What runs, in words and flags: for `tokenmux bench engine` and model_info."""
        name = str(dtype).removeprefix("torch.")
        if self.kernels == "reference":
            linear = f"F.linear per projection ({'cuBLAS' if self.device == 'cuda' else 'MKL'}, {name})"
        elif self.device == "cuda":
            linear = f"fused q/k/v + gate/up, F.linear (cuBLAS, {name}), decode from CUDA graphs"
        elif self.packs(dtype):
            isa = f"{cpu_features()['torch_capability']}{', AMX' if cpu_features()['amx_tile'] else ''}"
            packed = f"oneDNN-packed {name} ({isa})"
            if dtype == torch.float32 and cpu_features()["blocked_f32"]:
                packed = (f"blocked {name} kernel (actors/blocked_linear_cpu.cpp, built -march=native on "
                          f"{isa}) where out % 32 == 0, else {packed}")
            linear = f"fused q/k/v + gate/up, matrices >= 2^19 weights packed: {packed}"
        else:
            linear = f"fused q/k/v + gate/up, F.linear (MKL, {name}; oneDNN unavailable)"
        attention = "SDPA over blocks gathered with one index_select per layer"
        if self.kernels == "fast" and self.device == "cpu" and paged_attention_cpu.available():
            attention = "decode: C++ kernel over the paged pool (actors/paged_attention_cpu.cpp); prefill: " + attention
        out = {"kernels": self.kernels, "device": self.device, "dtype": name, "linear": linear,
               "attention": attention,
               "cuda_graphs": self.cuda_graphs}
        if self.device == "cpu":
            out["cpu"] = cpu_features()
        return out
