"""Issue 44's mixed-load floor: a TP-2 model's TBT attainment beside two single-device models,
against the same load with the TP model alone on the 2 devices.

    .venv/bin/python -m load_tests.experiments.tp_mix.run OUT.json [--seeds 4] [--bursts 3]

Two setups of 2 virtual devices (DeviceWorkers, gloo), both up at once and used in turn:

- alone: llama-tiny-b split over a TP-2 group ("big");
- mixed: the same group, plus llama-tiny-a ("mine") on the leader's device and qwen2-tiny-a
  ("theirs") on the member's, each device with a weight slot for its part of the group and
  one for its own model.

The TBT SLO is 5x (`--tbt-factor`) the TP model's decode step measured alone first (one request, batch 1, on
the alone setup after a warm-up): every request of every model carries it. Per seed, the SAME
bursty arrivals of the TP model (bursts of `burst` requests every `period_s`, seeded prompts)
run on both setups, the mixed one with the single models' own bursts between them; the
order of the two setups alternates with the seed. Reported per setup and seed: the TP
model's TBT attainment (the fraction of its inter-token gaps, engine token times, within the
SLO) and goodput (the fraction of its requests whose every gap is within it, and those per
second of the run); the paired difference alone - mixed with a Student-t 95% CI over seeds;
whether every output equals transformers' greedy `generate()` (every model); and, from the
mixed setup's timelines, how many runs of the group's steps each device had between its own
model's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

MODELS = {"big": "llama-tiny-b", "mine": "llama-tiny-a", "theirs": "qwen2-tiny-a"}
TBT_FACTOR = 5.0
WAIT_S = 600.0


@dataclass(frozen=True)
class Load:
    bursts: int = 3          # of the TP model, per seed and setup
    burst: int = 6           # its requests per burst
    single_burst: int = 3    # each single model's requests per burst (mixed setup only)
    period_s: float = 1.5    # between bursts
    max_tokens: int = 32


def engine_config(paths: dict[str, str]):
    """Each device: a slot for its part of the group and one for its own model; a KV pool of 32
    slabs of 4 blocks (half dedicated to the group), reference kernels (tensor-parallel tested)."""
    import torch

    from actors.engine import EngineConfig
    from actors.kernel_path import KernelPath
    from actors.model_spec import ModelSpec
    from actors.tensor_parallel import TPShard

    kernels, shard = KernelPath("reference", "cpu"), TPShard(0, 2)
    specs = [shard.spec(ModelSpec.from_dir(paths["big"]))] + [ModelSpec.from_dir(paths[m]) for m in ("mine", "theirs")]
    slab = max(s.kv_shape.block_bytes for s in specs) * 4
    slot = max([kernels.weight_layout(paths["big"], torch.float32, shard).total_bytes] +
               [kernels.weight_layout(paths[m], torch.float32).total_bytes for m in ("mine", "theirs")]) + 4096
    kv = slab * 32
    return EngineConfig(budget_bytes=kv + 2 * slot, kv_bytes=kv, num_slots=2, slab_bytes=slab, host_kv_bytes=slab * 64,
                        kernels="reference", detokenize=False)


def start_setup(ray, paths: dict[str, str], config, prefix: str, mixed: bool) -> list:
    """[leader, member]: the TP-2 group of "big", and in the mixed setup each device's own model."""
    from actors.tensor_parallel import TPShard
    from actors.tp_group import free_address
    from actors.worker import DeviceWorker

    workers = [ray.remote(num_gpus=1, num_cpus=0)(DeviceWorker).remote(f"{prefix}{r}", config, num_threads=1)
               for r in range(2)]
    ray.get([w.ready.remote() for w in workers])
    address = free_address()
    ray.get([w.join_tp_group.remote(TPShard(r, 2), address) for r, w in enumerate(workers)], timeout=120)
    ray.get(workers[1].register_tp_model.remote("big", paths["big"]), timeout=120)
    ray.get(workers[0].register_tp_model.remote("big", paths["big"], [workers[1]]), timeout=120)
    if mixed:   # after the group's: its dedicated slabs are the same on both ranks
        ray.get([workers[0].register_model.remote("mine", paths["mine"]),
                 workers[1].register_model.remote("theirs", paths["theirs"])])
    return workers


