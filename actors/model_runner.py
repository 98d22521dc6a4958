"""Runs a checkpoint of a supported family (actors/model_families.py) over the paged KV pool:
one forward per step.

There is no prefill or decode phase here either: each `SeqChunk` brings the tokens of
one sequence that are not in the cache yet (a whole prompt, one decoded token, or the
rest of a prompt after a resume). The runner writes their K/V into the sequence's
blocks, attends over positions [0, start_pos + len) and returns the logits of each
chunk's last token. All chunks of a step go through the linear layers packed together
as one [T, hidden] matrix; attention runs batched over a [B, Tq] grid of sequences.

The weights are not ours: `params` holds views into a slot buffer owned by the weight
cache, used as they are (no copies at step time). Which tensors they are, and the
arithmetic of a layer over them, is the runner's `kernels` (actors/layer_kernels.py): the
reference (transformers' arithmetic, the checkpoint's own tensors) or the fast path
(fused, packed). What is derived once per model (RoPE frequencies, parameter names)
lives on the runner. On CUDA, decode steps replay captured graphs (actors/cuda_graphs.py),
applied in `forward` and nowhere else.

A rank of a tensor-parallel group (actors/tensor_parallel.py) runs its part of each layer:
its spec has its share of heads and intermediate rows, and `all_reduce` (the group's sum,
actors/tp_group.py) makes the attention output and the MLP output whole again, before
any norm or residual add reads them. On one device it is the identity.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from actors.cuda_graphs import DecodeGraphs
from actors.layer_kernels import EMBED, FINAL_NORM, make_kernels
from actors.layers import Rope
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
    k_rows: torch.Tensor        # [T] element offset in the pool of each new token's K row, layer 0
    block_offsets: torch.Tensor  # [2 * B * NB] element offset in the pool of every sequence's K then V
                                 # blocks, layer 0 (a layer's blocks start 2 * layer block rows later)
    mask: torch.Tensor | None   # [B, 1, G * Tq, NB * 16] additive (0 or -inf), full-attention layers
    window_mask: torch.Tensor | None  # the same with the sliding window, for sliding layers (None: no such layer)
    rope_long: torch.Tensor | None    # [T] bool, longrope: the token's forward runs past the pretraining length
    unwritten: torch.Tensor     # [U] flat (seq * NB * 16 + position) of gathered positions >= context length,
                                # or (CUDA graphs, static shape) bool [B, NB * 16]: True where written
    last_index: torch.Tensor    # [B] packed index of each chunk's last token
    ctx_lens: torch.Tensor      # [B] positions each sequence attends over after this step
    batch_shape: tuple[int, int]
    token_index: tuple[torch.Tensor, torch.Tensor] | None


class ModelRunner:
    def __init__(self, spec: ModelSpec, device: torch.device | str, kernels: str = "reference",
                 cuda_graphs: bool = False, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """all_reduce: a tensor-parallel rank's sum over its group # [T, hidden] -> [T, hidden]
        (None: one device, nothing to sum)."""
        if all_reduce is not None and cuda_graphs:
            raise ValueError("CUDA graphs of a tensor-parallel rank are not supported")
        self.spec = spec
        self.all_reduce = all_reduce or _whole
        self.device = torch.device(device)
        # one rotary embedding per kind of layer: Gemma 3's sliding layers have their own base
        global_rope = Rope(spec, self.device)
        local_rope = Rope(spec, self.device, local=True) if spec.rope_local_theta is not None else global_rope
        self.ropes = [global_rope] if local_rope is global_rope else [global_rope, local_rope]
        self.layer_rope = [self.ropes.index(local_rope if w is not None else global_rope) for w in spec.layer_windows]
        self.longrope = global_rope.long_inv_freq is not None
        self.group = spec.num_heads // spec.num_kv_heads
        self.kernels = make_kernels(kernels, spec, self.device)
        self.graphs = DecodeGraphs(self._forward_step, self.device) if cuda_graphs else None

    def recompute_from(self, start_pos: int, end_pos: int) -> int:
        """Where a forward over positions [start_pos, end_pos) of one sequence must start instead.

        Longrope (Phi-3) rotates with its short factors up to the pretraining length and its
        long ones past it, and transformers recomputes the whole cache with the long factors
        when a sequence first passes that length: the forward that crosses it starts at 0
        (its caller passes the sequence's tokens from there). Otherwise start_pos."""
        if self.longrope and 0 < start_pos <= self.ropes[0].original_max_positions < end_pos:
            return 0
        return start_pos

    @torch.inference_mode()
    def forward(self, params: dict[str, torch.Tensor], chunks: list[SeqChunk], kv: torch.Tensor) -> torch.Tensor:
        """# -> [B, vocab] float32 logits of each chunk's last token."""
        embed = params[EMBED]
        if kv.dtype != embed.dtype:
            raise ValueError(f"kv dtype {kv.dtype} differs from the weights' dtype {embed.dtype}")
        bucket = self.graphs.bucket(chunks) if self.graphs is not None else None   # None: run eagerly
        step = self._prepare(chunks, kv, embed.dtype, bucket)
        if bucket is None:
            return self._forward_step(params, step, kv)
        return self.graphs.replay(params, step, kv, bucket)[:len(chunks)]

    def _forward_step(self, params: dict[str, torch.Tensor], step: _Step, kv: torch.Tensor) -> torch.Tensor:
        """The forward over prepared index tensors (what a CUDA graph captures)."""
        spec, kernels = self.spec, self.kernels
        kv_tokens, kv_windows, kv_flat = self._pool_views(kv)
        x = kernels.embed(params, step.input_ids)  # [T, hidden]
        cos_sin = [rope.cos_sin(step.positions, x.dtype, step.rope_long) for rope in self.ropes]
        block_row = BLOCK_SIZE * spec.num_kv_heads * spec.head_dim   # elements of one layer's K (or V) of one block
        layers = kernels.names
        h = kernels.norm(x, params[layers[0].input_norm])
        for layer, names in enumerate(layers):
            cos, sin = cos_sin[self.layer_rope[layer]]
            # q [T, H, D]; this layer's k and v of the new tokens are in the pool after this
            q = kernels.qkv_cached(params, names, h, cos, sin, kv_tokens, kv_flat, step, layer)
            attn = kernels.attention(q, kv_windows, kv_flat, step, step.block_offsets + 2 * layer * block_row, layer)
            out = self.all_reduce(kernels.o(params, names, attn))
            if names.attn_out_norm is not None:
                out = kernels.norm(out, params[names.attn_out_norm])
            x, h = kernels.add_norm(x, out, params[names.mlp_norm])
            delta = self.all_reduce(kernels.mlp(params, names, h))
            if names.mlp_out_norm is not None:
                delta = kernels.norm(delta, params[names.mlp_out_norm])
            if layer + 1 < len(layers):
                x, h = kernels.add_norm(x, delta, params[layers[layer + 1].input_norm])
            else:
                x = x + delta
        x = kernels.norm(x[step.last_index], params[FINAL_NORM])
        return kernels.lm_head(params, x)

    def _pool_views(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pool as # [slabs, rows, one token's K or V] (rows addressed as (slab, row inside
        the slab): a slab need not be a whole number of this shape's blocks), and as
        overlapping windows # [elements - R + 1, R] where window e is the R = 16 * Hkv * D
        elements from element e on: one layer's K or V of the block starting there. Gathering
        windows by element offset is one `index_select` (a row copy each), several times
        faster than advanced indexing by (slab, row), and needs no regular row grid. Third:
        the same elements as one flat tensor, for kernels that take element offsets."""
        self._check_pool(kv)
        row = self.spec.num_kv_heads * self.spec.head_dim
        per_slab = kv.flatten(1)   # [slabs, blocks_per_slab * block elements], a view
        window = BLOCK_SIZE * row
        num_elements = (kv.shape[0] - 1) * kv.stride(0) + per_slab.shape[1]
        windows = kv.as_strided((num_elements - window + 1, window), (1, 1), kv.storage_offset())
        flat = kv.as_strided((num_elements,), (1,), kv.storage_offset())
        return per_slab.view(kv.shape[0], -1, row), windows, flat

    def _check_pool(self, kv: torch.Tensor) -> None:
        spec = self.spec
        expected = (spec.num_layers, 2, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
        if kv.dim() != 7 or tuple(kv.shape[2:]) != expected:
            raise ValueError(f"kv must be [slabs, blocks_per_slab, {', '.join(map(str, expected))}], got {list(kv.shape)}")
        if not kv[0].is_contiguous():
            raise ValueError("kv must be a view of the pool whose slabs are contiguous")

    def _prepare(self, chunks: list[SeqChunk], kv: torch.Tensor, params_dtype: torch.dtype,
                 bucket: tuple[int, int] | None = None) -> _Step:
        """Index tensors of one forward. With a (batch, blocks) bucket (CUDA graphs) the step is
        padded to that static shape: extra sequences repeat the last one (same token, same
        position, same KV slot, so their writes are the same values), extra blocks repeat a
        table's first block, and unwritten positions are a mask rather than a list."""
        if not chunks:
            raise ValueError("forward needs at least one chunk")
        num_slabs, blocks_per_slab, slab_stride = kv.shape[0], kv.shape[1], kv.stride(0)
        L2 = self.spec.num_layers * 2
        block_row = BLOCK_SIZE * self.spec.num_kv_heads * self.spec.head_dim   # elements of one layer's K of a block
        num_blocks = num_slabs * blocks_per_slab
        input_ids, positions, slot_slabs, slot_rows, seq_of, offset_of, last_index, ctx_lens, tables, longs = (
            [] for _ in range(10))
        long_after = self.ropes[0].original_max_positions if self.longrope else None
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
            # longrope's factors follow the forward's length, as transformers picks them per call
            longs += [int(long_after is not None and ctx > long_after)] * n
            last_index.append(len(input_ids) - 1)
            ctx_lens.append(ctx)
            tables.append(table)
        if min(input_ids) < 0 or max(input_ids) >= self.spec.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        NB = max(len(t) for t in tables)
        if bucket is not None:
            pad = bucket[0] - len(chunks)
            for values in (input_ids, positions, slot_slabs, slot_rows, ctx_lens, tables, longs):
                values += values[-1:] * pad
            seq_of += range(len(chunks), bucket[0])
            offset_of += [0] * pad
            last_index += range(len(chunks), bucket[0])
            NB = bucket[1]
        B, T = len(tables), len(input_ids)
        Tq = max(len(c.token_ids) for c in chunks)
        # Short tables are padded with their own first block; the mask hides the padding.
        padded = [g for t in tables for g in t + [t[0]] * (NB - len(t))]
        block_offsets = [g // blocks_per_slab * slab_stride + g % blocks_per_slab * L2 * block_row for g in padded]
        S = NB * BLOCK_SIZE
        unwritten = [] if bucket else [b * S + p for b, ctx in enumerate(ctx_lens) for p in range(ctx, S)]
        starts = [ctx - Tq for ctx in ctx_lens] if bucket else [c.start_pos for c in chunks]
        row = self.spec.num_kv_heads * self.spec.head_dim
        k_rows = [s * slab_stride + r * row for s, r in zip(slot_slabs, slot_rows)]
        ints = torch.tensor(
            input_ids + positions + slot_slabs + slot_rows + k_rows + block_offsets + last_index + seq_of + offset_of
            + starts + ctx_lens + longs + unwritten,
            dtype=torch.long,
        ).to(self.device, non_blocking=True)
        (input_ids_t, positions_t, slot_slabs_t, slot_rows_t, k_rows_t, block_offsets_t, last_t, seq_t, offset_t,
         start_t, ctx_t, long_t, unwritten_t) = ints.split([T, T, T, T, T, B * NB, B, T, T, B, B, T, len(unwritten)])
        if bucket:
            unwritten_t = torch.arange(S, device=self.device) < ctx_t[:, None]   # [B, S] True where written
        uniform = T == B * Tq
        windows = set(self.spec.layer_windows)
        return _Step(
            input_ids=input_ids_t,
            positions=positions_t,
            slot_slabs=slot_slabs_t,
            slot_rows=slot_rows_t,
            k_rows=k_rows_t,
            block_offsets=torch.cat([block_offsets_t, block_offsets_t + block_row]),   # K blocks, then V blocks
            mask=self._mask(start_t, Tq, S, params_dtype, None) if None in windows else None,
            window_mask=self._mask(start_t, Tq, S, params_dtype, self.spec.sliding_window) if windows - {None} else None,
            rope_long=long_t.bool() if self.longrope else None,
            unwritten=unwritten_t,
            last_index=last_t,
            ctx_lens=ctx_t,
            batch_shape=(B, Tq),
            token_index=None if uniform else (seq_t, offset_t),
        )

    def _mask(self, start: torch.Tensor, Tq: int, S: int, dtype: torch.dtype, window: int | None) -> torch.Tensor:
        """# [B, 1, G * Tq, S] additive: 0 where the key position <= the query position (and
        inside the sliding window), -inf elsewhere. Additive once per step rather than
        boolean, which attention would convert in every layer.

        Rows of padding queries (t >= chunk length) are computed and thrown away; they still
        see key 0, so softmax never divides by zero.
        """
        q_pos = start[:, None] + torch.arange(Tq, device=self.device)  # [B, Tq]
        k_pos = torch.arange(S, device=self.device)
        allowed = k_pos <= q_pos[:, :, None]  # [B, Tq, S]
        if window is not None:
            allowed &= k_pos > q_pos[:, :, None] - window
        B = start.shape[0]
        additive = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(~allowed, float("-inf"))
        # repeat, not expand: with Tq = 1 an expanded view stays a view with stride 0 over the
        # groups, and a CUDA graph's static mask must own its elements (copy_ into it)
        return additive[:, None].repeat(1, self.group, 1, 1).reshape(B, 1, self.group * Tq, S)


def _whole(x: torch.Tensor) -> torch.Tensor:
    """One device's all-reduce: its output is already the whole sum."""
    return x
