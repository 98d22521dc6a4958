"""KV handoff between a prefill and a decode worker: decode output after a handoff equals
single-worker greedy output (zero-copy shared pool, staged copy, pools whose slabs have a
tail), a failed import recomputes, a held request can continue locally, and through real
DeviceWorker actors the caller keeps one stream, read from the decode worker directly after the
handoff, while a dead decode worker loses nothing."""
from __future__ import annotations

import asyncio
import os

import pytest

from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams
from tests.greedy_reference import hf_greedy

MiB = 1 << 20
MODEL = "llama-tiny-a"    # 2 layers x 4 kv heads x 32 x fp32: a KV block is 32 KiB
ENGINE = {"budget_bytes": 48 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 512 * 1024,
          "host_kv_bytes": 4 * MiB}
PROMPT = [11, 400, 77, 1234, 9, 18, 600, 5, 42, 300, 17, 88, 1500, 3, 71, 20, 19, 33, 1200, 7]   # 2 blocks
MAX_TOKENS = 24
LONG = 400   # a request long enough to kill a worker while it decodes


def _engine(path, kv_buffer=None, **overrides):
    from actors.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(**{**ENGINE, **overrides}), kv_buffer=kv_buffer)
    engine.register_model(MODEL, path)
    return engine


def _run(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for frame in engine.step():
            tokens.setdefault(frame.request_id, []).extend(frame.token_ids)
    return tokens


def _request(rid="r", max_tokens=MAX_TOKENS):
    return GenerateRequest(rid, MODEL, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture(scope="module")
def path(zoo_model):
    return zoo_model(MODEL)


@pytest.fixture(scope="module")
def reference(path):
    engine = _engine(path)
    engine.add_request(_request())
    return _run(engine)["r"]


def _prefill(handoff, engine, steps=1):
    engine.add_request(_request())
    first = []
    for _ in range(steps):
        first += [t for f in engine.step() for t in f.token_ids]
    return first, handoff.detach_and_export("r", handoff.transfers.node_id)


def _ends(sender, receiver=None, shared=False):
    """The engine-thread handoff of a sender (and a receiver) on one node, over their own transfers."""
    from actors.handoff import KVHandoff
    from actors.kv_transfer import KVTransfers

    src_t, dst_t = KVTransfers("p", "node", "cpu"), KVTransfers("d", "node", "cpu")
    engine = sender(src_t.shared_kv_region(ENGINE["kv_bytes"]) if shared else None)
    ends = [KVHandoff(engine, src_t)] + ([KVHandoff(receiver(), dst_t)] if receiver else [])
    return ends, (src_t, dst_t)


@pytest.mark.parametrize("shared,overrides", [(True, {}), (False, {}), (False, {"slab_bytes": 500 * 1024})],
                         ids=["zero-copy", "staged", "slab-tail"])
def test_decode_after_shm_handoff_equals_single_worker_greedy(path, reference, shared, overrides):
    (src, dst), transfers = _ends(lambda buf: _engine(path, buf, **overrides), lambda: _engine(path, **overrides),
                                  shared)
    sender, receiver = src.engine, dst.engine
    try:
        first, (state, desc) = _prefill(src, sender, steps=2)   # a decode step before the handoff, too
        assert desc.transport == "shm" and (desc.handle["path"].split("-")[-2] == "region") == shared
        assert dst.adopt(state, desc) is True
        src.end_export("r", handed_off=True)
        assert sender.blocks.usage()["num_free_slabs"] == sender.blocks.num_slabs   # KV freed on the sender
        assert not sender.has_unfinished()
        assert first + _run(receiver)["r"] == reference
    finally:
        for t in transfers:
            t.close()


def test_failed_import_recomputes_and_loses_nothing(path, reference):
    (src, dst), transfers = _ends(lambda buf: _engine(path, buf), lambda: _engine(path))
    sender, receiver = src.engine, dst.engine
    try:
        first, (state, desc) = _prefill(src, sender)
        os.unlink(desc.handle["path"])   # the staging file is gone before the receiver maps it
        transfers[0].transports["shm"]._free_staging.clear()
        assert dst.adopt(state, desc) is False
        assert dst.num_recomputed == 1
        src.end_export("r", handed_off=True)
        assert first + _run(receiver)["r"] == reference
    finally:
        for t in transfers:
            t.close()


def test_a_held_request_can_continue_where_it_was(path, reference):
    (src,), transfers = _ends(lambda buf: _engine(path, buf))
    sender = src.engine
    try:
        first, (state, desc) = _prefill(src, sender)
        assert not sender.has_unfinished()   # held: nothing schedules it
        src.end_export("r", handed_off=False)
        assert first + _run(sender)["r"] == reference
    finally:
        for t in transfers:
            t.close()


def test_a_request_held_after_prefill_waits_however_many_steps_run(path, reference):
    """A prefill worker's request never decodes on while its handoff is decided (a fast engine
    would otherwise finish it before the decode worker is known)."""
    engine = _engine(path)
    engine.add_request(_request(), hold_after_prefill=True)
    first = [t for f in engine.step() for t in f.token_ids]
    assert len(first) == 1 and not engine.has_unfinished()
    assert engine.step() == []
    state, blocks = engine.detach("r")
    assert list(state.output_token_ids) == first and state.num_computed_tokens == len(PROMPT)
    engine.end_detach("r", handed_off=False)   # no decode worker after all: it goes on here
    assert first + _run(engine)["r"] == reference
    engine.add_request(_request("gone"), hold_after_prefill=True)
    engine.step()
    assert engine.abort("gone") and engine.blocks.usage()["num_free_slabs"] == engine.blocks.num_slabs


def test_adopt_rejects_bad_state(path):
    from scheduler.messages import HandoffState

    engine = _engine(path)
    with pytest.raises(ValueError, match="output token"):
        engine.adopt(HandoffState.continuing(_request("a"), [], [], 0))
    with pytest.raises(ValueError, match="already finished"):
        engine.adopt(HandoffState.continuing(_request("b", max_tokens=2), [5, 6], [0.0, 0.0], 0,
                                                num_computed_tokens=len(PROMPT) + 1))
    with pytest.raises(ValueError, match="unknown model"):
        engine.adopt(HandoffState.continuing(GenerateRequest("c", "nope", PROMPT), [5], [0.0], 0,
                                                num_computed_tokens=len(PROMPT)))
    assert not engine.has_unfinished() and not engine.requests


# ---- through DeviceWorker actors ---------------------------------------------------------------


def _make_pair(ray, path, names=("pre", "dec")):
    """A prefill and a decode DeviceWorker (shared-memory KV) and a router that knows both."""
    from cluster.router import GlobalRouter
    from actors.engine import EngineConfig
    from actors.worker import DeviceWorker

    make = ray.remote(num_gpus=1, num_cpus=0)(DeviceWorker)
    prefill, decode = (make.remote(name, EngineConfig(**ENGINE), num_threads=1, shared_kv=True) for name in names)
    router = GlobalRouter.remote(poll_interval_s=0.2)
    ray.get([h.register_model.remote(MODEL, str(path)) for h in (prefill, decode)])
    ray.get([prefill.set_role.remote("prefill"), decode.set_role.remote("decode"), prefill.set_router.remote(router)])
    node = ray.get(prefill.node.remote())
    ray.get([router.add_worker.remote(names[0], prefill, node), router.add_worker.remote(names[1], decode, node)])
    return router, prefill, decode


def _drop_pair(ray, router, prefill, decode):
    ray.wait([h.close.remote() for h in (prefill, decode)], num_returns=2, timeout=10)
    for h in (prefill, decode, router):
        ray.kill(h)
    from cluster.topology import sweep_stale_kv_files

    sweep_stale_kv_files()   # a worker killed in a test leaves its region behind


@pytest.fixture(scope="module")
def pair(ray_session, path):
    ray = ray_session
    router, prefill, decode = _make_pair(ray, path)
    yield ray, router, prefill, decode
    _drop_pair(ray, router, prefill, decode)


@pytest.fixture
def fresh_pair(ray_session, path):
    """A pair of its own, for a test that kills one of them."""
    ray = ray_session
    router, prefill, decode = _make_pair(ray, path, ("pre2", "dec2"))
    yield ray, router, prefill, decode
    _drop_pair(ray, router, prefill, decode)


@pytest.fixture(scope="module")
def long_reference(path):
    engine = _engine(path)
    engine.add_request(_request(max_tokens=LONG))
    return _run(engine)["r"]


async def _collect(handle, req, worker_id=None):
    """The caller's one stream, read as every caller reads it (it follows the handoff)."""
    from actors.frame_stream import stream_frames

    async with stream_frames(handle.generate.remote(req), worker_id) as stream:
        return [frame async for frame in stream]


def test_caller_keeps_one_stream_across_the_handoff(pair, reference):
    ray, router, prefill, decode = pair
    frames = asyncio.run(_collect(prefill, _request("s1"), "pre"))
    assert [t for f in frames for t in f.token_ids] == reference
    assert frames[0].worker_id == "pre" and frames[-1].worker_id == "dec"
    assert all(f.moved_to is None for f in frames)   # the handoff is followed, never shown to the caller
    assert frames[-1].finish_reason == "length"
    assert ray.get(prefill.stats.remote()).handoff.handed_off == 1
    assert ray.get(decode.stats.remote()).handoff.adopted == 1
    stats = ray.get(prefill.stats.remote()).engine
    assert stats.kv_free_frac == 1.0 and not stats.running


def test_a_decode_worker_refuses_a_model_it_lacks_and_its_stream_ends_with_the_reason(pair):
    from actors.frame_stream import stream_frames
    from scheduler.messages import HandoffState

    ray, router, prefill, decode = pair
    state = HandoffState.continuing(GenerateRequest("refused", "nope", PROMPT), [5], [0.0], 0)

    async def dispatch():
        ack_ref = decode.adopt_prefilled.remote(state, None)
        async with stream_frames(decode.generate_prefilled.remote("refused")) as frames:
            return await ack_ref, [f async for f in frames]

    ack, frames = asyncio.run(dispatch())
    assert not ack.adopted and "nope" in ack.error
    assert [f.finish_reason for f in frames] == ["error"] and "nope" in frames[0].error


def test_dead_decode_worker_loses_nothing(pair, reference):
    ray, router, prefill, decode = pair
    ray.kill(decode)   # the router has not noticed yet: the prefill worker finds out on the handoff
    frames = asyncio.run(_collect(prefill, _request("s2")))
    assert [t for f in frames for t in f.token_ids] == reference
    assert {f.worker_id for f in frames} == {"pre"}
    assert frames[-1].finish_reason == "length"


@pytest.mark.gpu
def test_gpu_handoff_between_workers_equals_single_worker_greedy(ray_session, path, reference):
    """Two CUDA workers on one GPU node: CUDA IPC when cupy is there, else the shm staging path."""
    ray = ray_session
    from cluster.router import GlobalRouter
    from actors.engine import EngineConfig
    from actors.worker import DeviceWorker

    env = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    make = ray.remote(num_gpus=0, num_cpus=0)(DeviceWorker).options(runtime_env=env)
    config = EngineConfig(**ENGINE, device="cuda")
    prefill, decode = make.remote("gpre", config, node_id="n"), make.remote("gdec", config, node_id="n")
    router = GlobalRouter.remote(poll_interval_s=0.2)
    try:
        ray.get([h.register_model.remote(MODEL, str(path)) for h in (prefill, decode)])
        ray.get([prefill.set_role.remote("prefill"), decode.set_role.remote("decode"),
                 prefill.set_router.remote(router)])
        ray.get([router.add_worker.remote("gpre", prefill, "n"), router.add_worker.remote("gdec", decode, "n")])
        frames = asyncio.run(_collect(prefill, _request("g1")))
        assert frames[-1].worker_id == "gdec"
        assert [t for f in frames for t in f.token_ids] == reference
    finally:
        for h in (prefill, decode, router):
            ray.kill(h)


def _read_until_decoding(frames_of, on_decode):
    """Read the frames `frames_of()` streams; `on_decode()` once, at the first from the decode worker."""
    async def main():
        frames = []
        async for frame in frames_of():
            if frame.worker_id.startswith("dec") and not any(f.worker_id.startswith("dec") for f in frames):
                on_decode()
            frames.append(frame)
        return frames

    return asyncio.run(main())


def test_decode_frames_come_straight_from_the_decode_worker(fresh_pair, long_reference):
    """Once handed off, the prefill worker carries none of the request's frames: it can die
    and the stream goes on to the end."""
    from actors.frame_stream import stream_frames

    ray, router, prefill, decode = fresh_pair
    frames = _read_until_decoding(lambda: stream_frames(prefill.generate.remote(_request("straight", LONG))),
                                  lambda: ray.kill(prefill))
    assert [t for f in frames for t in f.token_ids] == long_reference
    assert frames[-1].finish_reason == "length" and frames[-1].worker_id == "dec2"


def test_a_decode_worker_lost_mid_stream_is_resumed_by_the_caller(fresh_pair, path, long_reference):
    """The one resume path: the edge's client continues the request on another worker from the
    output it has, with greedy output equal to an undisturbed run."""
    from deploy.serve_app.cluster_engine import ClusterEngineClient

    ray, router, prefill, decode = fresh_pair
    client = ClusterEngineClient(router, {MODEL: str(path)})
    frames = _read_until_decoding(lambda: client.generate(_request("resumed", LONG)), lambda: ray.kill(decode))
    assert frames[-1].finish_reason == "length", frames[-1].error
    assert [t for f in frames for t in f.token_ids] == long_reference
    assert client.num_resumed == 1 and frames[-1].worker_id == "pre2"


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "phi3"])
def test_new_families_decode_after_a_handoff_as_on_one_worker(tmp_path, family):
    """Prefill on one engine, decode on another: Qwen3, Gemma 3 (window 8 < the 20-token prompt)
    and Phi-3 (the decode worker passes longrope's pretraining length of 32 and recomputes from
    position 0) keep the single-worker tokens."""
    from family_checkpoints import FAMILIES

    from actors.handoff import KVHandoff
    from actors.kv_transfer import KVTransfers

    ckpt = FAMILIES[family](tmp_path / family)
    alone = _engine(ckpt)
    alone.add_request(_request())
    reference = _run(alone)["r"]
    src_t, dst_t = KVTransfers("p", "node", "cpu"), KVTransfers("d", "node", "cpu")
    try:
        src, dst = KVHandoff(_engine(ckpt), src_t), KVHandoff(_engine(ckpt), dst_t)
        first, (state, desc) = _prefill(src, src.engine, steps=2)
        assert dst.adopt(state, desc) is True
        src.end_export("r", handed_off=True)
        assert first + _run(dst.engine)["r"] == reference
    finally:
        src_t.close()
        dst_t.close()


def test_a_moe_model_handed_off_decodes_what_generate_decodes(zoo_model):
    """A sparse MoE (mixtral-tiny-a) served under the same name: prefill on one engine, KV over
    shared memory, decode on another; the tokens are transformers' greedy ones."""
    moe_path = zoo_model("mixtral-tiny-a")
    (src, dst), transfers = _ends(lambda buf: _engine(moe_path, buf), lambda: _engine(moe_path), shared=True)
    try:
        first, (state, desc) = _prefill(src, src.engine, steps=2)
        assert dst.adopt(state, desc) is True
        src.end_export("r", handed_off=True)
        got = first + _run(dst.engine)["r"]
    finally:
        for t in transfers:
            t.close()
    want = hf_greedy(moe_path, PROMPT, MAX_TOKENS)
    assert got[:len(want)] == want   # generate() stops at an EOS, the request (ignore_eos) goes on