def schedule(seed: int, load: Load, slo, mixed: bool, tag: str) -> list[tuple[float, int, object]]:
    """(offset s, 0 leader / 1 member, GenerateRequest), the TP model's the same in both setups."""
    from scheduler.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=load.max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for model, device, n, offset in (("big", 0, load.burst, 0.0), ("mine", 0, load.single_burst, 0.3),
                                     ("theirs", 1, load.single_burst, 0.6)):
        if model != "big" and not mixed:
            continue
        rng = random.Random(f"{seed}-{model}")
        for b in range(load.bursts):
            for i in range(n):
                prompt = tuple(rng.randrange(8, 2000) for _ in range(rng.randrange(8, 41)))
                out.append((b * load.period_s + offset, device,
                            GenerateRequest(f"{tag}-{model}-{b}-{i}", model, prompt, params, slo)))
    return out


async def _drive(workers: list, plan: list) -> dict[str, tuple[list[int], list[float]]]:
    """Each request sent at its offset; request id -> (tokens, engine token times)."""
    start = time.time()

    async def one(offset, device, request):
        await asyncio.sleep(max(0.0, start + offset - time.time()))
        tokens, times = [], []
        async for ref in workers[device].generate.remote(replace(request, arrival_time=time.time())):
            frame = await ref
            if frame.error is not None:
                raise RuntimeError(f"{request.request_id}: {frame.error}")
            tokens += frame.token_ids
            times += frame.token_times
        return request.request_id, (tokens, times)

    return dict(await asyncio.wait_for(asyncio.gather(*[one(*p) for p in plan]), WAIT_S))


def drive(workers: list, plan: list) -> dict[str, tuple[list[int], list[float]]]:
    return asyncio.run(_drive(workers, plan))


class Greedy:
    """transformers' greedy tokens of each (model, prompt), EOS ignored as the requests ignore it."""

    def __init__(self, paths: dict[str, str]):
        self.paths, self.models, self.cache = paths, {}, {}

    def __call__(self, model: str, prompt: tuple[int, ...], n: int) -> list[int]:
        import torch
        from transformers import AutoModelForCausalLM

        if (model, prompt, n) not in self.cache:
            if model not in self.models:
                self.models[model] = AutoModelForCausalLM.from_pretrained(self.paths[model],
                                                                          dtype=torch.float32).eval()
            ids = torch.tensor([list(prompt)])
            with torch.inference_mode():
                out = self.models[model].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                  max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                                                  pad_token_id=0)
            self.cache[(model, prompt, n)] = out[0, ids.shape[1]:].tolist()
        return self.cache[(model, prompt, n)]


def score(plan: list, results: dict, tbt_s: float, greedy: Greedy, duration_s: float) -> dict:
    """The TP model's attainment and goodput; how many outputs of each model were exact."""
    gaps, met, n_big, exact, total = 0, 0, 0, 0, 0
    within = 0
    for _, _, request in plan:
        tokens, times = results[request.request_id]
        total += 1
        exact += tokens == greedy(request.model, request.prompt_token_ids, request.sampling_params.max_tokens)
        if request.model != "big":
            continue
        n_big += 1
        steps = [b - a for a, b in zip(times, times[1:])]
        ok = sum(g <= tbt_s for g in steps)
        gaps, met = gaps + len(steps), met + ok
        within += ok == len(steps)
    return {"tbt_attainment": met / gaps if gaps else None, "goodput_frac": within / n_big,
            "goodput_rps": within / duration_s, "tp_requests": n_big, "tp_gaps": gaps,
            "exact": exact, "requests": total}


def turns(timelines: list) -> dict:
    """Per device of the mixed setup: runs of the group's steps, and group -> own model switches."""
    out = {}
    for name, timeline in zip(("leader", "member"), timelines):
        runs: list[str] = []
        for record in sorted(timeline, key=lambda r: r.start):
            if not runs or runs[-1] != record.model:
                runs.append(record.model)
        out[name] = {"group_runs": runs.count("big"), "own_runs": len(runs) - runs.count("big"),
                     "group_to_own": sum(1 for a, b in zip(runs, runs[1:]) if a == "big" and b != "big")}
    return out


