"""`tokenmux bench catalog`: the live catalog changed under load, against the same load unchanged.

The bench starts its own server (Ray with 2 virtual devices, loopback only) serving 4 tiny
zoo models and drives them, through the HTTP edge, with a bursty open-loop load (gamma
inter-arrivals, CV 2, from a child process: load_tests/open_loop.py). Each pair runs that
load twice with the same seed, once unchanged (baseline) and once while the catalog changes
(which goes first alternates per pair):

    at 20% of the load   add ADDED (POST /admin/models), then one stream to it: the time from
                         `add` returning to its first token
    at 40%               update UPDATED to a new checkpoint (PUT): a new version, no gap
    at 60%               remove REMOVED (DELETE, drain_s): in flight finish or are cut

Scored, against FLOORS:
    untouched_failures        requests of the untouched models that did not complete
    untouched_ttft_p99_ratio  their client TTFT p99 with changes / without (median over pairs);
                              beside it, the p99 of those waiting for a first token while a
                              change call ran and of the others
    add_to_first_token_s      `add` returning -> the added model's first token (worst pair)
    touched_unexplained       requests of the updated or removed model that neither equal
                              transformers' greedy output of the version that served them
                              (`system_fingerprint`) nor ended with an explicit error (a 4xx,
                              an error chunk); those in flight at a change are counted apart
    rss_change_frac, kv_used_change   the workers' RSS and KV pool use, quiet before the changes
                              and quiet after them (the removal retired): change (worst pair)

After a changes run the catalog is put back (ADDED removed, REMOVED added, UPDATED updated to
its first checkpoint), so each run starts from the same models.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

from load_tests.open_loop import Outcome, quantile

APP = "tokenmux-catalog"
MiB = 1 << 20
MODELS = {"m-a": "llama-tiny-a", "m-b": "qwen2-tiny-b", "m-c": "mistral-tiny-a", "m-d": "llama-tiny-b"}
UNTOUCHED = ("m-a", "m-b")
ADDED, ADDED_ZOO = "m-e", "qwen2-tiny-a"
UPDATED, UPDATED_ZOO = "m-c", "mistral-tiny-b"
REMOVED = "m-d"
SERVER_ARGS = {"devices_per_node": 2, "threads_per_worker": 1, "budget_bytes": 64 * MiB, "kv_fraction": 0.25,
               "host_kv_gb": 0.01, "num_slots": 2, "max_tokens_cap": 64, "default_max_tokens": 16, "slo": {"ttft_s": 2.0, "tbt_s": 0.5}}
FLOORS = {"untouched_failures": ("==", 0), "untouched_ttft_p99_ratio": ("<=", 1.2),
          "add_to_first_token_s": ("<=", 10.0), "touched_unexplained": ("==", 0),
          "rss_change_frac": ("<=", 0.05), "kv_used_change": ("<=", 0.05)}
PROMPTS = ([11, 400, 77, 1234, 9, 18, 600, 5], [3, 141, 59, 26, 535, 89], [100, 200, 300, 400, 500, 600, 700],
           [42, 7, 1999, 13, 88])
MAX_TOKENS = (8, 48)          # each request's max_tokens is drawn from this range
BURST_SHAPE = 0.25            # gamma shape of the inter-arrival times: CV = 1 / sqrt(shape) = 2
CHANGE_AT = {"add": 0.2, "update": 0.4, "remove": 0.6}   # share of the load's duration


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", type=int, default=3, help="baseline/changes pairs (default 3)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second, all models (default 4)")
    parser.add_argument("--duration-s", type=float, default=20.0, help="seconds of load per run (default 20)")
    parser.add_argument("--drain-s", type=float, default=1.0,
                        help="the removal's drain: requests still in flight after it are cut (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE too")


def workload(rate: float, duration_s: float, seed: int) -> tuple[list[dict], list[float]]:
    """Streamed greedy requests over the 4 first models, and when each is sent (bursty arrivals)."""
    rng = random.Random(seed)
    bodies, at, t = [], [], 0.0
    while True:
        t += rng.gammavariate(BURST_SHAPE, 1.0 / (rate * BURST_SHAPE))
        if t >= duration_s:
            return bodies, at
        p = rng.randrange(len(PROMPTS))
        bodies.append({"model": rng.choice(sorted(MODELS)), "prompt": PROMPTS[p],
                       "max_tokens": rng.randint(*MAX_TOKENS), "temperature": 0, "ignore_eos": True, "stream": True})
        at.append(t)


def zoo_path(name: str) -> str:
    from actors.zoo.zoo import ensure_model

    return str(ensure_model(name))


class Reference:
    """transformers' greedy output of each (checkpoint, prompt), MAX_TOKENS[1] long: greedy is
    prefix-stable, so a request of max_tokens m must equal its first m tokens."""

    def __init__(self) -> None:
        self._models: dict[str, object] = {}
        self._outputs: dict[tuple[str, int], list[int]] = {}

    def tokens(self, path: str, prompt_index: int, max_tokens: int) -> list[int]:
        key = (path, prompt_index)
        if key not in self._outputs:
            import torch
            from transformers import AutoModelForCausalLM

            if path not in self._models:
                self._models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            prompt = torch.tensor([PROMPTS[prompt_index]])
            with torch.inference_mode():
                ids = self._models[path].generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                                  max_new_tokens=MAX_TOKENS[1], eos_token_id=None, pad_token_id=0)
            self._outputs[key] = ids[0, prompt.shape[1]:].tolist()
        return self._outputs[key][:max_tokens]


# ---- the server side: catalog, quiet, memory ----------------------------------------------


def catalog(client) -> dict:
    r = client.get("/admin/models")
    r.raise_for_status()
    return r.json()


def admin(client, method: str, path: str, **kwargs) -> dict:
    r = client.request(method, path, **kwargs)
    if r.status_code >= 300:
        raise RuntimeError(f"{method} {path} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def wait_quiet(client, timeout_s: float = 120.0) -> None:
    """No retiring key left in the catalog and no request counted anywhere (router, engines)."""
    from deploy.app_handles import cluster_status
    from load_tests.bench.chaos import inflight_now

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not catalog(client)["retiring"] and inflight_now(cluster_status(APP))[0] == 0:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the server did not settle within {timeout_s:g} s")


def memory() -> dict:
    """The workers' RSS (MiB, summed) and the share of their KV pools in use (mean)."""
    import gc

    from deploy.app_handles import cluster_status
    from load_tests.bench.chaos import rss_mb

    gc.collect()
    workers = cluster_status(APP).alive()
    rss = {w: mb for w, mb in rss_mb(APP).items() if w in workers}
    kv_used = [1.0 - s.engine.kv_free_frac for s in workers.values()]
    return {"worker_rss_mb": sum(rss.values()), "kv_used_frac": sum(kv_used) / max(1, len(kv_used))}


