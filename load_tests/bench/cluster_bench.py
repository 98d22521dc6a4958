"""`tokenmux bench cluster`: what the cluster layer adds to a request.

    router_overhead_ms   p50 of (router.pick + worker.generate) minus p50 of worker.generate
                         alone, same run, same worker, tiny model, max_tokens=1, interleaved
    handoff_ms           p50 of one KV handoff of a 512-token KV of llama-100m, end to end as a
                         prefill worker sees it: export on the sender, the descriptor to the
                         receiver, import into the receiver's pool, release (Ray calls included)
    handoff_transfer_ms  the same without the Ray calls: export + import time inside the actors
    handoff_copy_limit_ms  one memcpy of the same bytes in one process, same thread count
    handoff_vs_copy      handoff_ms / handoff_copy_limit_ms (and transfer_vs_copy)

for three transports: same-node shm from a pool in a shared region (zero copy out, what a
CPU worker with shared_kv does), same-node shm from a private pool (staged: two copies),
and the object store between two raylets of one machine (cross-node). The run starts its
own `ray.cluster_utils.Cluster` (2 raylets x 1 virtual GPU), so it needs no running Ray.
Floors (issue 4): router_overhead_ms <= 5, handoff_vs_copy <= 1.5 for the same-node transport.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time

logger = logging.getLogger(__name__)

MiB = 1 << 20
KV_TOKENS = 512
HANDOFF_MODEL = "llama-100m"
ROUTER_MODEL = "llama-tiny-a"
ENGINE = {"budget_bytes": 48 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 512 * 1024,
          "host_kv_bytes": 0}
FLOORS = {"router_overhead_ms": 5.0, "handoff_vs_copy": 1.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--iters", type=int, default=40, help="measured iterations per figure (default 40)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per actor (default 1)")


class KVEndpoint:
    """A KV pool of llama-100m's block shape in one actor, and its handoff transports."""

    def __init__(self, name: str, node_id: str, pool_blocks: int, shared: bool, threads: int):
        import torch

        from actors.handoff import KVHandoff
        from actors.model_spec import ModelSpec
        from load_tests.zoo import ensure_model

        torch.set_num_threads(threads)
        spec = ModelSpec.from_dir(ensure_model(HANDOFF_MODEL))
        self.spec = spec
        self.dtype = getattr(torch, spec.torch_dtype)
        self.block_shape = (spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim)   # [L, 2, 16, H, D]
        block_bytes = self.dtype.itemsize
        for d in self.block_shape:
            block_bytes *= d
        self.handoff = KVHandoff(name, node_id, "cpu")
        nbytes = pool_blocks * block_bytes
        buf = self.handoff.shared_kv_region(nbytes) if shared else torch.zeros(nbytes, dtype=torch.uint8)
        self.grid = buf.view(self.dtype).view(pool_blocks, *self.block_shape)   # [pool_blocks, L, 2, 16, H, D]
        self.grid.normal_()

    def export(self, transport: str, request_id: str, block_ids: list[int]):
        from actors.kv_transfer import KVDescriptor

        start = time.perf_counter()
        desc = KVDescriptor(request_id, HANDOFF_MODEL, self.spec.num_layers, self.spec.num_kv_heads,
                            self.spec.head_dim, str(self.dtype).removeprefix("torch."), tuple(block_ids), KV_TOKENS)
        desc = self.handoff.transport(transport).export(self.grid, desc, from_pool=True)
        return desc, time.perf_counter() - start

    def import_(self, desc, dst_ids: list[int]) -> tuple[float, float]:
        start = time.perf_counter()
        self.handoff.transport(desc.transport).import_(desc, out=self.grid, dst_block_ids=dst_ids)
        return time.perf_counter() - start, float(self.grid[dst_ids[0]].sum())

    def checksum(self, ids: list[int]) -> float:
        return float(self.grid[ids[0]].sum())

    def release(self, desc) -> None:
        self.handoff.transport(desc.transport).release(desc)

    def copy_limit_s(self, num_blocks: int, iters: int) -> float:
        """p50 of one contiguous memcpy of num_blocks blocks (the floor any handoff pays once)."""
        src = self.grid[:num_blocks].clone()
        dst = self.grid[-num_blocks:].clone()
        times = []
        for _ in range(iters + 3):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:])

    def close(self) -> None:
        self.handoff.close()


