"""ModelSpec reads what the engine needs from a checkpoint dir; bad dirs get one clear line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from actors.model_spec import CheckpointError, ModelSpec
from actors.zoo import zoo


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo")
    zoo.build_zoo(root, names=zoo.TINY_MODELS)
    return root


@pytest.mark.parametrize("name", zoo.TINY_MODELS)
def test_fields_match_what_transformers_reads(zoo_dir, name):
    path = zoo_dir / name
    spec = ModelSpec.from_dir(path)
    cfg = AutoConfig.from_pretrained(path)
    gen = GenerationConfig.from_pretrained(path)
    assert spec.path == str(path.resolve())
    assert spec.architecture == cfg.architectures[0] and spec.model_type == cfg.model_type
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert spec.vocab_size == cfg.vocab_size
    assert spec.max_position_embeddings == cfg.max_position_embeddings
    assert spec.rms_norm_eps == cfg.rms_norm_eps
    assert spec.rope_theta == cfg.rope_parameters["rope_theta"]
    assert spec.tie_word_embeddings == cfg.tie_word_embeddings
    assert spec.sliding_window == getattr(cfg, "sliding_window", None)
    assert spec.eos_token_ids == tuple(gen.eos_token_id) and spec.bos_token_id == gen.bos_token_id
    assert spec.torch_dtype == "float32" and spec.dtype_bytes == 4


@pytest.mark.parametrize("name", zoo.TINY_MODELS)
def test_attention_bias_and_rope_scaling_follow_the_model(zoo_dir, name):
    spec = ModelSpec.from_dir(zoo_dir / name)
    recipe = zoo.ZOO[name]
    model = AutoModelForCausalLM.from_pretrained(zoo_dir / name)
    assert spec.attention_bias == (model.model.layers[0].self_attn.q_proj.bias is not None)
    assert spec.rope_scaling == recipe.rope_scaling


@pytest.mark.parametrize("name", ["llama-tiny-c", "qwen2-tiny-a"])
def test_weight_bytes_is_the_sum_of_tensor_sizes(zoo_dir, name):
    tensors = load_file(zoo_dir / name / "model.safetensors")
    spec = ModelSpec.from_dir(zoo_dir / name)
    assert spec.weight_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert spec.num_params == zoo.ZOO[name].num_params


def test_sharded_checkpoint_counts_every_shard(zoo_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(zoo_dir / "mistral-tiny-b")
    model.save_pretrained(tmp_path, max_shard_size="1MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded = ModelSpec.from_dir(tmp_path)
    whole = ModelSpec.from_dir(zoo_dir / "mistral-tiny-b")
    assert sharded.weight_bytes == whole.weight_bytes


def test_kv_shape_matches_the_model(zoo_dir):
    kv_blocks = pytest.importorskip("scheduler.kv_blocks")
    spec = ModelSpec.from_dir(zoo_dir / "llama-tiny-b")
    assert spec.kv_shape == kv_blocks.KVShape(3, 2, 16, 4)


def _write_checkpoint(root: Path, config: dict, tensors: dict[str, torch.Tensor],
                      generation_config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (root / "generation_config.json").write_text(json.dumps(generation_config))
    save_file(tensors, str(root / "model.safetensors"))
    return root


# The field layout of a transformers-4 era Qwen2.5 0.5B Instruct checkpoint (bf16).
QWEN25_STYLE_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_reads_a_transformers4_style_bf16_checkpoint(tmp_path):
    tensors = {"model.embed_tokens.weight": torch.zeros(64, 8, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}
    root = _write_checkpoint(tmp_path / "qwen", QWEN25_STYLE_CONFIG, tensors,
                             {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": True})
    spec = ModelSpec.from_dir(root)
    assert (spec.architecture, spec.num_layers, spec.num_heads, spec.num_kv_heads) == ("Qwen2ForCausalLM", 24, 14, 2)
    assert spec.head_dim == 64  # hidden_size / num_heads when the config has no head_dim
    assert spec.rope_theta == 1e6 and spec.rope_scaling is None
    assert spec.sliding_window is None  # use_sliding_window is false
    assert spec.attention_bias and spec.tie_word_embeddings
    assert (spec.torch_dtype, spec.dtype_bytes) == ("bfloat16", 2)
    assert spec.eos_token_ids == (151645, 151643)  # generation_config wins over config
    assert spec.weight_bytes == (64 * 8 + 8) * 2


def test_reads_legacy_llama3_rope_scaling_and_dtype_from_weights(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
              "num_key_value_heads": 1, "vocab_size": 100, "rope_theta": 500000.0, "eos_token_id": 7,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    root = _write_checkpoint(tmp_path / "llama", config, {"w": torch.zeros(10, dtype=torch.float16)})
    spec = ModelSpec.from_dir(root)
    assert spec.rope_scaling["rope_type"] == "llama3" and spec.rope_scaling["factor"] == 8.0
    assert spec.rope_theta == 500000.0
    assert (spec.torch_dtype, spec.dtype_bytes) == ("float16", 2)
    assert spec.eos_token_ids == (7,) and spec.num_kv_heads == 1


def _error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        ModelSpec.from_dir(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_directory_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    message = _error(missing)
    assert str(missing) in message and "no such directory" in message


def test_directory_without_config(tmp_path):
    message = _error(tmp_path)
    assert message == f"not a model checkpoint: {tmp_path} (no config.json)"


def test_file_instead_of_directory(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    assert str(file) in _error(file)


def test_hub_id_is_refused_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = _error("Qwen/Qwen2.5-0.5B-Instruct")
    assert "Qwen/Qwen2.5-0.5B-Instruct" in message
    assert "Hugging Face hub id" in message and "offline" in message and "download" in message


@pytest.mark.parametrize("arch, model_type", [("GPT2LMHeadModel", "gpt2"), ("FalconForCausalLM", "falcon")])
def test_unsupported_architecture_lists_the_supported_ones(tmp_path, arch, model_type):
    config = {"architectures": [arch], "model_type": model_type, "hidden_size": 64}
    root = _write_checkpoint(tmp_path / model_type, config, {"w": torch.zeros(2)})
    message = _error(root)
    assert str(root) in message and arch in message
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                      "Gemma3ForCausalLM", "Phi3ForCausalLM"):
        assert supported in message


def test_new_families_read_as_transformers_reads_them(tmp_path):
    """Qwen3 bf16 in shards, Gemma 3 and Phi-3 fp16, written by transformers: the fields the
    runner relies on equal the config transformers builds, EOS ids come from generation_config."""
    from family_checkpoints import EOS_IDS, gemma3, phi3, qwen3

    q = ModelSpec.from_dir(qwen3(tmp_path / "q", dtype=torch.bfloat16, max_shard_size="100KB"))
    assert (tmp_path / "q" / "model.safetensors.index.json").is_file()
    assert (q.torch_dtype, q.head_dim, q.num_kv_heads, q.family.qk_norm) == ("bfloat16", 32, 2, True)
    assert q.weight_bytes == sum(t.numel() * 2 for f in (tmp_path / "q").glob("*.safetensors")
                                 for t in load_file(f).values())
    g_path = gemma3(tmp_path / "g")
    g, cfg = ModelSpec.from_dir(g_path), AutoConfig.from_pretrained(g_path)
    assert g.layer_types == tuple(cfg.layer_types) and g.sliding_window == cfg.sliding_window
    assert g.layer_windows == (8, 8, None, 8)
    assert g.rope_local_theta == cfg.rope_parameters["sliding_attention"]["rope_theta"]
    assert g.rope_scaling["rope_type"] == "linear" and g.attention_scale == cfg.query_pre_attn_scalar ** -0.5
    assert g.final_logit_softcapping == cfg.final_logit_softcapping and g.tie_word_embeddings
    assert g.hidden_act == "gelu_pytorch_tanh" and g.eos_token_ids == tuple(EOS_IDS)
    p = ModelSpec.from_dir(phi3(tmp_path / "p", dtype=torch.float16))
    assert (p.torch_dtype, p.rotary_dim, p.rope_scaling["rope_type"]) == ("float16", 12, "longrope")
    assert p.rope_scaling["original_max_position_embeddings"] == 32


def test_reads_transformers4_style_gemma3_and_phi3_configs(tmp_path):
    """Published v4-era spellings: Gemma 3's rope_local_base_freq and sliding_window_pattern,
    Phi-3.5's "su"/longrope rope_scaling with a top-level original_max_position_embeddings."""
    base = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 6,
            "num_key_value_heads": 1, "vocab_size": 100}
    gemma = {**base, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 16,
             "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
             "sliding_window_pattern": 3, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
             "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16}
    g = ModelSpec.from_dir(_write_checkpoint(tmp_path / "g", gemma, {"w": torch.zeros(2, dtype=torch.bfloat16)}))
    assert g.layer_windows == (512, 512, None, 512, 512, None)
    assert (g.rope_theta, g.rope_local_theta, g.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert g.tie_word_embeddings   # Gemma ties unless its config says otherwise
    phi = {**base, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}}
    p = ModelSpec.from_dir(_write_checkpoint(tmp_path / "p", phi, {"w": torch.zeros(2, dtype=torch.bfloat16)}))
    assert p.rope_scaling["rope_type"] == "longrope" and p.rope_scaling["original_max_position_embeddings"] == 4096
    assert p.partial_rotary_factor == 0.75 and p.rotary_dim == 12


def test_config_without_weights(tmp_path, zoo_dir):
    (tmp_path / "config.json").write_bytes((zoo_dir / "llama-tiny-a" / "config.json").read_bytes())
    message = _error(tmp_path)
    assert str(tmp_path) in message and "safetensors" in message


def test_broken_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert "config.json" in _error(tmp_path)


def test_config_missing_a_required_key(tmp_path):
    config = dict(QWEN25_STYLE_CONFIG)
    del config["num_hidden_layers"]
    root = _write_checkpoint(tmp_path / "q", config, {"w": torch.zeros(2)})
    message = _error(root)
    assert "num_hidden_layers" in message and str(root) in message


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_spec_rejects_inconsistent_head_counts(zoo_dir):
    from dataclasses import replace

    spec = ModelSpec.from_dir(zoo_dir / "llama-tiny-a")
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        replace(spec, num_kv_heads=3)
    with pytest.raises(ValueError, match="unsupported architecture"):
        replace(spec, architecture="GPT2LMHeadModel")


def test_moe_specs_follow_the_config_and_count_every_expert(tmp_path):
    """Mixtral: every layer sparse, top-k renormalised; Qwen3-MoE: mlp_only_layers dense, its own
    norm_topk_prob; weight_bytes counts every expert, num_active_params only the chosen ones."""
    from tests import moe_checkpoints

    mixtral = ModelSpec.from_dir(moe_checkpoints.save(moe_checkpoints.mixtral_config(), tmp_path / "mixtral"))
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.sparse_layers) == (6, 2, (0, 1))
    assert mixtral.moe.norm_topk_prob and not mixtral.moe.stacked_experts
    qwen = ModelSpec.from_dir(moe_checkpoints.save(moe_checkpoints.qwen3_moe_config(), tmp_path / "qwen3-moe"))
    assert qwen.moe.sparse_layers == (0, 2) and not qwen.moe.norm_topk_prob and qwen.moe.intermediate_size == 48
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3-moe")
    assert qwen.num_params == model.num_parameters()
    idle = 2 * (8 - 2) * 3 * 64 * 48   # 2 sparse layers x 6 unchosen experts x (gate, up, down)
    assert qwen.num_params - qwen.num_active_params == idle
    stacked = ModelSpec.from_dir(moe_checkpoints.stack_experts(tmp_path / "qwen3-moe", tmp_path / "stacked"))
    assert stacked.moe.stacked_experts and stacked.weight_bytes == qwen.weight_bytes
