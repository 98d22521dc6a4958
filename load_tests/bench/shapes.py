"""Random-weight checkpoints of real model shapes, for the GPU run of the benchmark.

Each shape copies the layer geometry of a released model (hidden size, layers, heads, KV
heads, head size, MLP width, biases, tied embeddings, RoPE) so that the weight bytes per
layer, the KV bytes per token and the kernel shapes are the real ones. Two things differ,
on purpose: the vocabulary is the zoo's (2048 tokens, its tokenizer files are copied in),
which keeps the embedding and lm_head small (real vocabularies are 128k-152k: about
0.5 GB more per model in bf16, i.e. ~25% of a 1B model, ~7% of a 7B one); and the
weights are random, written straight to safetensors in bf16 (no transformers init, which
would take minutes at 7B).
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def _recipes():
    from actors.zoo.zoo import Recipe

    return {
        # Llama-3.2-1B: tied embeddings, llama3 RoPE scaling.
        "llama3-1b": Recipe("llama3-1b", "llama", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                            head_dim=64, intermediate_size=8192, seed=1, tie_word_embeddings=True,
                            rope_theta=500000.0, max_position_embeddings=131072, initializer_range=0.02,
                            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        # Qwen2.5-7B: q/k/v bias, 4 KV heads of 128.
        "qwen2.5-7b": Recipe("qwen2.5-7b", "qwen2", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4,
                             head_dim=128, intermediate_size=18944, seed=2, rope_theta=1000000.0,
                             max_position_embeddings=32768, initializer_range=0.02),
        # Mistral-7B-v0.1 layer geometry (no sliding window: as in v0.2+).
        "mistral-7b": Recipe("mistral-7b", "mistral", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                             head_dim=128, intermediate_size=14336, seed=3, rope_theta=1000000.0,
                             max_position_embeddings=32768, initializer_range=0.02),
        # Not a real shape: a few-MB stand-in so the CPU test can run this whole path.
        "test-tiny": Recipe("test-tiny", "qwen2", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                            head_dim=32, intermediate_size=256, seed=4, initializer_range=0.08),
    }


def shape_names() -> list[str]:
    return list(_recipes())


def parse_shapes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = shape_names()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--shapes: unknown {unknown}; known shapes: {', '.join(known)}")
    return names


def shape_info(name: str) -> dict:
    r = _recipes()[name]
    return {"params": r.num_params, "layers": r.num_layers, "hidden": r.hidden_size, "heads": r.num_heads,
            "kv_heads": r.num_kv_heads, "head_dim": r.head_dim, "intermediate": r.intermediate_size,
            "vocab": "zoo (2048)", "dtype": "bfloat16", "weights": "random"}


def build_shape(name: str, parent: Path | None = None, device: torch.device | str = "cpu") -> Path:
    """Write a bf16 random-weight checkpoint of shape `name` into a new directory; returns it.

    Tensors are drawn on `device` (fast on a GPU) and written with safetensors. The final
    norm is scaled so that logits are peaky (as in the zoo), which keeps greedy decoding of
    the engine and of transformers comparable token for token.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    from actors.zoo import zoo

    r = _recipes()[name]
    config = zoo._hf_config(replace(r, logit_std=5.0))
    config.dtype = "bfloat16"
    out = Path(tempfile.mkdtemp(prefix=f"tokenmux-shape-{name}-", dir=parent))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)   # names and shapes only, no memory
    generator = torch.Generator(device=device).manual_seed(r.seed)
    tensors = {}
    for key, param in skeleton.state_dict().items():
        if key == "lm_head.weight" and r.tie_word_embeddings:
            continue
        if key.endswith("norm.weight"):
            value = torch.ones(param.shape, dtype=torch.bfloat16, device=device)
            if key == "model.norm.weight":
                value.fill_(r.logit_std / (r.hidden_size ** 0.5 * r.initializer_range))
        else:
            value = torch.randn(param.shape, generator=generator, dtype=torch.float32, device=device)
            value = (value * r.initializer_range).to(torch.bfloat16)
        tensors[key] = value.cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=zoo.BOS, eos_token_id=[zoo.EOS, zoo.IM_END], pad_token_id=zoo.PAD,
                     do_sample=False).save_pretrained(out)
    tokenizer_dir = zoo.ensure_model(zoo.TINY_MODELS[0])
    for file in tokenizer_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, out / file.name)
    (out / "tokenmux-shape.json").write_text(json.dumps({"shape": name, **shape_info(name)}) + "\n")
    logger.info("built random-weight %s (%d params) in %s", name, r.num_params, out)
    return out


def scratch_dir(nbytes: int) -> Path | None:
    """/dev/shm when it has room for the checkpoint and its host-cache copy, else the temp dir."""
    usage = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
    return Path("/dev/shm") if usage and usage.free > 3 * nbytes else None


def shape_bytes(name: str) -> int:
    return _recipes()[name].num_params * 2