def _p50_ms(xs) -> float:
    return 1e3 * statistics.median(xs)


def bench_handoff(ray, src, dst, transport: str, iters: int) -> dict:
    num_blocks = KV_TOKENS // 16
    src_ids = list(range(1, 2 * num_blocks, 2))             # scattered, as in a live pool
    dst_ids = list(range(2 * num_blocks - 2, -1, -2))
    total, inside = [], []
    for i in range(iters + 3):
        start = time.perf_counter()
        desc, export_s = ray.get(src.export.remote(transport, f"h{i}", src_ids))
        import_s, check = ray.get(dst.import_.remote(desc, dst_ids))
        ray.get(src.release.remote(desc))
        total.append(time.perf_counter() - start)
        inside.append(export_s + import_s)
        del desc
    same = abs(check - ray.get(src.checksum.remote(src_ids[:1]))) < 1e-3 * max(1.0, abs(check))
    return {"handoff_ms": _p50_ms(total[3:]), "handoff_transfer_ms": _p50_ms(inside[3:]), "bytes_equal": same}


async def _router_overhead(worker, router, iters: int) -> dict:
    from scheduler.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)

    async def direct(i):
        req = GenerateRequest(f"d{i}", ROUTER_MODEL, (5, 6, 7, 8), params)
        async for ref in worker.generate.remote(req.to_dict()):
            await ref

    async def routed(i):
        wid, handle = await router.pick.remote(ROUTER_MODEL)
        req = GenerateRequest(f"r{i}", ROUTER_MODEL, (5, 6, 7, 8), params)
        async for ref in handle.generate.remote(req.to_dict()):
            await ref
        return wid

    d_times, r_times = [], []
    for i in range(iters + 5):
        for fn, acc in ((direct, d_times), (routed, r_times)) if i % 2 else ((routed, r_times), (direct, d_times)):
            start = time.perf_counter()
            wid = await fn(i)
            acc.append(time.perf_counter() - start)
            if wid is not None:   # release is after the last frame: not on the caller's path
                await router.release.remote(wid, ROUTER_MODEL)
    d, r = _p50_ms(d_times[5:]), _p50_ms(r_times[5:])
    return {"direct_ms": d, "routed_ms": r, "router_overhead_ms": r - d}


