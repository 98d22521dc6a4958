"""Tensor-parallel sharding of one model (actors/tensor_parallel.py), on a CPU: what each
rank's layout holds, byte for byte, and what is refused. The ranks' forwards over gloo and
their greedy output against transformers are tests/test_tp_group.py's."""
from __future__ import annotations

import pytest
import torch
from family_checkpoints import phi3, qwen3

from actors.host_cache import HostWeightCache
from actors.kernel_path import KernelPath
from actors.layer_kernels import layer_names
from actors.model_runner import ModelRunner
from actors.model_spec import ModelSpec
from actors.tensor_parallel import TPShard
from actors.tp_group import backend_for
from actors.weight_layout import TensorCut
from actors.zoo.zoo import ensure_model
from tests.tp_ranks import rank_params


@pytest.fixture
def cache(tmp_path):
    c = HostWeightCache(shm_dir=tmp_path, pin=False)
    yield c
    c.close()


@pytest.mark.parametrize("model", ["llama-tiny-b", "qwen2-tiny-a"])
def test_two_ranks_hold_the_checkpoint_between_them(model, cache):
    """Each rank holds its own heads and intermediate rows; together the ranks' parts are the
    checkpoint's tensors; what is replicated is whole on both. llama-tiny-b groups 4 query
    heads per KV head, qwen2-tiny-a has q/k/v biases."""
    path = ensure_model(model)
    spec = ModelSpec.from_dir(path)
    reference = KernelPath("reference", "cpu")
    whole = rank_params(reference.weight_layout(path, torch.float32), cache, "whole")
    ranks = [rank_params(reference.weight_layout(path, torch.float32, TPShard(r, 2)), cache, f"rank{r}")
             for r in range(2)]
    assert len({cache.file_for(f"rank{r}") for r in range(2)} | {cache.file_for("whole")}) == 3
    for i in range(spec.num_layers):
        n = layer_names(spec, i)
        for name in [n.q, n.k, n.v, n.gate, n.up] + [b for b in (n.q_bias, n.k_bias, n.v_bias) if b]:
            assert ranks[0][name].shape[0] * 2 == whole[name].shape[0]
            assert torch.equal(torch.cat([ranks[0][name], ranks[1][name]]), whole[name]), name
        for name in (n.o, n.down):
            assert ranks[0][name].shape[1] * 2 == whole[name].shape[1]
            assert torch.equal(torch.cat([ranks[0][name], ranks[1][name]], dim=1), whole[name]), name
        for name in (n.input_norm, n.mlp_norm):
            assert torch.equal(ranks[1][name], whole[name])
    assert torch.equal(ranks[1]["model.embed_tokens.weight"], whole["model.embed_tokens.weight"])
    q_rows = ranks[0][layer_names(spec, 0).q].shape[0]
    k_rows = ranks[0][layer_names(spec, 0).k].shape[0]
    rank_spec = TPShard(1, 2).spec(spec)
    # a rank's query heads are the ones that read its KV heads: the same share of each
    assert (q_rows, k_rows) == (rank_spec.num_heads * spec.head_dim, rank_spec.num_kv_heads * spec.head_dim)
    assert rank_spec.num_heads // rank_spec.num_kv_heads == spec.num_heads // spec.num_kv_heads
    assert rank_spec.kv_shape.block_bytes * 2 == spec.kv_shape.block_bytes


def test_fast_layout_fuses_each_ranks_parts(cache):
    """The fast path's fused q/k/v of a rank is that rank's q, k and v stacked; gate/up alike."""
    path = ensure_model("llama-tiny-b")
    spec = ModelSpec.from_dir(path)
    checkpoint = rank_params(KernelPath("reference", "cpu").weight_layout(path, torch.float32, TPShard(1, 2)),
                             cache, "reference")
    fast = rank_params(KernelPath("fast", "cpu").weight_layout(path, torch.float32, TPShard(1, 2)), cache, "fast")
    n = layer_names(spec, 1)
    assert torch.equal(fast[n.qkv], torch.cat([checkpoint[n.q], checkpoint[n.k], checkpoint[n.v]]))
    assert torch.equal(fast[n.gate_up], torch.cat([checkpoint[n.gate], checkpoint[n.up]]))
    assert torch.equal(fast[n.down], checkpoint[n.down])


def test_one_rank_is_the_single_device_layout():
    path = ensure_model("llama-tiny-a")
    kernels = KernelPath("reference", "cpu")
    assert kernels.weight_layout(path, torch.float32, TPShard(0, 1)) == kernels.weight_layout(path, torch.float32)


def test_a_row_split_bias_is_added_once():
    bias = torch.arange(4.0)
    parts = [TensorCut(r, 2, None).apply(bias) for r in range(2)]
    assert torch.equal(parts[0] + parts[1], bias)


def test_what_does_not_split_is_refused(tmp_path):
    # llama-tiny-c has one KV head: two ranks cannot each hold a share of it
    with pytest.raises(ValueError, match=r"KV heads \(1\) do not divide by tensor_parallel 2"):
        KernelPath("reference", "cpu").weight_layout(ensure_model("llama-tiny-c"), torch.float32, TPShard(0, 2))
    with pytest.raises(ValueError, match=r"attention heads \(4\) do not divide by tensor_parallel 3"):
        TPShard(0, 3).spec(ModelSpec.from_dir(qwen3(tmp_path / "qwen3")))
    with pytest.raises(ValueError, match="fused q/k/v"):
        TPShard(0, 2).spec(ModelSpec.from_dir(phi3(tmp_path / "phi3")))
    with pytest.raises(ValueError, match="rank 2 outside a group of 2"):
        TPShard(2, 2)


def test_a_rank_on_a_gpu_sums_over_nccl_without_cuda_graphs():
    """The GPU path's choices, checked on a CPU: NCCL between CUDA devices (gloo between CPUs),
    and a rank's runner refuses CUDA graphs (a captured all-reduce is not supported)."""
    assert (backend_for("cuda:1"), backend_for("cuda"), backend_for("cpu")) == ("nccl", "nccl", "gloo")
    spec = TPShard(0, 2).spec(ModelSpec.from_dir(ensure_model("llama-tiny-a")))
    with pytest.raises(ValueError, match="CUDA graphs of a tensor-parallel rank"):
        ModelRunner(spec, "cpu", cuda_graphs=True, all_reduce=lambda x: x)
