"""The correctness oracle of the exactness tests: transformers' own greedy `generate()` on a
checkpoint, loaded in float32 (as the engine runs it in these tests). Each checkpoint loads
once and each (prompt, length) is generated once per test session."""
from __future__ import annotations

import torch

_models: dict[str, object] = {}
_outputs: dict[tuple, list[int]] = {}


def hf_greedy(path, prompt: list[int], max_new: int) -> list[int]:
    """The new token ids greedy generate() gives `prompt` (stopping at an EOS, as a request does)."""
    key = (str(path), tuple(prompt), max_new)
    if key not in _outputs:
        model = hf_model(path)
        ids = torch.tensor([list(prompt)])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                 pad_token_id=_pad_id(model.generation_config))
        _outputs[key] = out[0, ids.shape[1]:].tolist()
    return _outputs[key]


def hf_model(path):
    """The checkpoint as transformers loads it, float32, in eval mode (cached by path)."""
    from transformers import AutoModelForCausalLM

    if str(path) not in _models:
        _models[str(path)] = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return _models[str(path)]


def _pad_id(generation_config) -> int:
    # a batch of one never pads; the id only keeps generate() from warning
    if generation_config.pad_token_id is not None:
        return generation_config.pad_token_id
    eos = generation_config.eos_token_id
    return (eos if isinstance(eos, int) else (eos or [0])[0])