def measure_decode_step(ray, workers: list, max_tokens: int) -> float:
    """The TP model's decode step alone, batch 1: the leader's mean over one request."""
    from scheduler.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    request = GenerateRequest("step-probe", "big", tuple(range(40, 72)),
                              SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    _, times = drive(workers, [(0.0, 0, request)])["step-probe"]
    return (times[-1] - times[1]) / (len(times) - 2)   # the first gap after the prefill left out


def run(ray, seeds: list[int], load: Load, log=print, tbt_factor: float = TBT_FACTOR) -> dict:
    from actors.zoo.zoo import ensure_model
    from load_tests.stats import mean_ci
    from scheduler.slo import SLO

    paths = {k: str(ensure_model(v)) for k, v in MODELS.items()}
    config = engine_config(paths)
    setups = {"alone": start_setup(ray, paths, config, "alone", False),
              "mixed": start_setup(ray, paths, config, "mixed", True)}
    greedy = Greedy(paths)
    try:
        warm = SLO(ttft_s=60.0, tbt_s=1.0)
        for name, workers in setups.items():   # weights resident, code paths warm
            drive(workers, schedule(-1, replace(load, bursts=1), warm, name == "mixed", f"warm-{name}"))
        step_s = measure_decode_step(ray, setups["alone"], 2 * load.max_tokens)
        slo = SLO(ttft_s=60.0, tbt_s=tbt_factor * step_s)
        log(f"TP decode step alone (batch 1): {step_s * 1e3:.2f} ms; TBT SLO {slo.tbt_s * 1e3:.2f} ms")
        per_seed = []
        for seed in seeds:
            order = ("alone", "mixed") if seed % 2 == 0 else ("mixed", "alone")
            row = {"seed": seed, "order": list(order)}
            for name in order:
                plan = schedule(seed, load, slo, name == "mixed", f"s{seed}-{name}")
                start = time.time()
                results = drive(setups[name], plan)
                row[name] = score(plan, results, slo.tbt_s, greedy, time.time() - start)
                log(f"seed {seed} {name}: {row[name]}")
            per_seed.append(row)
        timelines = ray.get([w.timeline.remote() for w in setups["mixed"]])
    finally:
        for workers in setups.values():
            for w in workers:
                ray.kill(w)
    diffs = {k: [r["alone"][k] - r["mixed"][k] for r in per_seed] for k in ("tbt_attainment", "goodput_frac")}
    summary = {k: {"alone": mean_ci([r["alone"][k] for r in per_seed]).to_dict(),
                   "mixed": mean_ci([r["mixed"][k] for r in per_seed]).to_dict(),
                   "alone_minus_mixed": mean_ci(v).to_dict()} for k, v in diffs.items()}
    exact = all(r[s]["exact"] == r[s]["requests"] for r in per_seed for s in ("alone", "mixed"))
    return {"load": load.__dict__, "models": MODELS, "tp_decode_step_alone_s": step_s,
            "tbt_slo_s": slo.tbt_s, "tbt_factor": tbt_factor, "seeds": seeds, "per_seed": per_seed,
            "summary": summary, "all_outputs_exact": exact, "mixed_timeline_turns": turns(timelines),
            "floor_within_5_points": summary["tbt_attainment"]["alone_minus_mixed"]["mean"] <= 0.05}


def main(argv: list[str] | None = None) -> None:
    import ray

    from load_tests.provenance import provenance

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--bursts", type=int, default=Load.bursts)
    parser.add_argument("--burst", type=int, default=Load.burst)
    parser.add_argument("--tbt-factor", type=float, default=TBT_FACTOR, help="TBT SLO / the decode step alone")
    args = parser.parse_args(argv)
    origin = provenance()   # at the start: the tree and the host's load the run began with
    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        result = run(ray, list(range(args.seeds)), Load(bursts=args.bursts, burst=args.burst),
                     tbt_factor=args.tbt_factor)
    finally:
        ray.shutdown()
    result["provenance"] = origin
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
