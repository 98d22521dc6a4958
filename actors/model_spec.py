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

from actors.model_families import FAMILIES, FULL_ATTENTION, SLIDING_ATTENTION, SUPPORTED_ARCHITECTURES, Family
from scheduler.kv_blocks import KVShape

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
    model_type: str                   # a key of actors.model_families.FAMILIES ("llama", "qwen3", ...)
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
    attention_bias: bool              # q/k/v carry a bias (always for qwen2); o_proj too where the family says
    sliding_window: int | None        # the window of the sliding layers (None: every layer attends fully)
    tie_word_embeddings: bool
    torch_dtype: str                  # "float32" | "bfloat16" | "float16"
    dtype_bytes: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    weight_bytes: int                 # sum of all tensor sizes in the safetensors files
    hidden_act: str = "silu"
    mlp_bias: bool = False
    # per layer "full_attention" | "sliding_attention"; () = every layer sliding when there is
    # a window, else every layer full (filled in by __post_init__)
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None          # RoPE base of the sliding layers, when theirs differs (Gemma 3)
    query_pre_attn_scalar: float | None = None     # attention scale is this ** -0.5 (Gemma); None: head_dim ** -0.5
    final_logit_softcapping: float | None = None   # logits = cap * tanh(logits / cap) (Gemma)
    partial_rotary_factor: float = 1.0             # RoPE turns the first head_dim * this dims of each head
    moe: MoeSpec | None = None        # None: every layer's MLP is dense

    def __post_init__(self) -> None:
        family = FAMILIES.get(self.model_type)
        if family is None or family.architecture != self.architecture:
            raise ValueError(
                f"unsupported architecture {self.architecture!r} (model_type {self.model_type!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES.values())}"
            )
        if self.hidden_act not in family.activations:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not one of {self.architecture}'s "
                             f"({', '.join(family.activations)})")
        if not self.layer_types:
            kind = SLIDING_ATTENTION if self.sliding_window is not None else FULL_ATTENTION
            object.__setattr__(self, "layer_types", (kind,) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
            raise ValueError(f"layer_types must name {FULL_ATTENTION} or {SLIDING_ATTENTION} for each of the "
                             f"{self.num_layers} layers, got {list(self.layer_types)}")
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding_attention layers need a sliding_window")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must leave an even number "
                             f"of rotary dims in (0, head_dim]")
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
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer (None: full attention)."""
        return tuple(self.sliding_window if t == SLIDING_ATTENTION else None for t in self.layer_types)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

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
    family = FAMILIES[model_type]
    hidden_act = c.get("hidden_activation") or c.get("hidden_act") or family.activations[0]
    if hidden_act not in family.activations:
        raise CheckpointError(f"unsupported model in {root}: hidden_act {hidden_act!r} "
                              f"(supported for {arch}: {', '.join(family.activations)})")
    for unsupported in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if c.get(unsupported):
            raise CheckpointError(f"unsupported model in {root}: {unsupported} is set")

    num_heads = int(c["num_attention_heads"])
    hidden_size = int(c["hidden_size"])
    gemma = model_type == "gemma3_text"
    rope_theta, rope_scaling, rope_local_theta = _gemma3_rope(c) if gemma else (*_rope(c), None)
    partial_rotary_factor = 1.0
    if model_type == "phi3":
        rope_scaling, partial_rotary_factor = _phi3_rope(c, rope_scaling)
    weight_bytes, file_dtype = _safetensors_bytes(root)
    dtype = c.get("dtype") or c.get("torch_dtype") or file_dtype
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"unsupported dtype in {root}: {dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
    num_layers = int(c["num_hidden_layers"])
    sliding_window = c.get("sliding_window", 4096 if gemma else None)
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not c.get("use_sliding_window", False):
        sliding_window = None
    return ModelSpec(
        path=str(root),
        architecture=arch,
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=int(c["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=int(c.get("num_key_value_heads") or num_heads),
        head_dim=int(c.get("head_dim") or (256 if gemma else hidden_size // num_heads)),
        vocab_size=int(c["vocab_size"]),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=family.qkv_bias or bool(c.get("attention_bias", False)),
        sliding_window=int(sliding_window) if sliding_window is not None else None,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", gemma)),   # Gemma ties unless it says not
        torch_dtype=dtype,
        dtype_bytes=DTYPE_BYTES[dtype],
        eos_token_ids=_token_ids(gen.get("eos_token_id", c.get("eos_token_id"))),
        bos_token_id=gen.get("bos_token_id", c.get("bos_token_id")),
        weight_bytes=weight_bytes,
        hidden_act=hidden_act,
        mlp_bias=bool(c.get("mlp_bias", False)),
        layer_types=_layer_types(c, model_type, num_layers, sliding_window),
        rope_local_theta=rope_local_theta,
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)) if gemma else None,
        final_logit_softcapping=c.get("final_logit_softcapping"),
        partial_rotary_factor=partial_rotary_factor,
        moe=_moe(root, model_type, c),
    )


def _layer_types(c: dict[str, Any], model_type: str, num_layers: int, window: int | None) -> tuple[str, ...]:
    """Which layers slide, as transformers decides: the config's `layer_types` when it lists them,
    else Qwen's `max_window_layers` (layers from there on slide), Gemma 3's `sliding_window_pattern`
    (every pattern-th layer is global), or every layer sliding where a window is set."""
    if window is None:
        return (FULL_ATTENTION,) * num_layers
    if c.get("layer_types"):
        return tuple(c["layer_types"])
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        first = int(c.get("max_window_layers", 0))
        return tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))
    if model_type == "gemma3_text":
        pattern = int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6)))
        return tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers))
    return (SLIDING_ATTENTION,) * num_layers


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
    if model_type == "qwen3_moe":
        num_layers, step = int(c["num_hidden_layers"]), int(c.get("decoder_sparse_step", 1))
        dense = set(c.get("mlp_only_layers") or ())
        return MoeSpec(
            num_experts=int(c.get("num_experts") or c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
            intermediate_size=int(c["moe_intermediate_size"]), norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            float32_weights=False, stacked_experts=_stacked_experts(root),
            sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
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
    params.pop("partial_rotary_factor", None)
    scaling = params or legacy
    if "type" in scaling and "rope_type" not in scaling:  # older spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _gemma3_rope(c: dict[str, Any]) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta): v5 nests `rope_parameters` by layer type; v4 has
    `rope_theta` / `rope_scaling` for the global layers and `rope_local_base_freq` for the local ones."""
    params = c.get("rope_parameters") or {}
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        theta, scaling = _rope({"rope_parameters": params.get(FULL_ATTENTION) or {"rope_theta": 1e6}})
        local = params.get(SLIDING_ATTENTION) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"local layers' rope_type {local['rope_type']!r} (only default)")
        return theta, scaling, float(local.get("rope_theta", 10000.0))
    theta, scaling = _rope({"rope_theta": 1e6, **c})
    return theta, scaling, float(c.get("rope_local_base_freq", 10000.0))


def _phi3_rope(c: dict[str, Any], scaling: dict | None) -> tuple[dict | None, float]:
    """Phi-3's longrope (spelled "su" or "yarn" by older checkpoints, as transformers maps them) with the
    pretraining length from the top-level `original_max_position_embeddings`, which wins, as in
    transformers; and the partial rotary factor from either place."""
    factor = float((c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    if scaling is None:
        return None, factor
    scaling = dict(scaling)
    if scaling["rope_type"] in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling["rope_type"] == "longrope":
        scaling["original_max_position_embeddings"] = int(c.get(
            "original_max_position_embeddings",
            scaling.get("original_max_position_embeddings", c.get("max_position_embeddings", 4096))))
    return scaling, factor


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
