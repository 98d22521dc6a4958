"""What the engine needs to know about a checkpoint, read from its directory alone.

`ModelSpec.from_dir(path)` reads config.json, generation_config.json and the safetensors
headers of a local Hugging Face checkpoint, without importing torch or loading a tensor.
It accepts both config dialects: transformers 4 (`rope_theta`, `rope_scaling`,
`torch_dtype`) and transformers 5 (`rope_parameters`, `dtype`). Anything the engine
cannot serve correctly is refused here, with one line naming the path, rather than
producing wrong tokens later.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.kv_blocks import KVShape

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(ValueError):
    """A path that is not a checkpoint tokenmux can serve; the message is one line."""


@dataclass(frozen=True)
class MoeSpec:
    """The sparse mixture-of-experts blocks of a checkpoint (actors/moe.py runs them)."""

    num_experts: int
    top_k: int                        # experts per token
    intermediate_size: int            # of one expert
    norm_topk_prob: bool              # the top-k probabilities renormalised to sum to 1 (Mixtral: always)
    float32_weights: bool             # routing weights kept in float32 (Mixtral) or cast to the model dtype (Qwen3-MoE)
    sparse_layers: tuple[int, ...]    # layers whose MLP is the sparse block; the others are dense
    stacked_experts: bool = False     # the checkpoint stores experts as 3-D tensors, not one per expert

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        object.__setattr__(self, "sparse_layers", tuple(sorted(int(i) for i in self.sparse_layers)))

    def expert_params(self, hidden_size: int) -> int:
        """Weights of one expert (gate, up and down)."""
        return 3 * hidden_size * self.intermediate_size


@dataclass(frozen=True)
class ModelSpec:
    path: str
    architecture: str                 # e.g. "LlamaForCausalLM"
    model_type: str                   # "llama" | "qwen2" | "mistral"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None         # None for plain RoPE; else {"rope_type": ..., "factor": ..., ...}
    attention_bias: bool              # q/k/v carry a bias (always for qwen2); for llama o_proj too
    sliding_window: int | None        # None = full attention
    tie_word_embeddings: bool
    torch_dtype: str                  # "float32" | "bfloat16" | "float16"
    dtype_bytes: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    weight_bytes: int                 # sum of all tensor sizes in the safetensors files
    hidden_act: str = "silu"
    mlp_bias: bool = False
    moe: MoeSpec | None = None        # None: every layer's MLP is dense

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES.values())}"
            )
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings",
                     "weight_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.torch_dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported dtype {self.torch_dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
        if self.dtype_bytes != DTYPE_BYTES[self.torch_dtype]:
            raise ValueError(f"dtype_bytes {self.dtype_bytes} does not match dtype {self.torch_dtype}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if self.moe is not None and not set(self.moe.sparse_layers) <= set(range(self.num_layers)):
            raise ValueError(f"sparse layers {self.moe.sparse_layers} outside the model's {self.num_layers} layers")

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def num_params(self) -> int:
        return self.weight_bytes // self.dtype_bytes

    @property
    def num_active_params(self) -> int:
        """Weights one token reads: all of a dense model; a sparse one's unchosen experts left out."""
        if self.moe is None:
            return self.num_params
        idle = self.moe.num_experts - self.moe.top_k
        return self.num_params - len(self.moe.sparse_layers) * idle * self.moe.expert_params(self.hidden_size)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        root = _checkpoint_dir(path)
        config = _read_json(root / "config.json")
        gen_config = _read_json(root / "generation_config.json") if (root / "generation_config.json").is_file() else {}
        try:
            return _spec_from_config(root, config, gen_config)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            msg = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise CheckpointError(f"bad model checkpoint: {root} ({msg})") from None


def _checkpoint_dir(path: str | Path) -> Path:
    text = str(path)
    root = Path(text).expanduser()
    if not root.exists():
        if not text.startswith((".", "/", "~")) and _HUB_ID.match(text):
            raise CheckpointError(
                f"not a local directory: {text} looks like a Hugging Face hub id, but tokenmux loads "
                "local checkpoints only (offline); download it first and pass its directory"
            )
        raise CheckpointError(f"not a model checkpoint: {root} (no such directory)")
    if not root.is_dir():
        raise CheckpointError(f"not a model checkpoint: {root} (not a directory)")
    if not (root / "config.json").is_file():
        raise CheckpointError(f"not a model checkpoint: {root} (no config.json)")
    return root.resolve()


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"bad model checkpoint: cannot read {file} ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"bad model checkpoint: {file} is not a JSON object")
    return data


