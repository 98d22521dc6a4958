"""Runs a Llama/Qwen2/Mistral checkpoint over the paged KV pool: one forward per step.

There is no prefill or decode phase here either: each `SeqChunk` brings the tokens of
one sequence that are not in the cache yet (a whole prompt, one decoded token, or the
rest of a prompt after a resume). The runner writes their K/V into the sequence's
blocks, attends over positions [0, start_pos + len) and returns the logits of each
chunk's last token. All chunks of a step go through the linear layers packed together
as one [T, hidden] matrix; attention runs batched over a [B, Tq] grid of sequences.

The weights are not ours: `params` holds views into a slot buffer owned by the weight
cache, used as they are (no copies, no fusing). What is derived once per model (RoPE
frequencies, parameter names) lives on the runner.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.layers import Rope, apply_rope, mlp, paged_attention, rms_norm
from actors.model_spec import ModelSpec
from scheduler.kv_blocks import BLOCK_SIZE

logger = logging.getLogger(__name__)


@dataclass
class SeqChunk:
    token_ids: list[int]   # the tokens to add: positions start_pos .. start_pos + len - 1
    start_pos: int         # tokens of this sequence already in the cache
    block_ids: list[int]   # the sequence's block table; block j holds positions 16j .. 16j+15


@dataclass
class _Step:
    """Index tensors of one forward, shared by every layer."""

    input_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    slot_slabs: torch.Tensor    # [T] slab of each new token's block
    slot_rows: torch.Tensor     # [T] row of each new token's K inside its slab (per-token view), layer 0
    block_slabs: torch.Tensor   # [2 * B * NB] slab of every sequence's blocks, K then V
    block_rows: torch.Tensor    # [2 * B * NB] K then V block rows inside their slabs, layer 0
    mask: torch.Tensor          # [B, 1, G * Tq, NB * 16] additive (0 or -inf)
    unwritten: torch.Tensor     # [U] flat (seq * NB * 16 + position) of gathered positions >= context length
    last_index: torch.Tensor    # [B] packed index of each chunk's last token
    batch_shape: tuple[int, int]
    token_index: tuple[torch.Tensor, torch.Tensor] | None


class ModelRunner:
    def __init__(self, spec: ModelSpec, device: torch.device | str):
        self.spec = spec
        self.device = torch.device(device)
        self.rope = Rope(spec, self.device)
        self.group = spec.num_heads // spec.num_kv_heads
        self.layer_names = [_layer_names(i, spec.attention_bias) for i in range(spec.num_layers)]
        self.lm_head_name = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"

    @torch.inference_mode()
    def forward(self, params: dict[str, torch.Tensor], chunks: list[SeqChunk], kv: torch.Tensor) -> torch.Tensor:
        """# -> [B, vocab] float32 logits of each chunk's last token."""
        spec = self.spec
        kv_tokens, kv_blocks = self._pool_views(kv)
        embed = params["model.embed_tokens.weight"]
        if kv.dtype != embed.dtype:
            raise ValueError(f"kv dtype {kv.dtype} differs from the weights' dtype {embed.dtype}")
        step = self._prepare(chunks, kv.shape[0], kv.shape[1], embed.dtype)
        x = F.embedding(step.input_ids, embed)  # [T, hidden]
        cos, sin = self.rope.cos_sin(step.positions, x.dtype)
        T, H, Hkv, D = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        for layer, names in enumerate(self.layer_names):
            h = rms_norm(x, params[names["input_norm"]], spec.rms_norm_eps)
            q = F.linear(h, params[names["q"]], _bias(params, names["q_bias"])).view(T, H, D)
            k = F.linear(h, params[names["k"]], _bias(params, names["k_bias"])).view(T, Hkv, D)
            v = F.linear(h, params[names["v"]], _bias(params, names["v_bias"]))  # [T, Hkv * D]
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            # Pool layout per block: [L, 2, 16, Hkv, D]; a layer's K rows start at 2*16*layer.
            k_rows = step.slot_rows + 2 * BLOCK_SIZE * layer
            kv_tokens.index_put_((step.slot_slabs, k_rows), k.view(T, Hkv * D))
            kv_tokens.index_put_((step.slot_slabs, k_rows + BLOCK_SIZE), v)
            attn = paged_attention(q, kv_blocks, (step.block_slabs, step.block_rows + 2 * layer), step.mask, step.unwritten,
                                   step.batch_shape, step.token_index)
            x = x + F.linear(attn, params[names["o"]])
            h = rms_norm(x, params[names["post_norm"]], spec.rms_norm_eps)
            x = x + mlp(h, params[names["gate"]], params[names["up"]], params[names["down"]])
        x = rms_norm(x[step.last_index], params["model.norm.weight"], spec.rms_norm_eps)
        return F.linear(x, params[self.lm_head_name]).float()

    def _pool_views(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool per slab: # [slabs, rows, one token's K or V] and # [slabs, rows, one block's K or V
        of one layer]. Slabs may be strided (a slab need not be a whole number of this shape's
        blocks), so rows are addressed as (slab, row inside the slab)."""
        spec = self.spec
        expected = (spec.num_layers, 2, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
        if kv.dim() != 7 or tuple(kv.shape[2:]) != expected:
            raise ValueError(f"kv must be [slabs, blocks_per_slab, {', '.join(map(str, expected))}], got {list(kv.shape)}")
        if not kv[0].is_contiguous():
            raise ValueError("kv must be a view of the pool whose slabs are contiguous")
        row = spec.num_kv_heads * spec.head_dim
        per_slab = kv.flatten(1)   # [slabs, blocks_per_slab * block elements], a view
        return per_slab.view(kv.shape[0], -1, row), per_slab.view(kv.shape[0], -1, BLOCK_SIZE * row)

    def _prepare(self, chunks: list[SeqChunk], num_slabs: int, blocks_per_slab: int,
                 params_dtype: torch.dtype) -> _Step:
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        L2 = self.spec.num_layers * 2
        num_blocks = num_slabs * blocks_per_slab
        input_ids, positions, slot_slabs, slot_rows, seq_of, offset_of, last_index, ctx_lens, tables = ([] for _ in range(9))
        for b, c in enumerate(chunks):
            n = len(c.token_ids)
            if n == 0:
                raise ValueError(f"chunk {b} has no tokens")
            if c.start_pos < 0:
                raise ValueError(f"chunk {b}: start_pos must be >= 0, got {c.start_pos}")
            ctx = c.start_pos + n
            need = -(-ctx // BLOCK_SIZE)
            if len(c.block_ids) < need:
                raise ValueError(f"chunk {b}: {ctx} positions need {need} blocks, got {len(c.block_ids)}")
            table = c.block_ids[:need]
            if min(table) < 0 or max(table) >= num_blocks:
                raise ValueError(f"chunk {b}: block ids must be in [0, {num_blocks}), got {table}")
            input_ids += c.token_ids
            pos = range(c.start_pos, ctx)
            positions += pos
            slot_slabs += [table[p // BLOCK_SIZE] // blocks_per_slab for p in pos]
            slot_rows += [table[p // BLOCK_SIZE] % blocks_per_slab * L2 * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            seq_of += [b] * n
            offset_of += range(n)
            last_index.append(len(input_ids) - 1)
            ctx_lens.append(ctx)
            tables.append(table)
        if min(input_ids) < 0 or max(input_ids) >= self.spec.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        B, T = len(chunks), len(input_ids)
        Tq = max(len(c.token_ids) for c in chunks)
        NB = max(len(t) for t in tables)
        # Short tables are padded with their own first block; the mask hides the padding.
        padded = [g for t in tables for g in t + [t[0]] * (NB - len(t))]
        block_slabs = [g // blocks_per_slab for g in padded]
        block_rows = [g % blocks_per_slab * L2 for g in padded]
        S = NB * BLOCK_SIZE
        unwritten = [b * S + p for b, ctx in enumerate(ctx_lens) for p in range(ctx, S)]
        ints = torch.tensor(
            input_ids + positions + slot_slabs + slot_rows + block_slabs + block_rows + last_index + seq_of + offset_of
            + [c.start_pos for c in chunks] + unwritten,
            dtype=torch.long,
        ).to(self.device, non_blocking=True)
        (input_ids_t, positions_t, slot_slabs_t, slot_rows_t, block_slabs_t, block_rows_t, last_t, seq_t, offset_t,
         start_t, unwritten_t) = ints.split([T, T, T, T, B * NB, B * NB, B, T, T, B, len(unwritten)])
        block_rows_t = torch.cat([block_rows_t, block_rows_t + 1])
        block_slabs_t = torch.cat([block_slabs_t, block_slabs_t])
        uniform = T == B * Tq
        return _Step(
            input_ids=input_ids_t,
            positions=positions_t,
            slot_slabs=slot_slabs_t,
            slot_rows=slot_rows_t,
            block_slabs=block_slabs_t,
            block_rows=block_rows_t,
            mask=self._mask(start_t, Tq, NB * BLOCK_SIZE, params_dtype),
            unwritten=unwritten_t,
            last_index=last_t,
            batch_shape=(B, Tq),
            token_index=None if uniform else (seq_t, offset_t),
        )

    def _mask(self, start: torch.Tensor, Tq: int, S: int, dtype: torch.dtype) -> torch.Tensor:
        """# [B, 1, G * Tq, S] additive: 0 where the key position <= the query position (and
        inside the sliding window), -inf elsewhere. Additive once per step rather than
        boolean, which attention would convert in every layer.

        Rows of padding queries (t >= chunk length) are computed and thrown away; they still
        see key 0, so softmax never divides by zero.
        """
        q_pos = start[:, None] + torch.arange(Tq, device=self.device)  # [B, Tq]
        k_pos = torch.arange(S, device=self.device)
        allowed = k_pos <= q_pos[:, :, None]  # [B, Tq, S]
        if self.spec.sliding_window is not None:
            allowed &= k_pos > q_pos[:, :, None] - self.spec.sliding_window
        B = start.shape[0]
        additive = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(~allowed, float("-inf"))
        return additive[:, None, None].expand(B, 1, self.group, Tq, S).reshape(B, 1, self.group * Tq, S)


def _bias(params: dict[str, torch.Tensor], name: str | None) -> torch.Tensor | None:
    return None if name is None else params[name]


def _layer_names(i: int, bias: bool) -> dict[str, str | None]:
    p = f"model.layers.{i}."
    return {
        "input_norm": p + "input_layernorm.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "q_bias": p + "self_attn.q_proj.bias" if bias else None,
        "k_bias": p + "self_attn.k_proj.bias" if bias else None,
        "v_bias": p + "self_attn.v_proj.bias" if bias else None,
        "gate": p + "mlp.gate_proj.weight",
        "up": p + "mlp.up_proj.weight",
        "down": p + "mlp.down_proj.weight",
    }
