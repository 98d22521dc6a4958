"""Tiny random-weight checkpoints of the newer dense families, written at test time by
transformers' own `save_pretrained` (nothing is committed), each with the zoo's tokenizer
(vocabulary 2048, EOS ids 1 and 4) so the engine and the HTTP edge serve them as they
serve zoo models.

Each config switches on what sets its family apart:
- qwen3: GQA, head_dim 32 != hidden / heads = 16, q/k norms with random weights.
- gemma3: GQA, sliding layers with a window of 8 (shorter than prompt + output) beside a
  global layer, a local RoPE base of its own, linear RoPE scaling on the global layer,
  query_pre_attn_scalar 20 != head_dim, final logit softcapping, tied embeddings.
- phi3: GQA, longrope whose pretraining length (32) most prompts plus their outputs pass, so
  both factor sets run, and partial rotary (0.75: 12 of 16 dims).
- qwen3_moe: tests/moe_checkpoints.py's sparse config (not in FAMILIES: the MoE tests own it).
`dtype` and `max_shard_size` write bf16 / fp16 and sharded checkpoints (with
model.safetensors.index.json), as real ones are published.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from actors.zoo.zoo import BOS, EOS, IM_END, PAD, ensure_model

VOCAB = 2048
EOS_IDS = [EOS, IM_END]
INIT = 0.08          # large enough that greedy argmax is decided by the model, not by rounding
LOGIT_STD = 5.0      # the final norm is set so that logits have about this std (peaky softmax)


def qwen3(path: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> Path:
    from transformers import Qwen3Config

    config = Qwen3Config(**_common(), num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _save(config, path, seed=31, dtype=dtype, max_shard_size=max_shard_size)


def gemma3(path: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> Path:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        **_common(), num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        query_pre_attn_scalar=20, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        final_logit_softcapping=30.0, tie_word_embeddings=True)
    return _save(config, path, seed=32, dtype=dtype, max_shard_size=max_shard_size)


def phi3(path: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> Path:
    from transformers import Phi3Config

    rotary_half = int(16 * 0.75) // 2
    config = Phi3Config(
        **_common(max_position_embeddings=128), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                         "long_factor": [2.0 + 1.5 * i for i in range(rotary_half)]})
    return _save(config, path, seed=33, dtype=dtype, max_shard_size=max_shard_size)


def qwen3_moe(path: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> Path:
    """tests/moe_checkpoints.py's Qwen3-MoE (8 experts, top-2 not renormalised, a dense layer
    among the sparse ones) with this module's vocabulary and tokenizer, so an engine serves it."""
    from tests.moe_checkpoints import qwen3_moe_config

    config = qwen3_moe_config(**_common(intermediate_size=128))
    return _save(config, path, seed=34, dtype=dtype, max_shard_size=max_shard_size)


FAMILIES = {"qwen3": qwen3, "gemma3": gemma3, "phi3": phi3}


def _common(**overrides) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, max_position_embeddings=256,
                initializer_range=INIT, rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=EOS_IDS,
                pad_token_id=PAD) | overrides


def _save(config, path: Path, seed: int, dtype: torch.dtype, max_shard_size: str | None) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig

    unit_offset = config.model_type == "gemma3_text"   # Gemma's norms apply (1 + w)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if "norm" in name:   # random norms: a q/k norm swapped or skipped changes the tokens
                    weight.normal_(0.0 if unit_offset else 1.0, 0.1)
            final = LOGIT_STD / (config.hidden_size ** 0.5 * INIT)
            model.model.norm.weight.fill_(final - 1.0 if unit_offset else final)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS_IDS, pad_token_id=PAD,
                                               do_sample=False)
    model.to(dtype).save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    zoo_model = ensure_model("llama-tiny-a")   # the zoo's tokenizer and chat template
    for file in zoo_model.iterdir():
        if file.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(file, path / file.name)
    return path
