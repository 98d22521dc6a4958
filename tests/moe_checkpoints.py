"""Tiny random-weight MoE checkpoints, built at test time with transformers' `save_pretrained`.

No checkpoint is committed: each builder makes a fresh directory from a seed. The shapes
are small (hidden 64, 2-3 layers, 4-8 experts, top-2) and the weights peaky enough that
greedy argmax is decided by the model, not by float rounding (as the zoo's recipes do).
`stack_experts` rewrites a checkpoint the way transformers 5 holds experts in memory (3-D
`experts.gate_up_proj` / `experts.down_proj` tensors), the other form a checkpoint may take.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

LOGIT_STD = 5.0


def _common(**kw) -> dict:
    return dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                initializer_range=0.08, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                pad_token_id=2, rms_norm_eps=1e-6, **kw)


def mixtral_config(**kw) -> MixtralConfig:
    """Mixtral: every layer sparse, softmax then top-k renormalised."""
    args = _common(intermediate_size=96, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=2,
                   architectures=["MixtralForCausalLM"])
    return MixtralConfig(**{**args, **kw})


def qwen3_moe_config(**kw) -> Qwen3MoeConfig:
    """Qwen3-MoE: q/k norms, top-k probabilities NOT renormalised, layer 1 a dense MLP
    (mlp_only_layers), every other layer sparse."""
    args = _common(intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=3, num_experts=8,
                   num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1,
                   architectures=["Qwen3MoeForCausalLM"])
    return Qwen3MoeConfig(**{**args, **kw})


def save(config, path: Path, seed: int = 7) -> Path:
    """Random weights from `seed`, the final norm set so logits have a std of ~LOGIT_STD."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(LOGIT_STD / (config.hidden_size ** 0.5 * config.initializer_range))
    model.save_pretrained(path)
    return path


def stack_experts(src: Path, dst: Path) -> Path:
    """`src` rewritten with each layer's experts as stacked 3-D tensors under `...mlp.experts.`
    (gate_up_proj [E, 2I, hidden], down_proj [E, hidden, I]), the rest as it was."""
    config = json.loads((src / "config.json").read_text())
    gate, up, down = {"mixtral": ("w1", "w3", "w2")}.get(config["model_type"], ("gate_proj", "up_proj", "down_proj"))
    tensors = load_file(str(src / "model.safetensors"))
    out, experts = {}, {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        block, _, rest = name.partition(".experts.")
        index, proj, _ = rest.split(".")
        experts.setdefault(block.replace(".block_sparse_moe", ".mlp"), {})[(int(index), proj)] = tensor
    for block, parts in experts.items():
        num_experts = max(i for i, _ in parts) + 1
        out[f"{block}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, gate)], parts[(e, up)]]) for e in range(num_experts)])
        out[f"{block}.experts.down_proj"] = torch.stack([parts[(e, down)] for e in range(num_experts)])
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for file in ("config.json", "generation_config.json"):
        if (src / file).is_file():
            (dst / file).write_text((src / file).read_text())
    return dst