def run(args: argparse.Namespace) -> int:
    if args.iters < 5:
        raise ValueError(f"--iters must be >= 5, got {args.iters}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster.router import GlobalRouter
    from actors.worker import DeviceWorker
    from load_tests.zoo import ensure_model

    if ray.is_initialized():
        raise ValueError("bench cluster starts its own 2-raylet cluster; run it in a fresh process")
    ensure_model(HANDOFF_MODEL)
    tiny = str(ensure_model(ROUTER_MODEL))
    temp_dir = tempfile.mkdtemp(prefix="tmb", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp_dir
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    node = {"num_cpus": 2, "num_gpus": 1, "object_store_memory": 200 * MiB}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "temp_dir": temp_dir})
    cluster.add_node(**node)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    results: dict = {"kv_tokens": KV_TOKENS, "model": HANDOFF_MODEL, "iters": args.iters, "threads": args.threads}
    actors = []
    try:
        head = ray.get_runtime_context().get_node_id()
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        pin = lambda n: NodeAffinitySchedulingStrategy(n, soft=False)   # noqa: E731

        worker = ray.remote(DeviceWorker).options(num_gpus=1, num_cpus=0, scheduling_strategy=pin(head)).remote(
            "w0", ENGINE, num_threads=args.threads, node_id=head)
        router = GlobalRouter.options(scheduling_strategy=pin(head)).remote(poll_interval_s=0.5)
        actors += [worker, router]
        ray.get(worker.register_model.remote(ROUTER_MODEL, tiny))
        ray.get(router.add_worker.remote("w0", worker, head))
        results.update(asyncio.run(_router_overhead(worker, router, args.iters)))

        Endpoint = ray.remote(num_cpus=0)(KVEndpoint)
        blocks = 4 * KV_TOKENS // 16
        shared_src = Endpoint.options(scheduling_strategy=pin(head)).remote("src", head, blocks, True, args.threads)
        private_src = Endpoint.options(scheduling_strategy=pin(head)).remote("psrc", head, blocks, False, args.threads)
        near = Endpoint.options(scheduling_strategy=pin(head)).remote("dst", head, blocks, False, args.threads)
        far = Endpoint.options(scheduling_strategy=pin(other)).remote("far", other, blocks, False, args.threads)
        actors += [shared_src, private_src, near, far]
        limit_ms = 1e3 * ray.get(near.copy_limit_s.remote(KV_TOKENS // 16, args.iters))
        results["handoff_copy_limit_ms"] = limit_ms
        results["kv_bytes"] = _kv_bytes(ensure_model(HANDOFF_MODEL))
        for name, src, dst, transport in (("same_node_shm_zero_copy", shared_src, near, "shm"),
                                          ("same_node_shm_staged", private_src, near, "shm"),
                                          ("cross_node_object_store", shared_src, far, "object_store")):
            r = bench_handoff(ray, src, dst, transport, args.iters)
            r["handoff_vs_copy"] = r["handoff_ms"] / limit_ms
            r["transfer_vs_copy"] = r["handoff_transfer_ms"] / limit_ms
            results[name] = r
        same = results["same_node_shm_zero_copy"]
        results["handoff_ms"] = same["handoff_ms"]
        results["handoff_vs_copy"] = same["handoff_vs_copy"]
        results["floors"] = {"router_overhead_ms": {"floor": FLOORS["router_overhead_ms"],
                                                    "met": results["router_overhead_ms"] <= FLOORS["router_overhead_ms"]},
                             "handoff_vs_copy": {"floor": FLOORS["handoff_vs_copy"],
                                                 "met": results["handoff_vs_copy"] <= FLOORS["handoff_vs_copy"]}}
        closing = [a.close.remote() for a in (worker, shared_src, private_src, near, far)]
        ray.wait(closing, num_returns=len(closing), timeout=10)   # unlink shared KV files
    finally:
        for a in actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        ray.shutdown()
        cluster.shutdown()
        from cluster.topology import sweep_stale_kv_files

        sweep_stale_kv_files()
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _kv_bytes(path) -> int:
    from actors.model_spec import ModelSpec

    spec = ModelSpec.from_dir(path)
    return KV_TOKENS * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * spec.dtype_bytes


def _print(r: dict) -> None:
    out = sys.stdout
    print(f"router_overhead_ms   {r['router_overhead_ms']:.2f}  (direct {r['direct_ms']:.2f}, routed "
          f"{r['routed_ms']:.2f}; floor <= {FLOORS['router_overhead_ms']})", file=out)
    print(f"handoff of {r['kv_tokens']} tokens of {r['model']} ({r['kv_bytes'] / MiB:.1f} MiB); "
          f"copy limit {r['handoff_copy_limit_ms']:.2f} ms", file=out)
    for name in ("same_node_shm_zero_copy", "same_node_shm_staged", "cross_node_object_store"):
        x = r[name]
        print(f"  {name:<26} handoff {x['handoff_ms']:7.2f} ms ({x['handoff_vs_copy']:.2f}x copy)  "
              f"transfer {x['handoff_transfer_ms']:7.2f} ms ({x['transfer_vs_copy']:.2f}x)  "
              f"bytes equal: {x['bytes_equal']}", file=out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
