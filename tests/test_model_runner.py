"""The model runner's greedy output equals transformers' `generate` token for token.

Zoo models cover Llama, Qwen2 and Mistral; Qwen3, Gemma 3 and Phi-3 are tiny checkpoints
written by transformers at test time (tests/family_checkpoints.py), one of them bf16 and
sharded, read back in float32 as the oracle reads it. Each model runs a mixed batch of
prompts (lengths 1..47, many crossing 16-token block boundaries) through one prefill
forward and then batched decode steps over a paged KV pool with scattered,
non-consecutive blocks in two slabs. The oracle is HF `generate`
(greedy) of the same checkpoint, one prompt at a time.
"""
from __future__ import annotations

import random

import pytest
import torch
from family_checkpoints import gemma3, phi3, qwen3
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from actors.model_runner import ModelRunner, SeqChunk
from actors.model_spec import ModelSpec
from actors.zoo.zoo import ensure_model
from tests import moe_checkpoints
from tests.greedy_reference import hf_greedy, hf_model

BLOCK = 16
MAX_NEW = 10
PROMPT_LENGTHS = [1, 2, 5, 9, 14, 15, 16, 17, 20, 23, 30, 31, 32, 33, 36, 40, 44, 47, 8, 12, 3]


class Model:
    """A checkpoint loaded twice: as flat params for the runner and as an HF model."""

    def __init__(self, path):
        self.spec = ModelSpec.from_dir(path)
        self.params = {name: t.float() for file in sorted(path.glob("*.safetensors"))   # every shard
                       for name, t in load_file(str(file)).items()}
        self.path = path
        self.hf = hf_model(path)
        self.runner = ModelRunner(self.spec, torch.device("cpu"))

    def new_kv(self, blocks_per_slab: int = 40) -> torch.Tensor:
        s = self.spec  # [slabs, blocks_per_slab, L, 2, 16, Hkv, D]
        return torch.zeros(2, blocks_per_slab, s.num_layers, 2, BLOCK, s.num_kv_heads, s.head_dim)

    def reference(self, prompt: list[int]) -> list[int]:
        return hf_greedy(self.path, prompt, MAX_NEW)


class Blocks:
    """A test-sized block allocator that hands out ids in a shuffled order."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def table(self, num_positions: int) -> list[int]:
        n = -(-num_positions // BLOCK)
        table, self.free = self.free[:n], self.free[n:]
        return table


def generate(model: Model, prompts: list[list[int]], split: int | None = None, kv=None,
             join_step: list[int] | None = None) -> list[list[int]]:
    """Greedy decode of all prompts, batched: one forward per step for every live sequence.

    `split` prefills each prompt in two forwards (a resume); `join_step[i]` is the step at
    which prompt i arrives, so its prefill chunk shares a forward with others' decode chunks.
    """
    kv = model.new_kv() if kv is None else kv
    blocks = Blocks(kv.shape[0] * kv.shape[1])
    tables = [blocks.table(len(p) + MAX_NEW) for p in prompts]
    join_step = join_step or [0] * len(prompts)
    eos = set(model.spec.eos_token_ids)
    if split is not None:
        first = [SeqChunk(p[:split], 0, t) for p, t in zip(prompts, tables)]
        model.runner.forward(model.params, first, kv)
    outputs = [[] for _ in prompts]
    pending = {i: SeqChunk(p[split:], split, t) if split else SeqChunk(p, 0, t)
               for i, (p, t) in enumerate(zip(prompts, tables))}
    live, chunks, step = [], [], 0
    while live or pending:
        for i in [i for i in pending if join_step[i] <= step]:
            live.append(i)
            chunks.append(pending.pop(i))
        step += 1
        if not live:
            continue
        tokens = model.runner.forward(model.params, chunks, kv).argmax(-1).tolist()
        next_live, next_chunks = [], []
        for i, chunk, token in zip(live, chunks, tokens):
            outputs[i].append(token)
            if token not in eos and len(outputs[i]) < MAX_NEW:
                next_live.append(i)
                start = chunk.start_pos + len(chunk.token_ids)
                restart = model.runner.recompute_from(start, start + 1)   # longrope crossing its pretraining length
                next_chunks.append(SeqChunk((prompts[i] + outputs[i])[restart:], restart, chunk.block_ids))
        live, chunks = next_live, next_chunks
    return outputs


def make_prompts(vocab_size: int, seed: int = 0, min_len: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab_size, (max(n, min_len),), generator=g).tolist() for n in PROMPT_LENGTHS]


def _save(config, path):
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _small(cls, **kw):
    return cls(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, initializer_range=0.08, max_position_embeddings=256,
               bos_token_id=0, eos_token_id=1, pad_token_id=2, architectures=[cls.__name__.replace("Config", "ForCausalLM")],
               **kw)


CUSTOM = {
    # window 8 < most prompts: tokens far back must drop out of attention.
    "mistral-window-8": lambda: _small(MistralConfig, sliding_window=8),
    "llama-yarn": lambda: _small(LlamaConfig, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
}
FAMILIES = {
    "qwen3": qwen3,
    "qwen3-bf16-sharded": lambda path: qwen3(path, dtype=torch.bfloat16, max_shard_size="100KB"),
    "gemma3": gemma3,
    "phi3": phi3,
}
# Sparse MoE checkpoints built here with save_pretrained (tests/moe_checkpoints.py): experts stored
# one tensor each (as published), and stacked as 3-D tensors; a sliding window on top.
MOE = {
    "mixtral": lambda path: moe_checkpoints.save(moe_checkpoints.mixtral_config(), path),
    "mixtral-stacked": lambda path: moe_checkpoints.stack_experts(
        moe_checkpoints.save(moe_checkpoints.mixtral_config(), path / "per-expert"), path / "stacked"),
    "mixtral-window-8": lambda path: moe_checkpoints.save(
        moe_checkpoints.mixtral_config(sliding_window=8, num_hidden_layers=3, num_local_experts=8), path),
    "qwen3-moe": lambda path: moe_checkpoints.save(moe_checkpoints.qwen3_moe_config(), path),
    "qwen3-moe-topk-normed-stacked": lambda path: moe_checkpoints.stack_experts(moe_checkpoints.save(
        moe_checkpoints.qwen3_moe_config(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[]),
        path / "per-expert"), path / "stacked"),
}
ZOO_MODELS = ["llama-tiny-a", "llama-tiny-b", "llama-tiny-c", "qwen2-tiny-a", "qwen2-tiny-b", "mistral-tiny-a",
              "mixtral-tiny-a"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache: dict[str, Model] = {}

    def get(name: str) -> Model:
        if name not in cache:
            if name in CUSTOM:
                path = _save(CUSTOM[name](), tmp_path_factory.mktemp(name))
            elif name in MOE:
                path = MOE[name](tmp_path_factory.mktemp(name))
            elif name in FAMILIES:
                path = FAMILIES[name](tmp_path_factory.mktemp(name))
            else:
                path = ensure_model(name)
            cache[name] = Model(path)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ZOO_MODELS + list(CUSTOM) + list(FAMILIES) + list(MOE))
def test_greedy_batch_equals_hf_generate(models, name):
    model = models(name)
    prompts = make_prompts(model.spec.vocab_size)
    got = generate(model, prompts)
    for prompt, out in zip(prompts, got):
        assert out == model.reference(prompt), f"{name}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("name", ["llama-tiny-b", "qwen2-tiny-a", "mistral-window-8", "gemma3", "mixtral-window-8"])
def test_resume_in_two_chunks_gives_same_tokens(models, name):
    model = models(name)
    prompts = make_prompts(model.spec.vocab_size, seed=1, min_len=12)
    got = generate(model, prompts, split=11)  # second chunk starts mid-block
    for prompt, out in zip(prompts, got):
        assert out == model.reference(prompt), f"{name}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("name", ["llama-tiny-c", "mistral-window-8", "qwen3", "phi3", "mixtral", "qwen3-moe"])
def test_prompts_joining_a_running_batch_give_same_tokens(models, name):
    """Continuous batching: prefill chunks share forwards with other sequences' decode steps."""
    model = models(name)
    prompts = make_prompts(model.spec.vocab_size, seed=4)
    got = generate(model, prompts, join_step=[i % 5 for i in range(len(prompts))])
    for prompt, out in zip(prompts, got):
        assert out == model.reference(prompt), f"{name}: prompt of {len(prompt)} tokens"


