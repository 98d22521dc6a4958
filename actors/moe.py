"""A sparse mixture-of-experts block (Mixtral, Qwen3-MoE): routing, and the chosen experts only.

    h [T, hidden] -> router logits [T, E] -> softmax (float32) -> top-k experts per token
    -> (renormalised) weights [T, k] -> each expert's SwiGLU over the tokens that chose it
    -> the k outputs of a token, weighted, summed in top-k order -> [T, hidden]

Tokens are grouped by expert (`group_by_expert`: one sort, counts, offsets), so an expert
runs one matmul over its tokens and an expert no token chose costs nothing. That is the
arithmetic of transformers' default experts implementation (`grouped_mm`), whose result the
oracle tests compare against, step for step: the same routing, the same grouping, the same
weighting and the same sum.

Two ways to run the grouped experts, each over the weights its kernel path laid out:

- `grouped_experts`: one call per expert that has tokens (`counts` read once on the host).
  The reference path runs it over the checkpoint's own tensors (gate, up and down, per expert
  or stacked, whichever the checkpoint stores); the fast path over its fused, packed gate/up
  and down of each expert (`MoeLayout`). This is the CPU path.
- `grouped_mm_experts`: torch's grouped GEMM over stacked experts ([E, 2I, hidden], [E, hidden, I]),
  the offsets left on the device: no host sync, so a CUDA graph can capture it. The fast path
  on CUDA takes it; anywhere torch's grouped GEMM does not run (an old torch, a dtype it
  refuses) the fast path falls back to `grouped_experts`, and outside a CUDA graph capture
  that is always correct. On CPU the grouped GEMM runs too, which is how its bookkeeping is
  tested without a GPU.

Checkpoints store experts two ways, both read here: one tensor per expert (every published
Mixtral / Qwen3-MoE checkpoint, and what transformers 5's `save_pretrained` writes) or
stacked 3-D tensors (`mlp.experts.gate_up_proj` [E, 2I, hidden], `mlp.experts.down_proj`
[E, hidden, I]: transformers 5's in-memory form, which some conversions save as is).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.model_spec import MoeSpec
from actors.weight_layout import PlannedTensor


@dataclass(frozen=True)
class Routing:
    """Which experts each token chose, and the grouped layout the experts run over.

    weights  # [T, k] the chosen experts' routing weights (float32 for Mixtral, the model dtype for Qwen3-MoE)
    experts  # [T, k] expert ids, in top-k order
    order    # [T * k] flat (token * k + slot) indices sorted by expert: the grouped layout
    ends     # [E] int32, end of each expert's rows in the grouped layout (grouped GEMM's offsets)
    """

    weights: torch.Tensor
    experts: torch.Tensor
    order: torch.Tensor
    ends: torch.Tensor

    @property
    def top_k(self) -> int:
        return self.experts.shape[1]

    @property
    def tokens(self) -> torch.Tensor:
        """# [T * k] the token of each row of the grouped layout."""
        return self.order // self.top_k


def route(h: torch.Tensor, router: torch.Tensor, moe: MoeSpec) -> Routing:
    """# h [T, hidden], router [E, hidden] -> Routing: transformers' top-k router, then the grouping."""
    logits = F.linear(h, router)                                   # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, moe.top_k, dim=-1)        # [T, k] each
    if moe.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    if not moe.float32_weights:
        weights = weights.to(h.dtype)
    return group_by_expert(weights, experts, moe.num_experts)


