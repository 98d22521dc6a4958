"""`tokenmux demo`: the main job on the embedded default, end to end on this machine.

Builds the zoo's models if needed and serves the two trained ones (they write words, see
actors/zoo/zoo_training.py) from ONE engine whose device budget holds a single model's
weights, so every turn switches models between decode steps. Prints what each model wrote
and how the engine spent its time; then the cluster part runs a bursty load over six models.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from actors.engine import Engine, EngineConfig
from actors.weight_layout import WeightLayout
from actors.zoo.zoo import ensure_model
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MiB = 1 << 20
DEMO_MODELS = ("llama-prose", "qwen2-prose")   # the embedded default of `tokenmux serve` too
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


DEMO_FLEET = ("llama-prose", "qwen2-prose", "llama-tiny-b", "llama-tiny-c", "qwen2-tiny-a", "mistral-tiny-a")
AZURE_CONV = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces" / "azure-llm-2023" / "conv.csv"


MAX_RETRIES = 2   # a 429 is sent again after its Retry-After, as the openai SDK does (its default is 2)


def burst_demo(duration_s: float = 45.0, max_requests: int = 120, out_dir: str = "out/demo",
               out=print) -> dict:
    """Six models on two virtual devices whose budgets hold two models each, behind the
    OpenAI HTTP API; a bursty long-tail load from the harness, whose client honours Retry-After
    as the openai SDK does; per-model latency and SLO attainment printed, plots written. Returns
    the run's summary, with `outcomes` (completed, retried, refused, failed)."""
    import asyncio

    import ray

    from cluster.planner.metrics import summarize
    from cluster.planner.traces import lengths_from_azure
    from cluster.planner.workloads import FixedLengths, Gamma, Zipf, generate
    from deploy.app_handles import cluster_handle
    from deploy.local import run_local
    from load_tests.contenders import turns_from_timelines
    from load_tests.driver import OpenAIHTTPTarget, run
    from load_tests.report import write_report
    from scheduler.slo import SLO

    slo = SLO(ttft_s=2.0, tbt_s=0.25)
    lengths = (lengths_from_azure(AZURE_CONV, max_input=48, max_output=32) if AZURE_CONV.exists()
               else FixedLengths(32, 24))
    workload = generate(Gamma(rate=2.0, cv=3.0), Zipf(1.0), list(DEMO_FLEET), lengths, seed=7,
                        duration_s=duration_s, num_requests=max_requests)
    out(f"serving {len(DEMO_FLEET)} models on 2 virtual devices (2 weight slots each), token-level policy; "
        f"SLO: TTFT {slo.ttft_s:.2f} s, TBT {slo.tbt_s:.2f} s; {len(workload)} requests, bursty (Gamma, CV 3)")
    with run_local(list(DEMO_FLEET), num_devices=2, port=_free_port(), num_slots=2, policy="token",
                   slo={"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s}, show_progress=True) as url:
        since = time.time()

        async def drive():
            async with OpenAIHTTPTarget(url) as target:
                return await run(target, workload, duration_s=duration_s + 1, max_requests=max_requests,
                                 request_timeout_s=60, vocab_size=2000, progress=True, max_retries=MAX_RETRIES)

        records = asyncio.run(drive())
        workers = cluster_handle().worker_handles.remote().result()
        timelines = dict(zip(workers, ray.get([h.timeline.remote() for h in workers.values()])))
    turns = turns_from_timelines(timelines, since)
    summary = summarize(records, slo, turns=turns)
    summary["outcomes"] = outcomes(records)
    _print_table(summary, out)
    _print_outcomes(summary["outcomes"], out)
    paths = write_report(out_dir, {"token": summary}, records={"token": records}, turns={"token": turns},
                         title="tokenmux demo: 6 models, 2 devices")
    out("plots: " + ", ".join(str(p) for name, p in sorted(paths.items()) if str(p).endswith(".png")))
    return summary


def _print_table(summary: dict, out) -> None:
    rows = [("all", summary)] + sorted(summary.get("per_model", {}).items())
    out(f"{'model':<16}{'reqs':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'TBT p50':>9}{'TBT p99':>9}"
        f"{'strict':>8}{'cumul.':>8}")
    for name, s in rows:
        def f(key: str) -> str:
            v = s.get(key)
            return "-" if v is None else f"{v:.3f}"
        out(f"{name:<16}{s.get('num_requests', 0):>5}{f('ttft_p50_s'):>10}{f('ttft_p99_s'):>10}"
            f"{f('tbt_p50_s'):>9}{f('tbt_p99_s'):>9}{f('attainment_strict'):>8}{f('attainment_cumulative'):>8}")


def outcomes(records) -> dict:
    """How the requests ended, as a user would count them: completed (some after a 429 and a
    retry), refused (still 429 after MAX_RETRIES retries), failed (any other error)."""
    return {"requests": len(records), "completed": sum(r.error is None for r in records),
            "retried": sum(r.num_retries > 0 for r in records), "retries": sum(r.num_retries for r in records),
            "refused": sum(r.refused for r in records),
            "failed": sum(r.error is not None and not r.refused for r in records),
            "failed_examples": [r.error for r in records if r.error is not None and not r.refused][:3]}


def _print_outcomes(counts: dict, out) -> None:
    out(f"{counts['requests']} requests: {counts['completed']} completed ({counts['retried']} of them after a 429, "
        f"{counts['retries']} retries after Retry-After), {counts['refused']} refused after {MAX_RETRIES} retries, "
        f"{counts['failed']} failed")
    for example in counts["failed_examples"]:
        out(f"  failed: {example}")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_demo(args) -> int:
    print("== 1. one engine, two zoo models, one weight slot: switched between decode steps ==")
    texts = engine_demo(max_tokens=args.max_tokens)
    if not all(texts.values()):
        raise RuntimeError(f"a model produced no text: {texts}")
    print("\n== 2. the cluster: OpenAI API -> router -> device workers, under a bursty load ==")
    logging.getLogger("ray.serve").setLevel(logging.WARNING)   # Serve logs every request at INFO
    summary = burst_demo(duration_s=args.duration, max_requests=args.max_requests, out_dir=args.out)
    counts = summary["outcomes"]
    return 1 if counts["failed"] or counts["refused"] else 0