def _spec_from_config(root: Path, c: dict[str, Any], gen: dict[str, Any]) -> ModelSpec:
    model_type = c.get("model_type")
    archs = c.get("architectures") or []
    arch = archs[0] if archs else SUPPORTED_ARCHITECTURES.get(model_type, "")
    if arch not in SUPPORTED_ARCHITECTURES.values() or SUPPORTED_ARCHITECTURES.get(model_type) != arch:
        raise CheckpointError(
            f"unsupported model in {root}: architecture {arch or None!r}, model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES.values())}"
        )
    hidden_act = c.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise CheckpointError(f"unsupported model in {root}: hidden_act {hidden_act!r} (only silu)")

    num_heads = int(c["num_attention_heads"])
    hidden_size = int(c["hidden_size"])
    rope_theta, rope_scaling = _rope(c)
    weight_bytes, file_dtype = _safetensors_bytes(root)
    dtype = c.get("dtype") or c.get("torch_dtype") or file_dtype
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"unsupported dtype in {root}: {dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
    sliding_window = c.get("sliding_window")
    if model_type == "qwen2" and not c.get("use_sliding_window", False):
        sliding_window = None
    return ModelSpec(
        path=str(root),
        architecture=arch,
        model_type=model_type,
        num_layers=int(c["num_hidden_layers"]),
        hidden_size=hidden_size,
        intermediate_size=int(c["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=int(c.get("num_key_value_heads") or num_heads),
        head_dim=int(c.get("head_dim") or hidden_size // num_heads),
        vocab_size=int(c["vocab_size"]),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=True if model_type == "qwen2" else bool(c.get("attention_bias", False)),
        sliding_window=int(sliding_window) if sliding_window is not None else None,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        torch_dtype=dtype,
        dtype_bytes=DTYPE_BYTES[dtype],
        eos_token_ids=_token_ids(gen.get("eos_token_id", c.get("eos_token_id"))),
        bos_token_id=gen.get("bos_token_id", c.get("bos_token_id")),
        weight_bytes=weight_bytes,
        hidden_act=hidden_act,
        mlp_bias=bool(c.get("mlp_bias", False)),
        moe=_moe(root, model_type, c),
    )


def _moe(root: Path, model_type: str, c: dict[str, Any]) -> MoeSpec | None:
    """The sparse blocks of a MoE config (Mixtral: every layer; Qwen3-MoE: every
    `decoder_sparse_step`-th layer not in `mlp_only_layers`), None for a dense model."""
    if model_type == "mixtral":
        num_layers = int(c["num_hidden_layers"])
        return MoeSpec(
            num_experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
            intermediate_size=int(c["intermediate_size"]), norm_topk_prob=True, float32_weights=True,
            sparse_layers=tuple(range(num_layers)), stacked_experts=_stacked_experts(root),
        )
    return None


def _stacked_experts(root: Path) -> bool:
    """Whether the checkpoint stores its experts as 3-D tensors (`...experts.gate_up_proj`)."""
    return any(name.endswith(".experts.gate_up_proj")
               for file in _safetensors_files(root) for name in read_safetensors_header(file))


def _rope(c: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either `rope_parameters` (v5) or `rope_theta`/`rope_scaling` (v4)."""
    params = dict(c.get("rope_parameters") or {})
    legacy = dict(c.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", c.get("rope_theta", 10000.0)))
    scaling = params or legacy
    if "type" in scaling and "rope_type" not in scaling:  # older spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _safetensors_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"bad model checkpoint: {index} has no weight_map")
        files = [root / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"bad model checkpoint: {root} (missing shard {missing[0]})")
        return files
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"not a model checkpoint: {root} (no *.safetensors weights)")
    return files


def read_safetensors_header(file: Path) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"}, from the JSON header only."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"bad model checkpoint: cannot read safetensors header of {file} ({e})") from None
    header.pop("__metadata__", None)
    return header


def _safetensors_bytes(root: Path) -> tuple[int, str | None]:
    """(total tensor bytes, dtype of the first tensor) over all weight files."""
    total, dtype = 0, None
    for file in _safetensors_files(root):
        for info in read_safetensors_header(file).values():
            begin, end = info["data_offsets"]
            total += end - begin
            dtype = dtype or _SAFETENSORS_DTYPES.get(info["dtype"])
    if total == 0:
        raise CheckpointError(f"bad model checkpoint: {root} (safetensors files hold no tensors)")
    return total, dtype