# ---- one run --------------------------------------------------------------------------------


def change_catalog(client, duration_s: float, drain_s: float, started: float) -> dict:
    """The three changes at their share of the load, each timed; fingerprint -> checkpoint of
    every version a touched request may name."""
    import httpx

    def at(share: float) -> None:
        time.sleep(max(0.0, started + share * duration_s - time.monotonic()))

    out: dict = {"paths": {}}
    at(CHANGE_AT["add"])
    out["add_started"] = time.monotonic()
    entry = admin(client, "POST", "/admin/models", json={"name": ADDED, "path": zoo_path(ADDED_ZOO)})
    out["add_returned"] = added = time.monotonic()
    out["add_s"] = added - out["add_started"]
    probe = Outcome()
    with client.stream("POST", "/v1/completions", json={"model": ADDED, "prompt": PROMPTS[0], "max_tokens": 4,
                                                        "temperature": 0, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and probe.read_chunk(json.loads(line[len("data: "):])):
                break
    out["add_to_first_token_s"] = probe.first_token_at - added if probe.first_token_at else None
    out["paths"][entry["fingerprint"]] = entry["path"]

    at(CHANGE_AT["update"])
    out["update_started"] = time.monotonic()
    entry = admin(client, "PUT", f"/admin/models/{UPDATED}", json={"path": zoo_path(UPDATED_ZOO)})
    out["update_s"] = time.monotonic() - out["update_started"]
    out["paths"][entry["fingerprint"]] = entry["path"]

    at(CHANGE_AT["remove"])
    out["remove_started"] = time.monotonic()
    removed = admin(client, "DELETE", f"/admin/models/{REMOVED}", params={"drain_s": drain_s},
                    timeout=httpx.Timeout(drain_s + 120))
    out["remove_s"], out["remove_cut"] = time.monotonic() - out["remove_started"], removed["cut"]
    return out


def run_once(url: str, bodies: list[dict], at: list[float], rate: float, changes: dict | None,
             reference: Reference) -> dict:
    """One run of the load; with `changes` ({duration_s, drain_s}) the catalog changes meanwhile."""
    import httpx

    from load_tests.open_loop import run_open_loop

    with httpx.Client(base_url=url, timeout=120) as client:
        wait_quiet(client)
        before = memory()
        paths = {m["fingerprint"]: m["path"] for m in catalog(client)["models"].values()}
        done: dict = {}
        changer = None
        if changes is not None:
            def change() -> None:
                try:
                    done.update(change_catalog(client, changes["duration_s"], changes["drain_s"], time.monotonic()))
                except Exception as exc:   # reported, and scored as a failed run
                    done["error"] = f"{type(exc).__name__}: {exc}"
            changer = threading.Thread(target=change, name="catalog-changes")
            changer.start()
        outcomes, lag = run_open_loop(url, bodies, rate, at)
        if changer is not None:
            changer.join()
        wait_quiet(client)
        after = memory()
    result = {"changes": changes is not None, "requests": len(bodies), "client": lag,
              "memory_before": before, "memory_after": after, **score_untouched(bodies, outcomes)}
    if changes is not None:
        paths.update(done.pop("paths", {}))
        result.update(done)
        result.update(score_touched(bodies, outcomes, paths, reference, done))
        result.update(untouched_near_changes(bodies, outcomes, done))
    return result


def untouched_near_changes(bodies: list[dict], outcomes: list[Outcome], changes: dict) -> dict:
    """The untouched models' client TTFT p99 of requests waiting for their first token while a
    change call ran, and of the others: where a changes run's TTFT tail comes from."""
    windows = [(changes[f"{kind}_started"], changes[f"{kind}_started"] + changes[f"{kind}_s"])
               for kind in CHANGE_AT if f"{kind}_s" in changes]
    near, away = [], []
    for body, o in zip(bodies, outcomes):
        if body["model"] in UNTOUCHED and o.ok and o.first_token_at is not None:
            during = any(o.sent_at <= end and o.first_token_at >= start for start, end in windows)
            (near if during else away).append(o.first_token_at - o.sent_at)
    return {"untouched_near_changes": len(near), "untouched_near_changes_ttft_p99_s": quantile(near, 0.99),
            "untouched_away_ttft_p99_s": quantile(away, 0.99)}


def score_untouched(bodies: list[dict], outcomes: list[Outcome]) -> dict:
    mine = [o for b, o in zip(bodies, outcomes) if b["model"] in UNTOUCHED]
    ttfts = [o.first_token_at - o.sent_at for o in mine if o.ok and o.first_token_at is not None]
    made = [o.first_token_made - o.sent_wall for o in mine if o.ok and o.first_token_made is not None]
    failed = [o for o in mine if not o.ok]
    return {"untouched_requests": len(mine), "untouched_failures": len(failed),
            "untouched_refused_429": sum(o.status == 429 for o in failed),   # admission under overload
            "untouched_failure_examples": [o.error for o in failed[:3]],
            "untouched_ttft_p50_s": quantile(ttfts, 0.5), "untouched_ttft_p99_s": quantile(ttfts, 0.99),
            "untouched_made_ttft_p99_s": quantile(made, 0.99)}


def score_touched(bodies: list[dict], outcomes: list[Outcome], paths: dict[str, str], reference: Reference,
                  changes: dict) -> dict:
    """Each request of the updated or removed model: exact, an explicit error, or unexplained."""
    verdicts = {"exact": 0, "explicit_error": 0, "unexplained": 0}
    in_flight = dict(verdicts)
    examples = []
    for body, o in zip(bodies, outcomes):
        if body["model"] not in (UPDATED, REMOVED):
            continue
        if o.ok:
            path = paths.get(o.fingerprint or "")
            exact = path is not None and o.token_ids == reference.tokens(path, PROMPTS.index(body["prompt"]),
                                                                       body["max_tokens"])
            verdict = "exact" if exact else "unexplained"
        else:
            explicit = o.error_frame or (400 <= o.status < 500 and bool(o.error))
            verdict = "explicit_error" if explicit else "unexplained"
        verdicts[verdict] += 1
        if verdict == "unexplained" and len(examples) < 3:
            examples.append({"model": body["model"], "status": o.status, "fingerprint": o.fingerprint,
                             "error": o.error})
        change = changes.get("update_started" if body["model"] == UPDATED else "remove_started")
        if change is not None and o.sent_at <= change <= (o.finished_at or change):
            in_flight[verdict] += 1
    return {"touched_requests": sum(verdicts.values()), **{f"touched_{k}": v for k, v in verdicts.items()},
            **{f"in_flight_at_change_{k}": v for k, v in in_flight.items()}, "touched_unexplained_examples": examples}


def restore(url: str) -> None:
    """The catalog back to MODELS' checkpoints (the updated model at a later version), whichever
    of the changes were made."""
    import httpx

    with httpx.Client(base_url=url, timeout=300) as client:
        served = catalog(client)["models"]
        if ADDED in served:
            admin(client, "DELETE", f"/admin/models/{ADDED}")
        if REMOVED not in served:
            admin(client, "POST", "/admin/models", json={"name": REMOVED, "path": zoo_path(MODELS[REMOVED])})
        if served[UPDATED]["path"] != zoo_path(MODELS[UPDATED]):
            admin(client, "PUT", f"/admin/models/{UPDATED}", json={"path": zoo_path(MODELS[UPDATED])})
        wait_quiet(client)


# ---- the bench ------------------------------------------------------------------------------


def run_pairs(url: str, pairs: int, rate: float, duration_s: float, drain_s: float, seed: int) -> dict:
    reference = Reference()
    warm_bodies, warm_at = workload(rate, min(duration_s, 3.0), seed - 1)
    run_once(url, warm_bodies, warm_at, rate, None, reference)   # every model swapped in once
    runs = []
    for i in range(pairs):
        bodies, at = workload(rate, duration_s, seed + i)
        order = ("baseline", "changes") if i % 2 == 0 else ("changes", "baseline")
        pair = {"seed": seed + i, "order": order}
        for kind in order:
            changes = {"duration_s": duration_s, "drain_s": drain_s} if kind == "changes" else None
            pair[kind] = run_once(url, bodies, at, rate, changes, reference)
            if changes is not None:
                restore(url)
        runs.append(pair)
    return summarize(runs)


def summarize(runs: list[dict]) -> dict:
    from load_tests.bench.chaos import floors

    changed = [p["changes"] for p in runs]
    ratios = [p["changes"]["untouched_ttft_p99_s"] / p["baseline"]["untouched_ttft_p99_s"] for p in runs
              if p["changes"]["untouched_ttft_p99_s"] and p["baseline"]["untouched_ttft_p99_s"]]
    firsts = [c.get("add_to_first_token_s") for c in changed]

    def change(c: dict, key: str) -> float:
        before, after = c["memory_before"][key], c["memory_after"][key]
        return abs(after - before) / before if key == "worker_rss_mb" else abs(after - before)

    results = {
        "untouched_failures": sum(c["untouched_failures"] for c in changed),
        "untouched_failures_baseline": sum(p["baseline"]["untouched_failures"] for p in runs),
        "untouched_refused_429": [c["untouched_refused_429"] for c in changed],
        "untouched_refused_429_baseline": [p["baseline"]["untouched_refused_429"] for p in runs],
        "untouched_ttft_p99_s_with_changes": [c["untouched_ttft_p99_s"] for c in changed],
        "untouched_ttft_p99_s_without": [p["baseline"]["untouched_ttft_p99_s"] for p in runs],
        "untouched_ttft_p99_ratios": ratios,
        "untouched_ttft_p99_ratio": statistics.median(ratios) if ratios else None,
        "untouched_ttft_p99_s_near_changes": [c.get("untouched_near_changes_ttft_p99_s") for c in changed],
        "untouched_ttft_p99_s_away_from_changes": [c.get("untouched_away_ttft_p99_s") for c in changed],
        "add_to_first_token_s": None if None in firsts else max(firsts),
        "touched_unexplained": sum(c.get("touched_unexplained", 1) for c in changed),
        "touched_exact": sum(c.get("touched_exact", 0) for c in changed),
        "touched_explicit_error": sum(c.get("touched_explicit_error", 0) for c in changed),
        "in_flight_at_change": {k: sum(c.get(f"in_flight_at_change_{k}", 0) for c in changed)
                                for k in ("exact", "explicit_error", "unexplained")},
        "rss_change_frac": max(change(c, "worker_rss_mb") for c in changed),
        "kv_used_change": max(change(c, "kv_used_frac") for c in changed),
        "change_errors": [c["error"] for c in changed if "error" in c],
        "pairs": runs,
    }
    if results["change_errors"]:   # a change that failed scores nothing as met
        results["add_to_first_token_s"] = None
    results["floors"] = floors(results, FLOORS)
    return results


def bench(pairs: int, rate: float, duration_s: float, drain_s: float, seed: int) -> dict:
    """Start the server, run the pairs, stop it: the results with their floors."""
    import os

    from deploy.local import run_local
    from load_tests.bench.chaos import free_port

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    models = {name: zoo_path(zoo) for name, zoo in MODELS.items()}
    t0 = time.monotonic()
    with run_local(models, port=free_port(), host="127.0.0.1", app_name=APP, **SERVER_ARGS) as url:
        results = run_pairs(url, pairs, rate, duration_s, drain_s, seed)
    settings = {"pairs": pairs, "rate": rate, "duration_s": duration_s, "drain_s": drain_s, "seed": seed,
                "models": MODELS, "added": [ADDED, ADDED_ZOO], "updated": [UPDATED, UPDATED_ZOO],
                "removed": REMOVED, "server": SERVER_ARGS, "wall_s": time.monotonic() - t0}
    return {"settings": settings, **results}


def run(args: argparse.Namespace) -> int:
    from load_tests.provenance import provenance

    if args.pairs < 1 or not args.rate > 0 or not args.duration_s >= 2 or args.drain_s < 0:
        raise ValueError("--pairs must be >= 1, --rate > 0, --duration-s >= 2 and --drain-s >= 0")
    prov = provenance()
    results = {"provenance": prov, **bench(args.pairs, args.rate, args.duration_s, args.drain_s, args.seed)}
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if all(v["met"] for v in results["floors"].values()) else 1
