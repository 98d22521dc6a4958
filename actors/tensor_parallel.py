"""Tensor parallelism of one model: what rank r of a group of N holds, Megatron style.

Each decoder layer is split so that one all-reduce (sum) after attention and one after the
MLP give every rank the full hidden state again:

- q/k/v are split by heads (column split: rows of each weight, bias alike). A rank keeps
  Hkv / N KV heads and the H / N query heads that read them (grouped-query attention groups
  stay whole), so its KV cache holds only its own heads.
- o_proj is split by its input columns (row split): each rank's product is a partial sum
  of the output; the all-reduce adds them. Its bias lives on rank 0 alone (zeros on the
  others), so the sum counts it once.
- gate/up are column-split by intermediate rows, down_proj row-split like o_proj.
- Embeddings, norms, q/k norms (per head: every head's are the same) and lm_head are
  replicated: every rank computes the same logits and no vocabulary gather is needed. That
  costs each rank a full copy of the two largest tensors of a small model; a vocabulary
  split is not done.

Not split (refused with a ValueError): heads, KV heads or the intermediate size that N does
not divide, sparse MoE layers, and checkpoints that store q/k/v fused (Phi-3).
A rank's `ModelSpec` is the checkpoint's with H / N heads, Hkv / N KV heads and I / N
intermediate rows: the model runner and the KV pool then work on a rank as on a model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from actors.layer_kernels import layer_names
from actors.model_spec import ModelSpec
from actors.weight_layout import PlannedTensor, TensorCut

COLUMN, ROW = 0, 1   # the cut dim of a [out, in] weight: its output rows, or its input columns


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of a tensor-parallel group of `size` ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor-parallel size must be a positive int, got {self.size!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    def check(self, spec: ModelSpec) -> None:
        """Raise ValueError naming why `spec` does not split in `size` parts."""
        if self.size == 1:
            return
        for what, n in (("attention heads", spec.num_heads), ("KV heads", spec.num_kv_heads),
                        ("intermediate size", spec.intermediate_size)):
            if n % self.size:
                raise ValueError(f"{spec.path}: {what} ({n}) do not divide by tensor_parallel {self.size}")
        if spec.moe is not None:
            raise ValueError(f"{spec.path}: tensor parallelism of sparse MoE layers is not supported")
        if spec.family.fused_checkpoint:
            raise ValueError(f"{spec.path}: tensor parallelism of a checkpoint with fused q/k/v "
                             f"({spec.architecture}) is not supported")

    def spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec this rank runs: its share of heads, KV heads and intermediate rows."""
        self.check(spec)
        if self.size == 1:
            return spec
        return dataclasses.replace(spec, num_heads=spec.num_heads // self.size,
                                   num_kv_heads=spec.num_kv_heads // self.size,
                                   intermediate_size=spec.intermediate_size // self.size)

    def plan(self, spec: ModelSpec, plan: tuple[PlannedTensor, ...]) -> tuple[PlannedTensor, ...]:
        """`plan` (the checkpoint's, or the fast path's fused one) with this rank's cut on
        every tensor that is split; the others stay whole."""
        self.check(spec)
        if self.size == 1:
            return plan
        cuts = self._cuts(spec)
        return tuple(dataclasses.replace(t, cut=cuts.get(t.name)) for t in plan)

    def _cuts(self, spec: ModelSpec) -> dict[str, TensorCut]:
        column, row = TensorCut(self.rank, self.size, COLUMN), TensorCut(self.rank, self.size, ROW)
        first_rank = TensorCut(self.rank, self.size, None)
        cuts: dict[str, TensorCut] = {}
        for i in range(spec.num_layers):
            n = layer_names(spec, i)
            # fused names (qkv, gate_up) are the fast path's: their sources are the split q, k, v
            # (gate, up) tensors, each cut before they are concatenated
            for name in (n.q, n.k, n.v, n.qkv, n.gate, n.up, n.gate_up, n.q_bias, n.k_bias, n.v_bias, n.qkv_bias,
                         n.gate_bias, n.up_bias, n.gate_up_bias):
                cuts[name] = column
            cuts[n.o] = cuts[n.down] = row
            for name in (n.o_bias, n.down_bias):
                cuts[name] = first_rank
        cuts.pop(None, None)
        return cuts
