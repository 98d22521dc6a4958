"""The Ray Serve multiplexing peer: real transformers models, real Serve routing and LRU swaps."""
import asyncio
import time
from collections import defaultdict

import pytest

from cluster.planner.workloads import FixedLengths, Poisson, Uniform, generate
from load_tests.driver import run
from load_tests.peers.serve_multiplexed import MultiplexedTarget, build_multiplexed_app, start_multiplexed
from tests.greedy_reference import hf_greedy
from tests.polling import wait_until

MODELS = ("llama-tiny-a", "qwen2-tiny-b", "mistral-tiny-c")
MAX_NEW = 8


@pytest.fixture(scope="module")
def paths(zoo_model):
    return {name: str(zoo_model(name)) for name in MODELS}


@pytest.fixture(scope="module")
def peer(ray_session, paths):
    target, shutdown = start_multiplexed(paths, num_replicas=2, max_models_per_replica=1,
                                         threads_per_replica=1, app_name="multiplexed-peer-test")
    yield target
    shutdown()


async def collect(target, model, prompt, max_tokens, request_id):
    sent = time.time()
    ids, times, finish = [], [], None
    async for frame in target.stream(model, prompt, max_tokens, request_id):
        assert frame.error is None, frame.error
        ids += frame.token_ids
        times += frame.token_times
        finish = frame.finish_reason or finish
    return sent, ids, times, finish


def test_greedy_tokens_match_hf_and_replicas_swap_models(peer, paths):
    greedy = MultiplexedTarget(peer.handle, ignore_eos=False)  # stop at EOS as generate() does
    prompts = {(m, k): [3 + 17 * k + 5 * i for i in range(6 + k)]
               for m in MODELS for k in range(2)}

    async def main():
        return await asyncio.gather(*(collect(greedy, m, p, MAX_NEW, f"{m}-{k}")
                                      for (m, k), p in prompts.items()))

    results = asyncio.run(main())
    for ((model, _), prompt), (sent, ids, times, finish) in zip(prompts.items(), results):
        assert ids == hf_greedy(paths[model], prompt, MAX_NEW), model
        assert finish in ("stop", "length")
        assert len(times) == len(ids)
        assert sent < times[0] and all(a < b for a, b in zip(times, times[1:]))

    # 3 models on 2 replicas that hold 1 model each: some replica had to swap.
    loads = defaultdict(list)
    for _, model, replica, load_s in greedy.placements:
        if load_s is not None:
            loads[replica].append(model)
    assert len({r for _, _, r, _ in greedy.placements}) <= 2  # num_replicas
    assert set().union(*loads.values()) == set(MODELS)
    assert max(len(v) for v in loads.values()) >= 2
    for replica in loads:  # consecutive loads on one replica are of different models
        assert all(a != b for a, b in zip(loads[replica], loads[replica][1:]))


def test_driver_run_through_the_target(peer):
    workload = generate(Poisson(rate=20.0), Uniform(), list(MODELS), FixedLengths(6, 5),
                        seed=0, num_requests=8)
    records = asyncio.run(run(peer, workload, vocab_size=2048, request_timeout_s=30.0))
    assert len(records) == 8
    for rec, req in zip(records, workload):
        assert rec.ok, rec.error
        assert rec.num_output_tokens == req.output_len  # ignore_eos: the trace's length
        assert rec.worker_id and rec.num_prompt_tokens == 6
        # client-observed times: tokens that arrive in one chunk share a time (a gap of 0; a
        # tiny model's 5 tokens often come as one chunk), and none is seen before the replica
        # stamped it (same host clock; 1 ms for the two clocks' mapping)
        assert rec.arrival < rec.token_times[0] and rec.tbts and min(rec.tbts) >= 0
        assert len(rec.server_token_times) == len(rec.token_times)
        assert all(b > a for a, b in zip(rec.server_token_times, rec.server_token_times[1:]))
        assert all(c >= s - 1e-3 for c, s in zip(rec.token_times, rec.server_token_times))


async def _replica_stats(peer, replica_id: str) -> dict:
    """stats() of one replica: asked through the handle until that replica answers (Serve picks one)."""
    for _ in range(100):
        stats = await peer.handle.stats.remote()
        if stats["replica_id"] == replica_id:
            return stats
    raise AssertionError(f"replica {replica_id} never answered stats()")


def test_abandoned_request_frees_its_replica(peer):
    MAX_TOKENS = 4000   # the abandoned request's: ~10 s of decoding if it were left running

    async def main():
        agen = peer.stream(MODELS[0], [5, 6, 7], MAX_TOKENS, "abandoned")
        first = await agen.__anext__()
        before = (await _replica_stats(peer, first.worker_id))["num_decoded"] - len(first.token_ids)
        await agen.aclose()
        _, ids, _, _ = await collect(peer, MODELS[0], [5, 6, 7], 4, "next")
        return first, ids, before

    first, ids, before = asyncio.run(main())
    assert first.token_ids and len(ids) == 4
    replica = lambda: asyncio.run(_replica_stats(peer, first.worker_id))   # noqa: E731
    wait_until(lambda: replica()["num_decoding"] == 0, timeout_s=120,
               what="the abandoned request's replica to stop decoding")
    # left running it would have decoded all its tokens: it stopped when its client left
    assert replica()["num_decoded"] - before < MAX_TOKENS


def test_sampling_is_seeded(peer):
    async def sample(seed):
        gen = peer.handle.options(multiplexed_model_id=MODELS[1], stream=True).generate.remote(
            [9, 8, 7, 6], 12, True, 1.5, seed)
        return [t async for frame in gen for t in frame["token_ids"]]

    async def main():
        return await sample(1), await sample(1), await sample(2)

    a, b, c = asyncio.run(main())
    assert len(a) == 12 and all(0 <= t < 2048 for t in a)
    assert a == b and a != c


def test_unknown_model_is_an_error_in_the_stream(peer):
    async def main():
        return [f async for f in peer.stream("no-such-model", [1, 2, 3], 4, "bad")]

    frames = asyncio.run(main())
    assert frames[-1].finish_reason == "error" and "no-such-model" in frames[-1].error


def test_bad_build_arguments_are_named(paths, tmp_path):
    with pytest.raises(ValueError, match="no checkpoint"):
        build_multiplexed_app({"x": str(tmp_path)}, 1, 1, 1)
    with pytest.raises(ValueError, match="max_models_per_replica"):
        build_multiplexed_app(paths, 1, 0, 1)
    with pytest.raises(ValueError, match="num_replicas"):
        build_multiplexed_app(paths, 0, 1, 1)
    with pytest.raises(ValueError, match="at least one model"):
        build_multiplexed_app({}, 1, 1, 1)
