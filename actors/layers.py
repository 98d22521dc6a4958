"""The torch pieces of a decoder layer of the supported families, written as plain functions.

The model runner owns no nn.Modules: weights are views into a slot buffer owned by the
weight cache, so every function here takes its weights as arguments. The arithmetic
follows transformers' modelling of each family (actors/model_families.py) step for step
(same dtype casts, same order of operations) because greedy output must equal
`model.generate` token for token.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from actors.model_spec import ModelSpec

# RoPE types whose frequencies follow from the positions of one forward. "longrope" picks
# its short or long factors by the forward's length (tokens cached + new), as transformers
# does per call; "dynamic" rescales with state carried across calls, so there is no fixed
# behaviour to match.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """# [T, H] -> [T, H]; normalised in float32, scaled in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def unit_offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm # [T, H] -> [T, H]: weight applied as (1 + w), all in float32, cast at the end."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


def activation(name: str):
    """The MLP's gate activation by transformers' name."""
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


def embed(ids: torch.Tensor, weight: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """# ids [T] -> [T, hidden]; Gemma scales by sqrt(hidden) rounded to the weights' dtype first."""
    x = F.embedding(ids, weight)
    if spec.family.embed_scale:
        x = x * torch.tensor(spec.hidden_size ** 0.5).to(weight.dtype)
    return x


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), in the logits' dtype, as transformers applies it; None: unchanged."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


class Rope:
    """Rotary embedding of one kind of layer: inv_freq and attention scaling computed once.
    `local` is Gemma 3's sliding layers: their own base, plain RoPE."""

    def __init__(self, spec: ModelSpec, device: torch.device, local: bool = False):
        scaling_params = None if local else spec.rope_scaling
        theta = spec.rope_local_theta if local else spec.rope_theta
        rope_type = (scaling_params or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"{spec.path}: unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self.long_inv_freq = None   # longrope's factors past the pretraining length
        if rope_type == "default":
            dim = spec.rotary_dim
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        elif rope_type == "longrope":
            inv_freq, long_inv_freq, scaling = _longrope(spec)
            self.long_inv_freq = long_inv_freq.to(device)
            self.original_max_positions = int(spec.rope_scaling["original_max_position_embeddings"])
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if spec.rotary_dim != spec.head_dim:
                raise ValueError(f"{spec.path}: rope_type {rope_type!r} with partial rotary is not supported")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](_hf_rope_config(spec), torch.device("cpu"))
        self.inv_freq = inv_freq.float().to(device)  # [rotary_dim / 2]
        self.attention_scaling = float(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """# positions [T] -> cos, sin [T, rotary_dim] in `dtype` (shared by the layers of one kind).
        long # [T] bool, longrope only: True where the token's forward runs past the pretraining length."""
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None and long is not None:
            inv_freq = torch.where(long[:, None], self.long_inv_freq, self.inv_freq)
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _longrope(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(short inv_freq, long inv_freq, attention factor) of LongRoPE, transformers' arithmetic: the
    factor defaults to max / original positions and the attention factor to
    sqrt(1 + ln(factor) / ln(original positions))."""
    p, dim = spec.rope_scaling, spec.rotary_dim
    original = int(p["original_max_position_embeddings"])
    for key in ("short_factor", "long_factor"):
        if len(p[key]) != dim // 2:
            raise ValueError(f"{spec.path}: longrope {key} has {len(p[key])} entries, need {dim // 2}")
    factor = p.get("factor") or spec.max_position_embeddings / original
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def inv_freq(factors) -> torch.Tensor:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * spec.rope_theta ** shape)

    return inv_freq(p["short_factor"]), inv_freq(p["long_factor"]), float(attention)


def _hf_rope_config(spec: ModelSpec):
    """A transformers config carrying just what the RoPE init functions read."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={**(spec.rope_scaling or {}), "rope_theta": spec.rope_theta},
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """# x [T, H, D], cos/sin [T, R] -> [T, H, D] (rotate-half convention over the first R <= D dims;
    the rest pass through, as partial rotary does)."""
    rotary = cos.shape[-1]
    if rotary != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def paged_attention(
    q: torch.Tensor,
    kv_windows: torch.Tensor,
    block_offsets: torch.Tensor,
    mask: torch.Tensor,
    unwritten: torch.Tensor,
    batch_shape: tuple[int, int],
    token_index: tuple[torch.Tensor, torch.Tensor] | None,
    num_kv_heads: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of the new tokens over each sequence's cached context.

    q             # [T, Hq, D] new tokens of all sequences, packed in chunk order
    kv_windows    # [pool elements - R + 1, R] window e = the R = 16 * Hkv * D pool elements from e on
    block_offsets # [2 * B * NB] where this layer's K blocks, then V blocks, of each sequence start
    mask          # [B, 1, G * Tq, NB * 16] additive: 0 = may attend (causal, window), -inf = not
    unwritten     # [U] flat (seq * NB * 16 + position) past each sequence's context, or bool [B, NB * 16]
                  True where written (static shape, for CUDA graphs): slots never written (a fresh or
                  reused pool) may hold NaN, which a -inf mask does not cancel
    batch_shape   (B, Tq): sequences and the longest chunk
    token_index   (seq, offset) of each packed token in the [B, Tq] grid; None when every
                  chunk has Tq tokens (decode), so packing is a plain view
    scale         softmax scale (None: 1 / sqrt(D))
    returns       # [T, Hq * D]
    """
    T, num_heads, head_dim = q.shape
    B, Tq = batch_shape
    ctx = kv_windows.index_select(0, block_offsets).view(2, B, -1, num_kv_heads, head_dim)  # our copy, not the pool
    if unwritten.dtype == torch.bool:
        ctx = torch.where(unwritten[None, :, :, None, None], ctx, 0.0)
    else:
        ctx.view(2, -1, num_kv_heads * head_dim).index_fill_(1, unwritten, 0.0)
    group = num_heads // num_kv_heads
    k = ctx[0].transpose(1, 2)  # [B, Hkv, S, D]
    v = ctx[1].transpose(1, 2)
    if token_index is None:
        qp = q.reshape(B, Tq, num_heads, head_dim)
    else:
        qp = q.new_zeros(B, Tq, num_heads, head_dim)
        qp[token_index] = q
    # Grouped-query attention without repeating K/V: the query heads sharing a KV head
    # become extra query rows of that head.
    qp = qp.view(B, Tq, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(B, num_kv_heads, group * Tq, head_dim)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, G*Tq, D]
    out = out.view(B, num_kv_heads, group, Tq, head_dim).permute(0, 3, 1, 2, 4).reshape(B, Tq, num_heads * head_dim)
    if token_index is None:
        return out.view(T, num_heads * head_dim)
    return out[token_index]
