"""Which kernels a forward runs: what the device offers, and the path EngineConfig chose.

    reference  the checkpoint's tensors, one F.linear per projection (MKL on CPU, cuBLAS on
               CUDA): transformers' arithmetic, token for token (the oracle tests' path)
    fast       q/k/v and gate/up fused; on CPU the large matrices packed (fp32: our blocked
               kernel, oneDNN where it does not apply; bf16, where the CPU has AVX512-BF16
               or AMX: oneDNN), on CUDA decode from CUDA graphs

The CPU's features come from torch (`get_cpu_capability`: the vectorised kernels it
dispatches to), oneDNN and /proc/cpuinfo (AVX-512, AVX512-BF16, AMX), so a benchmark can say
which path ran and why; where torch or oneDNN are capped below AVX-512 (ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA) the AVX-512 features count as absent (actors/cpu_isa.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from actors import cpu_isa, packed_linear, paged_attention_cpu
from actors.layer_kernels import fast_plan
from actors.model_spec import ModelSpec
from actors.tensor_parallel import TPShard
from actors.weight_layout import WeightLayout, checkpoint_plan

KERNELS = ("reference", "fast")


def cpu_features() -> dict:
    """cpu_isa.features() and which packed kernels this process can run."""
    onednn = packed_linear.available()
    return {
        **cpu_isa.features(),
        "onednn": onednn,
        "blocked_f32": packed_linear.blocked_available(),
        "onednn_bf16": onednn and not cpu_isa.avx512_hidden() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
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
        refusal = self.refusal(dtype)
        if refusal:
            raise ValueError(refusal)
        return self.kernels == "fast" and self.device == "cpu" and cpu_features()["onednn"]

    def refusal(self, dtype: torch.dtype) -> str:
        """Why this path cannot run `dtype` weights on this device ("" when it can)."""
        if self.kernels != "fast" or self.device != "cpu":
            return ""
        features = cpu_features()
        if not features["onednn"] or dtype == torch.float32:
            return ""   # without oneDNN: plain fused F.linear, still correct, just not packed
        if dtype != torch.bfloat16:
            return f"kernels 'fast' on CPU runs float32 or bfloat16, not {dtype}"
        if features["onednn_bf16"]:
            return ""
        hidden = f", AVX-512 hidden: {features['avx512_hidden']}" if "avx512_hidden" in features else ""
        return ("dtype bfloat16 with kernels 'fast' needs a CPU with AVX512-BF16 or AMX "
                f"(this one: {features['torch_capability']}{hidden}, no bf16 support in oneDNN); use dtype float32")

    def weight_layout(self, path: str | Path, dtype: torch.dtype, shard: TPShard = TPShard()) -> WeightLayout:
        """The flat layout of the checkpoint at `path` that this path's runner reads (of one
        tensor-parallel rank: its part of the split tensors, actors/tensor_parallel.py)."""
        spec = ModelSpec.from_dir(path)
        if self.kernels == "fast":
            plan = fast_plan(shard.spec(spec), self.packs(dtype))   # packed or not by the rank's shapes
        else:
            plan = checkpoint_plan(path) if shard.size > 1 else None
        if shard.size > 1:
            plan = shard.plan(spec, plan)
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
