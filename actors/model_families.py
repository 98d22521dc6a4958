"""The model families tokenmux serves, and what sets each apart from a Llama layer.

A family is one transformers `model_type` and its architecture class. Every family here is
a pre-norm decoder with RoPE, grouped-query attention and a gated MLP; what differs is a
short list of traits, read by the spec (actors/model_spec.py), the parameter names
(actors/layer_kernels.py) and the arithmetic (actors/layers.py):

- Qwen3: RMSNorm over each head's q and k before RoPE; no q/k/v bias by default.
- Gemma 3 (text): the same q/k norms; RMSNorm weights applied as (1 + w) in float32;
  embeddings scaled by sqrt(hidden); a norm after attention and around the MLP
  ("sandwich" norms); GELU-tanh; local layers with a sliding window and their own RoPE base.
- Phi-3: q/k/v and gate/up stored fused in the checkpoint; longrope; partial rotary.

A new family (a sparse MoE MLP, say) adds its row here and its pieces beside the others.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    qkv_bias: bool = False          # q/k/v always carry a bias (Qwen2), whatever the config says
    o_bias: bool = True             # the config's attention_bias covers o_proj too (not Qwen2's)
    qk_norm: bool = False           # RMSNorm over each head's q and k, before RoPE (Qwen3, Gemma 3)
    unit_offset_norm: bool = False  # RMSNorm weight applied as (1 + w), computed in float32 (Gemma)
    embed_scale: bool = False       # embeddings times sqrt(hidden), in the weights' dtype (Gemma)
    sandwich_norms: bool = False    # norms on the attention output and around the MLP (Gemma 3)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    activations: tuple[str, ...] = ("silu",)   # hidden_act values this family's modelling accepts


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, o_bias=False),
    Family("mistral", "MistralForCausalLM"),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
    Family("mixtral", "MixtralForCausalLM"),                      # Mistral attention + sparse MoE (actors/moe.py)
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True),     # Qwen3 attention + sparse MoE
    Family("gemma3_text", "Gemma3ForCausalLM", qk_norm=True, unit_offset_norm=True, embed_scale=True,
           sandwich_norms=True, activations=("gelu_pytorch_tanh",)),
    Family("phi3", "Phi3ForCausalLM", fused_checkpoint=True),
)}

SUPPORTED_ARCHITECTURES = {model_type: f.architecture for model_type, f in FAMILIES.items()}

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"   # transformers' layer_types
