"""`tokenmux bench cluster`: what the cluster layer adds to a request.

    router_overhead_ms     p50 of (router.pick + worker.generate) minus p50 of worker.generate
                           alone, same run, same worker, tiny model, max_tokens=1, interleaved
    handoff_vs_copy_small  one KV handoff of 512 tokens of llama-100m (14 MiB) / one memcpy
    handoff_vs_copy_large  the same for 2,048 tokens of an 8B-shaped KV (32 layers x 8 KV heads
                           x 128, bf16: 256 MiB, Llama-3-8B's KV shape)
    ray_round_trip_ms      beside each: one empty actor call sender -> receiver -> sender, the
                           Ray latency every handoff pays once on top of its copy

A handoff is timed as a prefill worker sees it, through the code a worker runs
(actors/kv_transfer.py KVTransfers, actors/frame_stream.py) and its protocol
(actors/handoff.py): export of the request's blocks from the sender's pool, the descriptor
riding on the one dispatch to the receiver (`adopt_prefilled`, answering the HandoffAck),
the receiver's import into its pool on a thread of its own (a worker imports on its engine
thread), the ack back, the frame stream opened (`generate_prefilled`; in serving the caller
opens it when the prefill worker's last frame names the receiver, here the sender makes that
one call), release on the sender. The copy it is divided by is one memcpy of
the same bytes (contiguous to contiguous, same thread count) in the receiver's process,
timed in the same iteration; iterations alternate which goes first. Each ratio is
median(handoff) / median(copy), with a 95% bootstrap interval (2,000 resamples of the
iteration pairs, seed 0). Blocks are scattered, as in a live pool: the sender's are every
other block, the receiver's every other block in reverse, so no two are adjacent.

Three transports per shape: same node from a pool in a shared region (zero copy out, what
a CPU worker with shared_kv does: the figure the floors are for), same node from a private
pool (staged: two copies), and, for the small shape, the object store between two raylets
of one machine (cross node). The run starts its own `ray.cluster_utils.Cluster` (2 raylets
x 1 virtual GPU), so it needs no running Ray. Floors (issue 9): router_overhead_ms <= 5,
handoff_vs_copy_small <= 3, handoff_vs_copy_large <= 1.5.
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
HANDOFF_MODEL = "llama-100m"
ROUTER_MODEL = "llama-tiny-a"
ENGINE = {"budget_bytes": 48 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 512 * 1024,
          "host_kv_bytes": 0}
# name -> KV tokens and layout (None: the zoo checkpoint's own)
SHAPES = {
    "small": {"tokens": 512, "model": HANDOFF_MODEL, "layout": None},
    "large": {"tokens": 2048, "model": "8b-shaped", "layout": {"layers": 32, "kv_heads": 8, "head_dim": 128,
                                                               "dtype": "bfloat16"}},
}
FLOORS = {"router_overhead_ms": 5.0, "handoff_vs_copy_small": 3.0, "handoff_vs_copy_large": 1.5}
ACK_TIMEOUT_S = 60.0
WARMUP = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON to FILE")
    parser.add_argument("--iters", type=int, default=40, help="measured iterations per figure (default 40)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per actor (default 1)")


def _layout(shape: dict) -> dict:
    if shape["layout"] is not None:
        return dict(shape["layout"])
    from actors.model_spec import ModelSpec
    from actors.zoo.zoo import ensure_model

    spec = ModelSpec.from_dir(ensure_model(shape["model"]))
    return {"layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "dtype": spec.torch_dtype}


class KVEndpoint:
    """One side of a handoff in its own actor: a KV pool of one layout and the worker's KVTransfers."""

    def __init__(self, name: str, node_id: str, layout: dict, tokens: int, shared: bool, threads: int):
        import torch

        from actors.kv_transfer import KVTransfers

        torch.set_num_threads(threads)
        self.model, self.tokens = f"{layout['layers']}x{layout['kv_heads']}x{layout['head_dim']}", tokens
        self.num_blocks = -(-tokens // 16)
        dtype = getattr(torch, layout["dtype"])
        block = (layout["layers"], 2, 16, layout["kv_heads"], layout["head_dim"])   # [L, 2, 16, H, D]
        pool_blocks = 2 * self.num_blocks          # room for every-other-block placements
        nbytes = pool_blocks * dtype.itemsize * layout["layers"] * 2 * 16 * layout["kv_heads"] * layout["head_dim"]
        self.transfers = KVTransfers(name, node_id, "cpu")
        buf = self.transfers.shared_kv_region(nbytes) if shared else torch.zeros(nbytes, dtype=torch.uint8)
        self.view = buf.view(dtype).view(1, pool_blocks, *block)   # one slab: [1, pool_blocks, L, 2, 16, H, D]
        self.view.normal_()
        # The memcpy a handoff is compared with: the same bytes, contiguous, pages touched.
        self.copy_src = self.view[0, :self.num_blocks].clone()
        self.copy_dst = torch.empty_like(self.copy_src).fill_(0)
        self.last_import_s = 0.0
        self.adopted: dict[str, asyncio.Event] = {}   # request id -> set once its KV is in

    def kv_bytes(self) -> int:
        return self.copy_src.numel() * self.copy_src.element_size()

    async def handoff(self, request_id: str, src_ids: list[int], dst, dst_ids: list[int], dst_node: str) -> dict:
        """Export, dispatch with the descriptor, wait for the ack, release: as HandoffRelay does."""
        from actors.frame_stream import stream_frames
        from actors.kv_pool import KVBlocks

        start = time.perf_counter()
        desc = self.transfers.export(request_id, self.model, KVBlocks(self.view, tuple(src_ids)), self.tokens,
                                     dst_node)
        export_s = time.perf_counter() - start
        ack = await asyncio.wait_for(dst.receive.remote(desc, dst_ids), ACK_TIMEOUT_S)
        async with stream_frames(dst.frames.remote(request_id)) as stream:   # opened at the ack, as a worker does
            self.transfers.release(desc)
            total_s = time.perf_counter() - start
            async for _ in stream:   # a worker's stream goes on with frames; this one ends at once
                pass
        if not ack.adopted:
            raise RuntimeError(f"handoff {request_id} was refused: {ack.error}")
        return {"total_s": total_s, "export_s": export_s, "transport": desc.transport}

    async def receive(self, desc, dst_ids: list[int]):
        """The receiving end (`adopt_prefilled`): import into the pool off the event loop, then the ack."""
        from actors.kv_pool import KVBlocks
        from scheduler.messages import HandoffAck

        start = time.perf_counter()
        await asyncio.to_thread(self.transfers.import_, desc, KVBlocks(self.view, tuple(dst_ids)))
        self.last_import_s = time.perf_counter() - start
        self._adopted(desc.request_id).set()
        return HandoffAck(True)

    async def frames(self, request_id: str):
        """The stream a sender opens at the ack (`generate_prefilled`): here one final frame."""
        from scheduler.messages import FINISH_LENGTH, OutputFrame

        await self._adopted(request_id).wait()
        del self.adopted[request_id]
        yield OutputFrame(request_id, finish_reason=FINISH_LENGTH)

    def _adopted(self, request_id: str) -> asyncio.Event:
        return self.adopted.setdefault(request_id, asyncio.Event())

    def import_s(self) -> float:
        return self.last_import_s

    async def round_trip_s(self, dst) -> float:
        """One empty actor call to the receiver and back: the Ray latency inside every handoff."""
        start = time.perf_counter()
        await dst.ping.remote()
        return time.perf_counter() - start

    async def ping(self) -> None:
        return None

    def copy_s(self) -> float:
        start = time.perf_counter()
        self.copy_dst.copy_(self.copy_src)
        return time.perf_counter() - start

    def checksum(self, ids: list[int]) -> float:
        import torch

        return float(self.view[0, ids].to(torch.float64).sum())

    def close(self) -> None:
        self.transfers.close()


def _ms(xs) -> float:
    return 1e3 * statistics.median(xs)


def ratio_ci(num: list[float], den: list[float], seed: int = 0, reps: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of median(num) / median(den), resampling the (num, den) pairs."""
    from load_tests.stats import bootstrap_ci

    return bootstrap_ci(list(zip(num, den)), lambda pairs: statistics.median(n for n, _ in pairs)
                        / statistics.median(d for _, d in pairs), seed, reps)


def bench_handoff(ray, src, dst, dst_node: str, num_blocks: int, iters: int) -> dict:
    src_ids = list(range(1, 2 * num_blocks, 2))             # scattered, as in a live pool
    dst_ids = list(range(2 * num_blocks - 2, -1, -2))
    handoff, transfer, copy, rtt = [], [], [], []
    transport = None
    for i in range(iters + WARMUP):
        first_copy = i % 2 == 1
        c = ray.get(dst.copy_s.remote()) if first_copy else None
        r = ray.get(src.handoff.remote(f"h{i}", src_ids, dst, dst_ids, dst_node))
        import_s = ray.get(dst.import_s.remote())
        if not first_copy:
            c = ray.get(dst.copy_s.remote())
        t = ray.get(src.round_trip_s.remote(dst))
        if i >= WARMUP:
            handoff.append(r["total_s"])
            transfer.append(r["export_s"] + import_s)
            copy.append(c)
            rtt.append(t)
        transport = r["transport"]
    same = abs(ray.get(dst.checksum.remote(dst_ids)) - ray.get(src.checksum.remote(src_ids))) < 1e-6 * max(
        1.0, abs(ray.get(src.checksum.remote(src_ids))))
    lo, hi = ratio_ci(handoff, copy)
    return {"transport": transport, "handoff_ms": _ms(handoff), "handoff_transfer_ms": _ms(transfer),
            "copy_ms": _ms(copy), "handoff_vs_copy": statistics.median(handoff) / statistics.median(copy),
            "handoff_vs_copy_ci95": [lo, hi],
            "transfer_vs_copy": statistics.median(transfer) / statistics.median(copy),
            "ray_round_trip_ms": _ms(rtt), "bytes_equal": same}


async def _router_overhead(worker, router, iters: int) -> dict:
    from actors.frame_stream import stream_frames
    from scheduler.messages import GenerateRequest
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True)

    async def consume(handle, req) -> None:
        async with stream_frames(handle.generate.remote(req)) as frames:
            async for _ in frames:
                pass

    async def direct(i):
        await consume(worker, GenerateRequest(f"d{i}", ROUTER_MODEL, (5, 6, 7, 8), params))

    async def routed(i):
        picked = await router.pick.remote(ROUTER_MODEL)
        wid, handle = picked.worker_id, picked.handle
        await consume(handle, GenerateRequest(f"r{i}", ROUTER_MODEL, (5, 6, 7, 8), params))
        return wid

    d_times, r_times = [], []
    for i in range(iters + 5):
        for fn, acc in ((direct, d_times), (routed, r_times)) if i % 2 else ((routed, r_times), (direct, d_times)):
            start = time.perf_counter()
            wid = await fn(i)
            acc.append(time.perf_counter() - start)
            if wid is not None:   # release is after the last frame: not on the caller's path
                await router.release.remote(wid, ROUTER_MODEL)
    d, r = _ms(d_times[5:]), _ms(r_times[5:])
    return {"direct_ms": d, "routed_ms": r, "router_overhead_ms": r - d}


def _handoffs(ray, pin, head: str, other: str, args) -> dict:
    Endpoint = ray.remote(num_cpus=0)(KVEndpoint)
    out = {}
    for name, shape in SHAPES.items():
        layout = _layout(shape)
        make = lambda who, node, shared: Endpoint.options(scheduling_strategy=pin(node)).remote(   # noqa: E731
            f"{name}-{who}", node, layout, shape["tokens"], shared, args.threads)
        ends = {"shared_src": make("src", head, True), "private_src": make("psrc", head, False),
                "near": make("dst", head, False)}
        if name == "small":   # 14 MiB through the object store; the 256 MiB one would not fit it here
            ends["far"] = make("far", other, False)
        try:
            num_blocks = -(-shape["tokens"] // 16)
            r = {"kv_tokens": shape["tokens"], "model": shape["model"], "layout": layout,
                 "kv_bytes": ray.get(ends["near"].kv_bytes.remote())}
            runs = [("same_node_shm_zero_copy", "shared_src", "near", head),
                    ("same_node_shm_staged", "private_src", "near", head)]
            if "far" in ends:
                runs.append(("cross_node_object_store", "shared_src", "far", other))
            for label, src, dst, node in runs:
                r[label] = bench_handoff(ray, ends[src], ends[dst], node, num_blocks, args.iters)
            out[name] = r
        finally:
            ray.wait([e.close.remote() for e in ends.values()], num_returns=len(ends), timeout=10)
            for e in ends.values():
                ray.kill(e)
    return out


def run(args: argparse.Namespace) -> int:
    if args.iters < 5:
        raise ValueError(f"--iters must be >= 5, got {args.iters}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from actors.engine import EngineConfig
    from actors.worker import DeviceWorker
    from cluster.router import GlobalRouter
    from actors.zoo.zoo import ensure_model

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
    results: dict = {"iters": args.iters, "threads": args.threads, "warmup": WARMUP,
                     "measure": "median(handoff) / median(memcpy of the same bytes), interleaved pairs; "
                                "95% bootstrap CI, seed 0"}
    actors = []
    try:
        head = ray.get_runtime_context().get_node_id()
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        pin = lambda n: NodeAffinitySchedulingStrategy(n, soft=False)   # noqa: E731

        worker = ray.remote(DeviceWorker).options(num_gpus=1, num_cpus=0, scheduling_strategy=pin(head)).remote(
            "w0", EngineConfig(**ENGINE), num_threads=args.threads, node_id=head)
        router = GlobalRouter.options(scheduling_strategy=pin(head)).remote(poll_interval_s=0.5)
        actors += [worker, router]
        ray.get(worker.register_model.remote(ROUTER_MODEL, tiny))
        ray.get(router.add_worker.remote("w0", worker, head))
        results.update(asyncio.run(_router_overhead(worker, router, args.iters)))
        ray.wait([worker.close.remote()], timeout=10)
        results.update(_handoffs(ray, pin, head, other, args))
        for name in SHAPES:
            same = results[name]["same_node_shm_zero_copy"]
            results[f"handoff_vs_copy_{name}"] = same["handoff_vs_copy"]
            results[f"handoff_vs_copy_{name}_ci95"] = same["handoff_vs_copy_ci95"]
        results["floors"] = {k: {"floor": f, "met": results[k] <= f} for k, f in FLOORS.items()}
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


def _print(r: dict) -> None:
    out = sys.stdout
    print(f"router_overhead_ms   {r['router_overhead_ms']:.2f}  (direct {r['direct_ms']:.2f}, routed "
          f"{r['routed_ms']:.2f}; floor <= {FLOORS['router_overhead_ms']})", file=out)
    for name in SHAPES:
        s = r[name]
        print(f"handoff of {s['kv_tokens']} tokens of {s['model']} ({s['kv_bytes'] / MiB:.1f} MiB); "
              f"handoff_vs_copy_{name} {r[f'handoff_vs_copy_{name}']:.2f} "
              f"(95% CI {r[f'handoff_vs_copy_{name}_ci95'][0]:.2f}-{r[f'handoff_vs_copy_{name}_ci95'][1]:.2f}; "
              f"floor <= {FLOORS[f'handoff_vs_copy_{name}']})", file=out)
        for label in ("same_node_shm_zero_copy", "same_node_shm_staged", "cross_node_object_store"):
            if label not in s:
                continue
            x = s[label]
            print(f"  {label:<26} handoff {x['handoff_ms']:7.2f} ms ({x['handoff_vs_copy']:.2f}x copy "
                  f"{x['copy_ms']:.2f} ms)  transfer {x['handoff_transfer_ms']:7.2f} ms "
                  f"({x['transfer_vs_copy']:.2f}x)  empty Ray round trip {x['ray_round_trip_ms']:.2f} ms  "
                  f"bytes equal: {x['bytes_equal']}", file=out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
