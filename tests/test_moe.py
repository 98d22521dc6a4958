"""The sparse MoE block (actors/moe.py): its routing and grouped layout, only the chosen
experts run, the grouped GEMM path (what CUDA runs) on a CPU, and the block's output
against transformers' own MoE block with the same weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from actors import moe
from actors.model_spec import MoeSpec
from tests import moe_checkpoints


def test_grouped_layout_sorts_token_slots_by_expert_with_offsets():
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])      # 3 tokens, top-2 of 5 experts; expert 1 and 4 idle
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    r = moe.group_by_expert(weights, experts, num_experts=5)
    flat = experts.reshape(-1)
    assert flat[r.order].tolist() == [0, 0, 2, 2, 2, 3]
    assert r.ends.dtype == torch.int32 and r.ends.tolist() == [2, 2, 5, 6, 6]   # empty experts: zero-width ranges
    assert sorted(r.order.tolist()) == list(range(6))
    assert r.tokens.tolist() == (r.order // 2).tolist()
    # each grouped row goes back to its token, weighted, and a token's two rows are summed
    rows = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 4)      # row i holds i
    got = moe.combine(rows, r, torch.float32)
    slot_of = {int(s): i for i, s in enumerate(r.order)}
    for t in range(3):
        want = sum(float(weights[t, j]) * slot_of[t * 2 + j] for j in range(2))
        assert torch.allclose(got[t], torch.full((4,), want))


def test_only_the_chosen_experts_run_each_once_over_all_their_tokens():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 16, generator=g)
    router = torch.randn(8, 16, generator=g)
    spec = MoeSpec(num_experts=8, top_k=2, intermediate_size=4, norm_topk_prob=True, float32_weights=True,
                   sparse_layers=(0,))
    r = moe.route(h, router, spec)
    calls = []

    def expert(e, x):
        calls.append((e, x.shape[0]))
        return x * (e + 1)

    moe.grouped_experts(h, r, expert)
    chosen = torch.bincount(r.experts.reshape(-1), minlength=8)
    assert calls == [(e, int(n)) for e, n in enumerate(chosen) if n > 0]
    assert len(calls) <= 6   # 3 tokens x 2 of 8 experts: the idle ones cost nothing


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no grouped GEMM")
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_grouped_gemm_path_equals_the_per_expert_loop(num_tokens):
    E, I, hidden = 6, 32, 64
    g = torch.Generator().manual_seed(num_tokens)
    h = torch.randn(num_tokens, hidden, generator=g)
    gate_up, down = torch.randn(E, 2 * I, hidden, generator=g) / 8, torch.randn(E, hidden, I, generator=g) / 8
    spec = MoeSpec(num_experts=E, top_k=2, intermediate_size=I, norm_topk_prob=False, float32_weights=False,
                   sparse_layers=(0,))
    r = moe.route(h, torch.randn(E, hidden, generator=g), spec)
    assert moe.grouped_mm_runs(h, gate_up)
    fused = moe.grouped_mm_experts(h, r, gate_up, down)
    loop = moe.grouped_experts(h, r, lambda e, x: moe.swiglu(x, gate_up[e, :I], gate_up[e, I:], down[e]))
    torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-5)


def test_block_equals_transformers_mixtral_block():
    config = moe_checkpoints.mixtral_config(num_local_experts=8)
    torch.manual_seed(3)
    block = MixtralSparseMoeBlock(config).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    spec = MoeSpec(num_experts=8, top_k=2, intermediate_size=config.intermediate_size, norm_topk_prob=True,
                   float32_weights=True, sparse_layers=(0,))
    h = torch.randn(1, 29, config.hidden_size)
    with torch.no_grad():
        want = block(h)[0]
        I = config.intermediate_size
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        got = moe.grouped_experts(h[0], moe.route(h[0], block.gate.weight, spec),
                                  lambda e, x: moe.swiglu(x, gate_up[e, :I], gate_up[e, I:], down[e]))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_spec_refuses_more_experts_per_token_than_experts():
    with pytest.raises(ValueError, match="top_k"):
        MoeSpec(num_experts=2, top_k=3, intermediate_size=8, norm_topk_prob=True, float32_weights=True,
                sparse_layers=(0,))
