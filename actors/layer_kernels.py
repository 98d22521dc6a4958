"""The weights one forward reads, by name, and the arithmetic of a layer over them.

Two real implementations, chosen once per model (EngineConfig.kernels):

- `ReferenceKernels`: the checkpoint's tensors under their own names, one `F.linear` per
  projection, the arithmetic of transformers step for step (same casts, same order).
  Greedy output equals `generate()` token for token; the oracle tests run this.
- `FastKernels`: q/k/v fused into one `[(H + 2 Hkv) * D, hidden]` matrix and gate/up into
  one `[2 I, hidden]` (4 matmuls a layer instead of 7), RoPE applied to q and k in one
  pass, fused RMSNorm. The weight layout (`fast_plan`) builds the fused matrices when
  the host cache is filled and, on CPU, packs every matrix of at least
  `PACK_MIN_ELEMENTS` (actors/packed_linear.py: our blocked fp32 kernel, or oneDNN);
  smaller ones stay plain because a packed call's fixed cost (~15 us for oneDNN) costs
  more than it saves there. Each weight's form
  picks its kernel (`linear`), so nothing downstream asks which path runs. Checked
  against the reference the way kernel libraries are: logits within 1e-4 relative,
  greedy divergence only at near ties (tests/test_fast_path.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors import moe, packed_linear, paged_attention_cpu
from actors.layers import activation, apply_rope, embed, paged_attention, rms_norm, softcap, unit_offset_rms_norm
from actors.model_spec import ModelSpec
from actors.weight_layout import PlannedTensor
from scheduler.kv_blocks import BLOCK_SIZE

PACK_MIN_ELEMENTS = 1 << 19   # measured on AVX-512: below ~0.5M weights oneDNN's call overhead wins


@dataclass(frozen=True)
class LayerNames:
    """Parameter names of one decoder layer (None: the checkpoint has no such tensor)."""

    input_norm: str
    mlp_norm: str                    # the norm in front of the MLP
    q: str | None                    # None where the checkpoint stores q/k/v fused (Phi-3)
    k: str | None
    v: str | None
    o: str
    gate: str | None                 # None where the checkpoint stores gate/up fused (Phi-3)
    up: str | None
    down: str
    qkv: str
    gate_up: str
    q_bias: str | None = None
    k_bias: str | None = None
    v_bias: str | None = None
    o_bias: str | None = None
    gate_bias: str | None = None
    up_bias: str | None = None
    down_bias: str | None = None
    qkv_bias: str | None = None
    gate_up_bias: str | None = None
    q_norm: str | None = None        # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    k_norm: str | None = None
    attn_out_norm: str | None = None  # norm of the attention output before the residual add (Gemma 3)
    mlp_out_norm: str | None = None   # norm of the MLP output before the residual add (Gemma 3)
    moe: moe.MoeNames | None = None   # a sparse layer's MoE block (actors/moe.py) in place of gate/up/down


def layer_names(spec: ModelSpec, i: int) -> LayerNames:
    family = spec.family
    p, attn, mlp = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    qkv_bias = spec.attention_bias                       # qwen2 always; the others when configured
    o_bias = spec.attention_bias and family.o_bias       # qwen2's always-on q/k/v bias leaves o_proj out
    mlp_bias = spec.mlp_bias
    split = not family.fused_checkpoint
    sandwich = family.sandwich_norms
    return LayerNames(
        input_norm=p + "input_layernorm.weight",
        mlp_norm=p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight"),
        q=attn + "q_proj.weight" if split else None, k=attn + "k_proj.weight" if split else None,
        v=attn + "v_proj.weight" if split else None, o=attn + "o_proj.weight",
        gate=mlp + "gate_proj.weight" if split else None, up=mlp + "up_proj.weight" if split else None,
        down=mlp + "down_proj.weight", qkv=attn + "qkv_proj.weight", gate_up=mlp + "gate_up_proj.weight",
        q_bias=attn + "q_proj.bias" if qkv_bias else None, k_bias=attn + "k_proj.bias" if qkv_bias else None,
        v_bias=attn + "v_proj.bias" if qkv_bias else None, o_bias=attn + "o_proj.bias" if o_bias else None,
        gate_bias=mlp + "gate_proj.bias" if mlp_bias else None, up_bias=mlp + "up_proj.bias" if mlp_bias else None,
        down_bias=mlp + "down_proj.bias" if mlp_bias else None,
        qkv_bias=attn + "qkv_proj.bias" if qkv_bias else None,
        gate_up_bias=mlp + "gate_up_proj.bias" if mlp_bias else None,
        q_norm=attn + "q_norm.weight" if family.qk_norm else None,
        k_norm=attn + "k_norm.weight" if family.qk_norm else None,
        attn_out_norm=p + "post_attention_layernorm.weight" if sandwich else None,
        mlp_out_norm=p + "post_feedforward_layernorm.weight" if sandwich else None,
        moe=moe.moe_names(spec.model_type, spec.moe, i) if spec.moe is not None else None,
    )


LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"


def fast_plan(spec: ModelSpec, pack: bool) -> tuple[PlannedTensor, ...]:
    """Every tensor of the fast layout and the checkpoint tensors it is made of. With tied
    embeddings the lm_head is a second copy of the embedding: packed for the matmul, while
    the lookup reads the plain one (a small tied head is just the embedding)."""
    def big(*shapes: tuple[int, int]) -> bool:
        return pack and sum(s[0] for s in shapes) * shapes[0][1] >= PACK_MIN_ELEMENTS

    H, Hkv, D, I, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size, spec.hidden_size
    plan = [PlannedTensor(EMBED, (EMBED,))]
    if not spec.tie_word_embeddings or big((spec.vocab_size, hidden)):
        plan.append(PlannedTensor(LM_HEAD, (EMBED if spec.tie_word_embeddings else LM_HEAD,),
                                  big((spec.vocab_size, hidden))))
    for i in range(spec.num_layers):
        n = layer_names(spec, i)
        plan += [PlannedTensor(norm, (norm,)) for norm in
                 (n.input_norm, n.mlp_norm, n.q_norm, n.k_norm, n.attn_out_norm, n.mlp_out_norm) if norm]
        plan += [PlannedTensor(n.qkv, (n.q, n.k, n.v) if n.q else (n.qkv,), big(((H + 2 * Hkv) * D, hidden))),
                 PlannedTensor(n.o, (n.o,), big((hidden, H * D)))]
        if n.moe is not None:   # a sparse layer: its experts, packed one by one (CPU) or stacked
            plan += moe.fast_plan(n.moe, hidden, stack=not pack, big=big)
            continue
        plan += [PlannedTensor(n.gate_up, (n.gate, n.up) if n.gate else (n.gate_up,), big((2 * I, hidden))),
                 PlannedTensor(n.down, (n.down,), big((hidden, I)))]
        plan += [PlannedTensor(fused, parts) for fused, parts in
                 ((n.qkv_bias, (n.q_bias, n.k_bias, n.v_bias)), (n.o_bias, (n.o_bias,)),
                  (n.gate_up_bias, (n.gate_bias, n.up_bias)), (n.down_bias, (n.down_bias,))) if fused]
    plan.append(PlannedTensor(FINAL_NORM, (FINAL_NORM,)))
    return tuple(plan)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """# x [T, in] -> [T, out]: the packed kernel for a packed weight, F.linear (MKL / cuBLAS) otherwise."""
    if packed_linear.is_packed(weight):
        return packed_linear.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class LayerKernels(ABC):
    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.names = [layer_names(spec, i) for i in range(spec.num_layers)]
        self.windows = spec.layer_windows                    # per layer: sliding window or None
        self.act = activation(spec.hidden_act)
        # None keeps SDPA's own 1 / sqrt(D), as transformers passes it for these families
        self.scale = spec.attention_scale if spec.query_pre_attn_scalar is not None else None
        self.family_norm = unit_offset_rms_norm if spec.family.unit_offset_norm else rms_norm

    @abstractmethod
    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm # [T, hidden] -> [T, hidden]."""

    @abstractmethod
    def qkv(self, p: dict, n: LayerNames, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """# h [T, hidden] -> q [T, H, D], k [T, Hkv, D] (rotated), v [T, Hkv * D]."""

    @abstractmethod
    def mlp(self, p: dict, n: LayerNames, h: torch.Tensor) -> torch.Tensor:
        """Gated MLP # [T, hidden] -> [T, hidden]."""

    def embed(self, p: dict, input_ids: torch.Tensor) -> torch.Tensor:
        """# [T] -> [T, hidden] (scaled where the family scales)."""
        return embed(input_ids, p[EMBED], self.spec)

    def rotate_qk(self, p: dict, n: LayerNames, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] -> each head RMS-normed where the family does (Qwen3, Gemma 3), then RoPE."""
        if n.q_norm is not None:
            eps = self.spec.rms_norm_eps
            q, k = self.family_norm(q, p[n.q_norm], eps), self.family_norm(k, p[n.k_norm], eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the next norm # x, delta [T, hidden] -> x + delta, norm(x + delta)."""
        x = x + delta
        return x, self.norm(x, weight)

    def qkv_cached(self, p: dict, n: LayerNames, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_tokens: torch.Tensor, kv_flat: torch.Tensor, step, layer: int):
        """`qkv`, with each new token's k and v written into its pool row -> q [T, H, D], v."""
        q, k, v = self.qkv(p, n, h, cos, sin)
        T = h.shape[0]
        # Pool layout per block: [L, 2, 16, Hkv, D]; a layer's K rows start at 2*16*layer.
        k_rows = step.slot_rows + 2 * BLOCK_SIZE * layer
        kv_tokens.index_put_((step.slot_slabs, k_rows), k.reshape(T, -1))
        kv_tokens.index_put_((step.slot_slabs, k_rows + BLOCK_SIZE), v)
        return q

    def attention(self, q: torch.Tensor, kv_windows: torch.Tensor, kv_flat: torch.Tensor, step,
                  block_offsets: torch.Tensor, layer: int) -> torch.Tensor:
        """# q [T, H, D] over this layer's cached K/V -> [T, H * D] (see layers.paged_attention)."""
        mask = step.window_mask if self.windows[layer] is not None else step.mask
        return paged_attention(q, kv_windows, block_offsets, mask, step.unwritten, step.batch_shape,
                               step.token_index, self.spec.num_kv_heads, self.scale)

    def o(self, p: dict, n: LayerNames, attn: torch.Tensor) -> torch.Tensor:
        """# [T, H * D] -> [T, hidden]."""
        return linear(attn, p[n.o], _get(p, n.o_bias))

    def lm_head(self, p: dict, x: torch.Tensor) -> torch.Tensor:
        """# [B, hidden] -> [B, vocab] float32 (softcapped in the weights' dtype where the config says)."""
        weight = p[EMBED] if self.spec.tie_word_embeddings and LM_HEAD not in p else p[LM_HEAD]
        return softcap(linear(x, weight), self.spec.final_logit_softcapping).float()


class ReferenceKernels(LayerKernels):
    def norm(self, x, weight):
        return self.family_norm(x, weight, self.spec.rms_norm_eps)

    def qkv(self, p, n, h, cos, sin):
        T, H, Hkv, D = h.shape[0], self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        if n.q is None:   # stored fused: one projection, sliced, as transformers runs it
            q, k, v = F.linear(h, p[n.qkv], _get(p, n.qkv_bias)).split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q = F.linear(h, p[n.q], _get(p, n.q_bias))
            k = F.linear(h, p[n.k], _get(p, n.k_bias))
            v = F.linear(h, p[n.v], _get(p, n.v_bias))
        q, k = self.rotate_qk(p, n, q.view(T, H, D), k.view(T, Hkv, D), cos, sin)
        return q, k, v

    def mlp(self, p, n, h):
        if n.moe is not None:   # transformers' grouped experts over the checkpoint's own tensors
            routing = moe.route(h, p[n.moe.router], self.spec.moe)
            return moe.grouped_experts(h, routing, lambda e, x: moe.swiglu(x, *n.moe.checkpoint_expert(p, e)))
        if n.gate is None:
            gate, up = F.linear(h, p[n.gate_up], _get(p, n.gate_up_bias)).chunk(2, dim=-1)
        else:
            gate, up = F.linear(h, p[n.gate], _get(p, n.gate_bias)), F.linear(h, p[n.up], _get(p, n.up_bias))
        return F.linear(self.act(gate) * up, p[n.down], _get(p, n.down_bias))


class FastKernels(LayerKernels):
    def __init__(self, spec: ModelSpec, device: torch.device):
        super().__init__(spec)
        # on CPU: the C++ kernels (built on first use) when they build -- decode attention over
        # the pool and the fused elementwise ops (actors/fused_ops_cpu.cpp)
        self.decode_kernel = device.type == "cpu" and paged_attention_cpu.available()
        # the fused norm is Llama's w * x; Gemma's (1 + w) in float32 runs as the reference does
        self.fused = self.decode_kernel and not spec.family.unit_offset_norm
        # one-pass RoPE + KV write: full rotary, no per-head norm in between
        self.fused_rope = self.fused and not spec.family.qk_norm and spec.rotary_dim == spec.head_dim
        self.eps = spec.rms_norm_eps

    def attention(self, q, kv_windows, kv_flat, step, block_offsets, layer):
        B, Tq = step.batch_shape
        if not self.decode_kernel or Tq != 1 or step.unwritten.dtype == torch.bool:
            return super().attention(q, kv_windows, kv_flat, step, block_offsets, layer)
        k_offsets = block_offsets[:block_offsets.shape[0] // 2].view(B, -1)   # [B, NB] K blocks (V follows each)
        return paged_attention_cpu.decode_attention(q, kv_flat, k_offsets, step.ctx_lens, self.spec.num_kv_heads,
                                                    self.windows[layer], self.spec.attention_scale)

    def norm(self, x, weight):
        if self.fused:
            return torch.ops.tokenmux.rms_norm(x, weight, self.eps)
        if self.spec.family.unit_offset_norm:
            return unit_offset_rms_norm(x, weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def add_norm(self, x, delta, weight):
        if self.fused:   # x += delta in place: x is this forward's own residual stream
            return x, torch.ops.tokenmux.add_rms_norm_(x, delta, weight, self.eps)
        return super().add_norm(x, delta, weight)

    def qkv(self, p, n, h, cos, sin):
        T, H, Hkv, D = h.shape[0], self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        qkv = linear(h, p[n.qkv], _get(p, n.qkv_bias))          # [T, (H + 2 Hkv) * D]
        v = qkv[:, (H + Hkv) * D:]
        if n.q_norm is not None:
            q, k = self.rotate_qk(p, n, qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D),
                                  cos, sin)
            return q, k, v
        qk = apply_rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), cos, sin)   # q and k heads in one pass
        return qk[:, :H], qk[:, H:], v

    def qkv_cached(self, p, n, h, cos, sin, kv_tokens, kv_flat, step, layer):
        if not self.fused_rope:
            return super().qkv_cached(p, n, h, cos, sin, kv_tokens, kv_flat, step, layer)
        T, H, Hkv, D = h.shape[0], self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        qkv = linear(h, p[n.qkv], _get(p, n.qkv_bias))          # [T, (H + 2 Hkv) * D]
        # RoPE on q and k in place, k and v copied to their pool rows: one pass
        torch.ops.tokenmux.rope_write_kv_(qkv, cos, sin, kv_flat, step.k_rows, 2 * layer * BLOCK_SIZE * Hkv * D, H, Hkv)
        return qkv[:, :H * D].view(T, H, D)

    def mlp(self, p, n, h):
        if n.moe is not None:
            return self.sparse_mlp(p, n.moe, h)
        gate, up = linear(h, p[n.gate_up], _get(p, n.gate_up_bias)).chunk(2, dim=-1)   # [T, I] each
        return linear(self.act(gate).mul_(up), p[n.down], _get(p, n.down_bias))

    def sparse_mlp(self, p, n: moe.MoeNames, h):
        """The MoE block over the fast layout: torch's grouped GEMM over stacked experts on
        CUDA, else one fused gate/up and one down per expert that has tokens."""
        routing = moe.route(h, p[n.router], self.spec.moe)
        E, I, hidden = n.num_experts, n.intermediate_size, h.shape[1]
        stacked_gate_up, stacked_down = n.fast_stacked
        if stacked_gate_up in p:
            gate_up, down = p[stacked_gate_up].view(E, 2 * I, hidden), p[stacked_down].view(E, hidden, I)
            if h.device.type == "cuda" and moe.grouped_mm_runs(h, gate_up):
                return moe.grouped_mm_experts(h, routing, gate_up, down)
            weights = lambda e: (gate_up[e], down[e])   # noqa: E731
        else:
            weights = lambda e: tuple(p[name] for name in n.fast_expert(e))   # noqa: E731

        def expert(e: int, x: torch.Tensor) -> torch.Tensor:
            gate_up_e, down_e = weights(e)
            gate, up = linear(x, gate_up_e).chunk(2, dim=-1)   # [n, I] each
            return linear(F.silu(gate).mul_(up), down_e)
        return moe.grouped_experts(h, routing, expert)


def make_kernels(kind: str, spec: ModelSpec, device: torch.device) -> LayerKernels:
    if kind == "reference":
        return ReferenceKernels(spec)
    if kind == "fast":
        return FastKernels(spec, device)
    raise ValueError(f"kernels must be 'reference' or 'fast', got {kind!r}")


def _get(p: dict, name: str | None) -> torch.Tensor | None:
    return None if name is None else p[name]