def group_by_expert(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> Routing:
    """The grouped layout of a routing, computed on its device without a host sync."""
    flat = experts.reshape(-1)
    _, order = torch.sort(flat)
    counts = torch.bincount(flat, minlength=num_experts)          # [E]
    return Routing(weights, experts, order, torch.cumsum(counts, 0, dtype=torch.int32))


def combine(rows: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """# rows [T * k, hidden] in grouped order -> [T, hidden]: each weighted by its routing
    weight, back in token order, a token's k rows summed in top-k order."""
    weighted = rows * routing.weights.reshape(-1)[routing.order, None]
    unsorted = torch.empty_like(weighted)
    unsorted[routing.order] = weighted
    T, k = routing.experts.shape
    return unsorted.view(T, k, -1).sum(dim=1).to(dtype)


def grouped_experts(h: torch.Tensor, routing: Routing, expert) -> torch.Tensor:
    """# h [T, hidden] -> [T, hidden]; `expert(e, x [n, hidden]) -> [n, hidden]` runs only for
    the experts that have tokens, once each over all of them."""
    x = h[routing.tokens]                                          # [T * k, hidden] grouped by expert
    rows = torch.empty_like(x)
    start = 0
    for e, end in enumerate(routing.ends.tolist()):
        if end > start:
            rows[start:end] = expert(e, x[start:end])
        start = end
    return combine(rows, routing, h.dtype)


def grouped_mm_experts(h: torch.Tensor, routing: Routing, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """# h [T, hidden], gate_up [E, 2I, hidden], down [E, hidden, I] -> [T, hidden], by torch's
    grouped GEMM (one kernel per projection, offsets on the device)."""
    x = h[routing.tokens]                                          # [T * k, hidden]
    gate, up = F.grouped_mm(x, gate_up.transpose(1, 2), offs=routing.ends).chunk(2, dim=-1)
    rows = F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=routing.ends)   # [T * k, hidden]
    return combine(rows, routing, h.dtype)


def grouped_mm_runs(h: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands here (it needs 16-byte aligned strides,
    and on CUDA an sm80+ device and bf16)."""
    if not hasattr(F, "grouped_mm") or (h.shape[1] * h.element_size()) % 16 or (gate_up.shape[1] * h.element_size()) % 16:
        return False
    if h.device.type == "cuda":
        return h.dtype == torch.bfloat16 and torch.cuda.get_device_capability(h.device) >= (8, 0)
    return h.device.type == "cpu"


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert as transformers runs it: # x [n, hidden] -> [n, hidden]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


# ---- names: the checkpoint's tensors, and the fast path's layout -------------------------


@dataclass(frozen=True)
class MoeNames:
    """Tensor names of one sparse layer: the checkpoint's and the fast layout's."""

    prefix: str                          # "model.layers.{i}.mlp." (Mixtral's own: "...block_sparse_moe.")
    num_experts: int
    intermediate_size: int
    per_expert: tuple[str, str, str] | None   # (gate, up, down) names under "experts.{e}."; None: stacked

    @property
    def router(self) -> str:
        return self.prefix + "gate.weight"

    def checkpoint_expert(self, p: dict, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's (gate [I, hidden], up [I, hidden], down [hidden, I]) as the checkpoint
        stores them: views, no copy."""
        if self.per_expert is None:
            gate_up, I = p[self.prefix + "experts.gate_up_proj"][e], self.intermediate_size
            return gate_up[:I], gate_up[I:], p[self.prefix + "experts.down_proj"][e]
        stem = f"{self.prefix}experts.{e}."
        return tuple(p[stem + name] for name in self.per_expert)

    def checkpoint_sources(self, e: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The checkpoint tensors that make expert e's fused gate/up [2I, hidden] and its down
        ("name[e]": row e of a stacked tensor, actors/weight_layout.py)."""
        if self.per_expert is None:
            return (f"{self.prefix}experts.gate_up_proj[{e}]",), (f"{self.prefix}experts.down_proj[{e}]",)
        stem, (gate, up, down) = f"{self.prefix}experts.{e}.", self.per_expert
        return (stem + gate, stem + up), (stem + down,)

    def fast_expert(self, e: int) -> tuple[str, str]:
        """The fast layout's names of expert e alone: (gate/up [2I, hidden], down [hidden, I])."""
        return f"{self.prefix}experts.{e}.gate_up", f"{self.prefix}experts.{e}.down"

    @property
    def fast_stacked(self) -> tuple[str, str]:
        """The fast layout's names of every expert stacked: ([E * 2I, hidden], [E * hidden, I])."""
        return self.prefix + "experts.gate_up", self.prefix + "experts.down"


# per-expert tensor names (gate, up, down) of each family's published checkpoints
_PER_EXPERT = {
    "mixtral": ("w1.weight", "w3.weight", "w2.weight"),
    "qwen3_moe": ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
}


def moe_names(model_type: str, moe: MoeSpec, layer: int) -> MoeNames | None:
    """The sparse block's names in `layer`, or None where that layer's MLP is dense."""
    if layer not in moe.sparse_layers:
        return None
    if moe.stacked_experts:   # transformers 5's names (Mixtral's block renamed to mlp)
        return MoeNames(f"model.layers.{layer}.mlp.", moe.num_experts, moe.intermediate_size, None)
    block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    return MoeNames(f"model.layers.{layer}.{block}.", moe.num_experts, moe.intermediate_size, _PER_EXPERT[model_type])


def fast_plan(n: MoeNames, hidden: int, stack: bool, big) -> list[PlannedTensor]:
    """The fast layout of one sparse layer: the router as it is, and each expert's gate/up
    fused ([2I, hidden]) and down ([hidden, I]); one expert at a time, packed where
    `big(shape)` says so (CPU), or with `stack` every expert stacked ([E * 2I, hidden],
    [E * hidden, I]) for a grouped GEMM."""
    plan = [PlannedTensor(n.router, (n.router,))]
    sources = [n.checkpoint_sources(e) for e in range(n.num_experts)]
    I = n.intermediate_size
    if stack:
        gate_up, down = n.fast_stacked
        return plan + [PlannedTensor(gate_up, tuple(s for gu, _ in sources for s in gu)),
                       PlannedTensor(down, tuple(s for _, d in sources for s in d))]
    for e, (gu, d) in enumerate(sources):
        gate_up, down = n.fast_expert(e)
        plan += [PlannedTensor(gate_up, gu, big((2 * I, hidden))), PlannedTensor(down, d, big((hidden, I)))]
    return plan
