"""Decode throughput: the tokenmux Engine against transformers' `generate`, same model,
same prompts, side by side in one process, alternating, median of the repetitions.

Both sides: `batch` requests of mean `prompt_tokens` tokens (HF gets them left-padded),
greedy, exactly `new_tokens` generated per request (the engine with ignore_eos, HF with
no eos token id), `tokens/s = batch * new_tokens / wall time`, where the wall time runs
from handing the batch over (add_request / generate) until the last token is back, so
it INCLUDES the prefill on both sides. Prefill is measured on its own as well (engine:
its prefill steps; HF: generate with one new token) and `*_decode_only_tps` excludes it.
The process CPU time of each run is recorded too (`*_cpu_s`, `decode_vs_hf_cpu`): on a
shared, oversubscribed host the wall clock mostly measures the neighbours, CPU time less so.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from load_tests.bench.common import (
    engine_for, greedy_requests, make_prompts, median, run_to_completion, sync, torch_dtype,
)

logger = logging.getLogger(__name__)

PAD = 2   # the zoo tokenizer's <|pad|>


def measure_decode(path: Path, *, device: torch.device, dtype: str | None, batch: int, new_tokens: int,
                   prompt_tokens: int, repeats: int, host_cache, name: str = "decode-model",
                   kernels: str = "fast") -> dict:
    from load_tests.bench.breakdown import EngineCounters, instrument

    prompts = make_prompts(batch, prompt_tokens, seed=1)
    max_len = max(map(len, prompts))
    engine = engine_for({name: path}, num_slots=2, tokens_per_model=batch * (max_len + new_tokens),
                        device=device, dtype=dtype, host_cache=host_cache, kernels=kernels)
    hf = _load_hf(path, device, dtype)
    # warm-up: first-call allocations, weights into the slot, HF's lazy init
    run_to_completion(engine, greedy_requests(name, prompts, min(4, new_tokens), "warm"))
    _hf_generate(hf, prompts, min(4, new_tokens), device)

    engine_s, hf_s, engine_prefill_s, hf_prefill_s, steps, engine_cpu, hf_cpu = [], [], [], [], [], [], []
    engine_tokens = hf_tokens = None
    breakdown = instrument(engine)
    breakdown.reset()
    counters = EngineCounters(engine)
    for i in range(repeats):
        for side in (("engine", "hf") if i % 2 == 0 else ("hf", "engine")):
            if side == "engine":
                c0 = time.process_time()
                t, prefill_s, n_steps, engine_tokens = _engine_run(engine, name, prompts, new_tokens, device, i)
                engine_cpu.append(time.process_time() - c0)
                engine_s.append(t)
                engine_prefill_s.append(prefill_s)
                steps.append(n_steps)
            else:
                t0, c0 = time.perf_counter(), time.process_time()
                hf_tokens = _hf_generate(hf, prompts, new_tokens, device)
                hf_s.append(time.perf_counter() - t0)
                hf_cpu.append(time.process_time() - c0)
                t0 = time.perf_counter()
                _hf_generate(hf, prompts, 1, device)
                hf_prefill_s.append(time.perf_counter() - t0)
    num_steps, forward_s, step_s = counters.delta()
    total = batch * new_tokens
    e, h, ep, hp = median(engine_s), median(hf_s), median(engine_prefill_s), median(hf_prefill_s)
    matches = sum(a == b for a, b in zip(engine_tokens, hf_tokens))
    attn = getattr(hf.config, "_attn_implementation", None)
    del hf
    return {
        "decode_tps": total / e,
        "hf_generate_tps": total / h,
        "decode_vs_hf": h / e,
        "decode_s": e,
        "hf_generate_s": h,
        "decode_prefill_s": ep,
        "hf_prefill_s": hp,
        "decode_only_tps": batch * (new_tokens - 1) / max(1e-9, e - ep),
        "hf_decode_only_tps": batch * (new_tokens - 1) / max(1e-9, h - hp),
        "decode_cpu_s": median(engine_cpu),
        "hf_generate_cpu_s": median(hf_cpu),
        "decode_vs_hf_cpu": median(hf_cpu) / median(engine_cpu),
        "decode_steps": median(steps),
        "decode_samples_s": engine_s,
        "hf_generate_samples_s": hf_s,
        "decode_greedy_match": f"{matches}/{batch}",
        "decode_engine_breakdown": breakdown.report(step_s),
        "decode_engine_counters": {"num_steps": num_steps, "forward_seconds": forward_s, "step_seconds": step_s},
        "decode_setup": {"batch": batch, "new_tokens": new_tokens, "prompt_lengths": [len(p) for p in prompts],
                         "tokens_per_s": "batch * new_tokens / wall time, prefill included on both sides",
                         "hf": f"generate(do_sample=False, eos_token_id=None), left padding, attention {attn}"},
    }


def _engine_run(engine, name, prompts, new_tokens, device, rep) -> tuple[float, float, int, list]:
    requests = greedy_requests(name, prompts, new_tokens, f"r{rep}")
    timeline_start = len(engine.timeline)
    steps_before = engine.num_steps
    sync(device)
    t0 = time.perf_counter()
    tokens = run_to_completion(engine, requests)
    sync(device)
    elapsed = time.perf_counter() - t0
    counts = [len(tokens[r.request_id]) for r in requests]
    if counts != [new_tokens] * len(requests):
        raise RuntimeError(f"engine generated {counts} tokens, expected {new_tokens} each")
    turns = list(engine.timeline)[timeline_start:]
    prefill_s = sum(s.seconds for s in turns if s.is_prefill)
    return elapsed, prefill_s, engine.num_steps - steps_before, [tokens[r.request_id] for r in requests]


def _load_hf(path: Path, device: torch.device, dtype: str | None):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tdtype = torch_dtype(dtype) or "auto"
    if device.type == "cuda":   # straight onto the device, not through a host copy of the model
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=tdtype, device_map=str(device)).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=tdtype).eval()


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> list[list[int]]:
    from transformers import GenerationConfig

    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], device=device)          # [B, W]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                              pad_token_id=PAD, bos_token_id=model.generation_config.bos_token_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)   # [B, W + new]
    sync(device)
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {new_tokens}")
    return out[:, width:].tolist()
