"""`tokenmux demo`: the main job on the embedded default, end to end on this machine.

Builds the zoo's tiny models if needed and serves two of them from ONE engine whose
device budget holds a single model's weights, so every turn switches models between
decode steps. Prints what each model wrote and how the engine spent its time.
"""
from __future__ import annotations

import logging
import time

from actors.engine import Engine, EngineConfig
from actors.weight_layout import WeightLayout
from actors.zoo import ensure_model
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MiB = 1 << 20
DEMO_MODELS = ("llama-tiny-a", "qwen2-tiny-b")
PROMPTS = ("Tell me about the river.", "Write a short note on caching.")


def engine_demo(models=DEMO_MODELS, max_tokens: int = 24, out=print) -> dict[str, str]:
    """Generate from each model through tokenmux's own engine; returns model -> text."""
    paths = {m: ensure_model(m) for m in models}
    slot = max(WeightLayout.from_dir(p).total_bytes for p in paths.values())
    kv_bytes, slab = 8 * MiB, 96 * 1024 * 4
    engine = Engine(EngineConfig(budget_bytes=kv_bytes + slot + 4096, kv_bytes=kv_bytes, num_slots=1,
                                 slab_bytes=slab, host_kv_bytes=8 * MiB))
    texts: dict[str, str] = {}
    for i, (model, path) in enumerate(paths.items()):
        engine.register_model(model, path)
        tokenizer = engine.models[model].tokenizer
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                               add_generation_prompt=True)
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        for k in range(3):
            engine.add_request(GenerateRequest(f"{model}-{k}", model, tuple(prompt),
                                               SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=k)))
        texts[model] = ""
    start = time.perf_counter()
    outputs: dict[str, str] = {}
    num_tokens = 0
    while engine.has_unfinished():
        for frame in engine.step():
            outputs[frame.request_id] = outputs.get(frame.request_id, "") + frame.text
            num_tokens += len(frame.token_ids)
    elapsed = time.perf_counter() - start
    for request_id, text in sorted(outputs.items()):
        model = request_id.rsplit("-", 1)[0]
        texts[model] = texts[model] or text
        out(f"[{request_id}] {text!r}")
    swaps = engine.slots.stats()["swaps_per_model"]
    out(f"{num_tokens} tokens from {len(paths)} models in {elapsed:.2f} s on one device whose budget holds "
        f"{engine.memory.num_slots} model(s); weight swaps per model: {swaps}; "
        f"{engine.num_steps} steps, forward {engine.forward_seconds / max(engine.step_seconds, 1e-9):.0%} of step time")
    return texts


def run_demo(args) -> int:
    print("== tokenmux demo: two zoo models, one device, switched between decode steps ==")
    texts = engine_demo(max_tokens=args.max_tokens)
    if not all(texts.values()):
        raise RuntimeError(f"a model produced no text: {texts}")
    return 0
