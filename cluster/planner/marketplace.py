"""A marketplace to plan for: its models, each of a model type with real costs on a device.

A model type is what the fleet pays for one model: its weight bytes (a switch copies them),
its KV shape (what a token of context holds), its longest context, and its step-time fit
on the planned device (cluster/planner/cost_model.py, from `profiles/<type>/<GPU>`). The table
holds the three types of Aegaeon's simulator mix (60% qwen2.5-7b, 20% yi-9b, 20%
llama2-13b; sizes from their configs, bf16); a directory written by `tokenmux profile`
(iNbB.json files + model.json) is a type too, with its costs on the machine it was
profiled on.

A sparse MoE type has no profile of its own here: it is derived from a measured dense one
(`derived_from`), its step costs scaled by its ACTIVE parameters (what one token reads)
and its KV, while a switch still copies ALL its weights (`weight_bytes`, every expert).

A tensor-parallel type (`tensor_parallel` N > 1: a model larger than one device) is
served by N devices of one node; each holds 1/N of its weights and KV, which is what a
slot must hold and a switch copies (on every member at once, each over its own link). It
has no measured profile either: its step is scaled from a measured dense type by the
weight bytes one DEVICE reads (weight_bytes / N) and its KV per device, plus the cost of
its all-reduces (cost_model.py `with_all_reduce`; `all_reduce_cost` below says how it is
priced). Every scaled type is labelled `scaled` wherever a plan shows its types.

`Marketplace.build(names, mix, device, profiles)` gives each served model a type:
interleaved by popularity rank so that every part of the popularity curve gets the mix
(rank i takes the type whose share so far lags its target most).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster.planner.cost_model import StepCostFit, fit_profile
from cluster.planner.devices import DeviceSpec, device_spec
from scheduler.kv_blocks import KVShape
from scheduler.tp_groups import check_tensor_parallel, device_share

DEFAULT_MIX = "qwen2.5-7b:0.6,yi-9b:0.2,llama2-13b:0.2"   # Aegaeon's simulator mix
DATA_DIR = Path(os.environ.get("TOKENMUX_DATA_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")
PROFILES_DIR = DATA_DIR / "profiles"
AZURE_CONV = DATA_DIR / "traces" / "azure-llm-2023" / "conv.csv"


@dataclass(frozen=True)
class ModelType:
    name: str
    profile: str           # sub-directory of the profiles root, or a directory of its own
    weight_bytes: int
    kv_shape: KVShape
    max_context: int       # prompt + output tokens it accepts
    # A sparse MoE: the bytes one token's step reads (its active parameters), and the measured
    # dense type its step costs are scaled from. None: dense, its own profile.
    active_bytes: int | None = None
    derived_from: str | None = None
    tensor_parallel: int = 1       # devices of one node that serve it together
    hidden_size: int = 0           # a TP type's all-reduces move hidden_size activations per token

    def __post_init__(self) -> None:
        if self.weight_bytes <= 0 or self.max_context < 1:
            raise ValueError(f"model type {self.name!r}: weight_bytes and max_context must be > 0")
        if self.active_bytes is not None and self.derived_from is None:
            raise ValueError(f"model type {self.name!r}: a MoE type needs both active_bytes and derived_from")
        if self.active_bytes is not None and not 0 < self.active_bytes <= self.weight_bytes:
            raise ValueError(f"model type {self.name!r}: active_bytes must be in (0, weight_bytes]")
        check_tensor_parallel(self.tensor_parallel, model=self.name)
        if self.tensor_parallel > 1 and (self.derived_from is None or self.hidden_size < 1):
            raise ValueError(f"model type {self.name!r}: a tensor-parallel type is scaled from a measured "
                             f"one (derived_from) and needs its hidden_size")

    @property
    def measured(self) -> bool:
        """Its own profile (True), or step costs scaled from another type's (False: `scaled`)."""
        return self.derived_from is None

    @property
    def device_weight_bytes(self) -> int:
        """What one device of its group holds and swaps in: all of it at tensor_parallel 1."""
        return device_share(self.weight_bytes, self.tensor_parallel)

    @property
    def device_kv_shape(self) -> KVShape:
        """One device's share of its KV: the KV heads split across the group."""
        s = self.kv_shape
        return KVShape(s.num_layers, max(1, s.num_kv_heads // self.tensor_parallel), s.head_dim, s.dtype_bytes)

    @property
    def step_bytes(self) -> int:
        """Weight bytes one device reads a step: all of a dense model's (its share of them at
        tensor parallel), a MoE's active ones."""
        return device_share(self.weight_bytes if self.active_bytes is None else self.active_bytes,
                            self.tensor_parallel)

    def fit(self, profiles_root: str | Path, device: str | DeviceSpec) -> StepCostFit:
        """Step costs on `device` (a name, or a DeviceSpec whose link prices a TP type's
        all-reduces): measured, or scaled from its base type's."""
        name = device if isinstance(device, str) else device.name
        if self.derived_from is None:
            return fit_profile(self.profile_dir(profiles_root, name))
        base = MODEL_TYPES[self.derived_from]
        fit = base.fit(profiles_root, name).scaled(self.step_bytes / base.step_bytes,
                                                   self.kv_bytes_per_token / base.kv_bytes_per_token)
        if self.tensor_parallel == 1:
            return fit
        if isinstance(device, str):
            device = device_spec(device)
        return fit.with_all_reduce(*all_reduce_cost(self, device))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV one token holds on one device (its share at tensor parallel)."""
        return self.device_kv_shape.block_bytes // 16

    def profile_dir(self, profiles_root: str | Path, device: str) -> Path:
        own = Path(self.profile)
        if own.is_absolute() or (own / "model.json").is_file():
            return own
        path = Path(profiles_root) / self.profile / device
        if not path.is_dir():
            have = sorted(p.name for p in (Path(profiles_root) / self.profile).glob("*") if p.is_dir())
            raise ValueError(f"no {device} profile of {self.name} at {path}; profiled devices: "
                             f"{', '.join(have) or 'none'}")
        return path

    @classmethod
    def from_profile_dir(cls, path: str | Path) -> "ModelType":
        """A directory written by `tokenmux profile`: its model.json names the type."""
        meta_path = Path(path) / "model.json"
        if not meta_path.is_file():
            raise ValueError(f"{path} is neither a known model type nor a profile directory with a model.json")
        meta = json.loads(meta_path.read_text())
        return cls(meta["name"], str(Path(path).resolve()), int(meta["weight_bytes"]),
                   KVShape(*meta["kv_shape"]), int(meta["max_context"]))

    def to_dict(self) -> dict:
        s = self.kv_shape
        out = {"name": self.name, "weight_bytes": self.weight_bytes, "max_context": self.max_context,
               "kv_shape": [s.num_layers, s.num_kv_heads, s.head_dim, s.dtype_bytes], "profile": self.profile}
        if self.derived_from is not None:
            out.update(active_bytes=self.active_bytes, derived_from=self.derived_from)
        if self.tensor_parallel > 1:
            out.update(tensor_parallel=self.tensor_parallel, device_weight_bytes=self.device_weight_bytes)
        out["costs"] = "measured" if self.measured else f"scaled from {self.derived_from}"
        return out


# What one all-reduce costs besides its bytes: NCCL's small-message latency within a node.
# NVIDIA's nccl-tests put an all-reduce of a few KiB between 2-8 NVLink/NVSwitch GPUs at
# roughly 5-15 us; 10 us is taken, an ESTIMATE (no TP run was measured here). A decode step's
# all-reduces are small (batch x hidden x 2 bytes), so this latency is most of their cost.
ALL_REDUCE_LATENCY_S = 10e-6


def all_reduce_cost(t: ModelType, device: DeviceSpec) -> tuple[float, float]:
    """(seconds per step, seconds per token) of a TP type's all-reduces on `device`: two per
    layer (after attention, after the MLP), each a fixed latency plus, per token, its
    hidden_size activations x dtype bytes; a ring all-reduce sends and receives 2 (N - 1) / N
    of them per device, over the node's device link (d2d)."""
    n, layers = t.tensor_parallel, t.kv_shape.num_layers
    per_token_bytes = 2 * layers * t.hidden_size * t.kv_shape.dtype_bytes * 2 * (n - 1) / n
    return 2 * layers * ALL_REDUCE_LATENCY_S, per_token_bytes / device.d2d_bytes_per_s

# Parameters x 2 bytes (bf16); KV: layers, KV heads, head dim (qwen2.5-7b and yi-9b use
# grouped-query attention with 4 KV heads, llama2-13b has one KV head per query head).
MODEL_TYPES: dict[str, ModelType] = {
    "qwen2.5-7b": ModelType("qwen2.5-7b", "qwen2_5_7b", 7_615_616_512 * 2, KVShape(28, 4, 128, 2), 32768),
    "yi-9b": ModelType("yi-9b", "yi_9b", 8_829_407_232 * 2, KVShape(48, 4, 128, 2), 4096),
    "llama2-13b": ModelType("llama2-13b", "llama2_13b", 13_015_864_320 * 2, KVShape(40, 40, 128, 2), 4096),
    "yi-1.5-9b-chat": ModelType("yi-1.5-9b-chat", "yi1_5_9b_chat", 8_829_407_232 * 2, KVShape(48, 4, 128, 2), 4096),
    "llama2-13b-chat": ModelType("llama2-13b-chat", "llama2_13b_chat", 13_015_864_320 * 2,
                                 KVShape(40, 40, 128, 2), 4096),
    # Sparse MoE, DERIVED (no measured profile): steps scaled from a dense type by active
    # parameters and KV; switches copy every expert. Sizes from the published configs:
    # Qwen3-30B-A3B 30.5B parameters, 3.3B active (128 experts, 8 per token), 48 layers, 4 KV
    # heads; Mixtral-8x7B 46.7B, 12.9B active (8 experts, 2 per token), 32 layers, 8 KV heads.
    "qwen3-30b-a3b": ModelType("qwen3-30b-a3b", "qwen2_5_7b", 30_532_122_624 * 2, KVShape(48, 4, 128, 2), 32768,
                               active_bytes=3_300_000_000 * 2, derived_from="qwen2.5-7b"),
    "mixtral-8x7b": ModelType("mixtral-8x7b", "llama2_13b", 46_702_792_704 * 2, KVShape(32, 8, 128, 2), 32768,
                              active_bytes=12_900_000_000 * 2, derived_from="llama2-13b"),
    # Larger than one device, SCALED (no measured profile): Qwen2.5-72B, 72.7B parameters
    # (145 GB in bf16, more than an H100, H800 or H20 holds), 80 layers, 8 KV heads, hidden
    # 8192, at tensor parallel 2. Scaled from qwen2.5-7b (same family, measured on H100, H800,
    # H20) by weights per device (72.7 / 2 / 7.6 = x4.8) and KV per device (x2.9), plus its
    # all-reduces (all_reduce_cost).
    "qwen2.5-72b": ModelType("qwen2.5-72b", "qwen2_5_7b", 72_706_203_648 * 2, KVShape(80, 8, 128, 2), 32768,
                             derived_from="qwen2.5-7b", tensor_parallel=2, hidden_size=8192),
}


def model_type(name_or_dir: str) -> ModelType:
    if name_or_dir in MODEL_TYPES:
        return MODEL_TYPES[name_or_dir]
    if Path(name_or_dir).is_dir():
        return ModelType.from_profile_dir(name_or_dir)
    raise ValueError(f"unknown model type {name_or_dir!r}; known: {', '.join(MODEL_TYPES)} "
                     f"(or a directory written by `tokenmux profile`)")


def parse_mix(text: str) -> list[tuple[ModelType, float]]:
    """'qwen2.5-7b:0.6,yi-9b:0.2,DIR' -> [(type, share)], shares normalised (1 where omitted)."""
    entries = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, share = part.rpartition(":")
        if not sep or not _is_number(share):
            name, share = part, "1"
        if not float(share) > 0:
            raise ValueError(f"--model-mix share of {name!r} must be > 0, got {share}")
        entries.append((model_type(name), float(share)))
    if not entries:
        raise ValueError("--model-mix is empty")
    names = [t.name for t, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"--model-mix names a type twice: {names}")
    total = sum(s for _, s in entries)
    return [(t, s / total) for t, s in entries]


def assign_types(models: Sequence[str], mix: Sequence[tuple[ModelType, float]]) -> dict[str, ModelType]:
    """Model (most popular first) -> type, interleaved so every rank band gets the mix."""
    counts = [0] * len(mix)
    out = {}
    for i, model in enumerate(models):
        k = max(range(len(mix)), key=lambda j: (mix[j][1] * (i + 1) - counts[j], -j))
        counts[k] += 1
        out[model] = mix[k][0]
    return out


@dataclass(frozen=True)
class Marketplace:
    """Served models, their types, and each type's step-cost fit on the planned device."""

    types: Mapping[str, ModelType]                  # model -> type
    fits: Mapping[str, StepCostFit] = field(repr=False)   # model -> its type's fit (shared objects)

    @classmethod
    def build(cls, models: Sequence[str], mix: Sequence[tuple[ModelType, float]], device: str | DeviceSpec,
              profiles_root: str | Path = PROFILES_DIR) -> "Marketplace":
        """`device`: a table name, or the DeviceSpec planned for (its link prices all-reduces)."""
        types = assign_types(models, mix)
        by_type = {t.name: t.fit(profiles_root, device) for t, _ in mix}
        return cls(types, {m: by_type[t.name] for m, t in types.items()})

    @property
    def models(self) -> list[str]:
        return list(self.types)

    def largest_weight_bytes(self) -> int:
        """The most weight bytes one device holds of a model: what a slot is sized to."""
        return max(t.device_weight_bytes for t in self.types.values())

    def max_tensor_parallel(self) -> int:
        """The fewest devices any policy can serve every model on."""
        return max(t.tensor_parallel for t in self.types.values())

    def dedicated_devices(self) -> int:
        """Devices when each model has its own: one, or its group's N."""
        return sum(t.tensor_parallel for t in self.types.values())

    def scaled_types(self) -> list[str]:
        """Types whose step costs are scaled from another's profile, not measured."""
        return sorted({t.name for t in self.types.values() if not t.measured})

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t.name] = counts.get(t.name, 0) + 1
        return counts


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
