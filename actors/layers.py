"""The torch pieces of a Llama-family decoder layer, written as plain functions.

The model runner owns no nn.Modules: weights are views into a slot buffer owned by the
weight cache, so every function here takes its weights as arguments. The arithmetic
follows transformers' Llama/Qwen2/Mistral modelling step for step (same dtype casts, same
order of operations) because greedy output must equal `model.generate` token for token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from actors.model_spec import ModelSpec

# RoPE types whose frequencies do not depend on the sequence length; the others
# ("dynamic", "longrope") rescale as a sequence grows, which transformers does with
# state carried across calls, so there is no fixed behaviour to match.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """# [T, H] -> [T, H]; normalised in float32, scaled in the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rope:
    """Rotary embedding of one model: inv_freq and attention scaling computed once."""

    def __init__(self, spec: ModelSpec, device: torch.device):
        rope_type = (spec.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(
                f"{spec.path}: unsupported rope_type {rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}"
            )
        if rope_type == "default":
            dim = spec.head_dim
            inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](_hf_rope_config(spec), torch.device("cpu"))
        self.inv_freq = inv_freq.float().to(device)  # [D/2]
        self.attention_scaling = float(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """# positions [T] -> cos, sin [T, D] in `dtype` (shared by all layers of one step)."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


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
    """# x [T, H, D], cos/sin [T, D] -> [T, H, D] (rotate-half convention)."""
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
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask)  # [B, Hkv, G*Tq, D]
    out = out.view(B, num_kv_heads, group, Tq, head_dim).permute(0, 3, 1, 2, 4).reshape(B, Tq, num_heads * head_dim)
    if token_index is None:
        return out.view(T, num_heads * head_dim)
    return out[token_index]