def test_prefill_logits_match_hf(models):
    model = models("qwen2-tiny-a")
    prompts = make_prompts(model.spec.vocab_size, seed=2)[:6]
    blocks = Blocks(80)
    chunks = [SeqChunk(p, 0, blocks.table(len(p))) for p in prompts]
    logits = model.runner.forward(model.params, chunks, model.new_kv())
    assert logits.shape == (len(prompts), model.spec.vocab_size) and logits.dtype == torch.float32
    for row, p in zip(logits, prompts):
        with torch.no_grad():
            ref = model.hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4)


def test_stale_pool_contents_do_not_leak(models):
    """Garbage in never-written slots (a fresh torch.empty pool, blocks reused from another
    sequence or another model's dtype) changes nothing, NaN included."""
    model = models("llama-tiny-a")
    prompts = make_prompts(model.spec.vocab_size, seed=3)
    kv = model.new_kv()
    kv.normal_(0, 100.0)
    kv.view(-1)[::7] = float("nan")
    got = generate(model, prompts, kv=kv)
    for prompt, out in zip(prompts, got):
        assert out == model.reference(prompt)


def test_bad_inputs_are_rejected_with_clear_errors(models):
    model = models("llama-tiny-a")
    kv = model.new_kv(blocks_per_slab=4)
    with pytest.raises(ValueError, match="need 2 blocks"):
        model.runner.forward(model.params, [SeqChunk(list(range(5, 25)), 0, [0])], kv)
    with pytest.raises(ValueError, match="no tokens"):
        model.runner.forward(model.params, [SeqChunk([], 0, [0])], kv)
    with pytest.raises(ValueError, match="block ids"):
        model.runner.forward(model.params, [SeqChunk([5], 0, [8])], kv)
    with pytest.raises(ValueError, match="token ids"):
        model.runner.forward(model.params, [SeqChunk([model.spec.vocab_size], 0, [0])], kv)
    with pytest.raises(ValueError, match="kv must be"):
        model.runner.forward(model.params, [SeqChunk([5], 0, [0])], kv[:, :, :1])
    with pytest.raises(ValueError, match="at least one chunk"):
        model.runner.forward(model.params, [], kv)


def test_length_dependent_rope_is_refused_up_front(models):
    import dataclasses

    spec = dataclasses.replace(models("llama-tiny-a").spec, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        ModelRunner(spec, torch.device("cpu"))
