"""KV handoff between tensor-parallel groups (actors/tp_handoff.py): each rank's shard goes to
the matching rank of the decode group, through the ordinary transports.

- Bookkeeping: the shards of two ranks exported from two pools arrive byte for byte in the
  matching ranks' pools, under the block ids the receiving leader chose; a group descriptor
  whose shards disagree is refused; a KV split another way than the receiving model's
  (another TP degree, another head split) is refused with its reason and the request
  recomputes, its output unchanged.
- Served: prefill on one TP-2 group of DeviceWorkers, decode on another (4 virtual devices),
  llama-tiny-b (8 query heads over 2 KV heads: each rank holds 1 KV head); the caller's one
  stream equals transformers' greedy `generate()` token for token, and the KV moved.
"""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from actors.kv_pool import KVBlocks
from actors.tp_handoff import GroupKVDescriptor, layout_mismatch
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams
from tests.greedy_reference import hf_greedy

L, HEADS, D = 2, 1, 8   # a rank's block: 2 layers x 2 (K, V) x 16 tokens x 1 KV head x 8


def _pool(seed: int) -> torch.Tensor:
    """A rank's pool as one model's blocks: [slabs, per_slab, L, 2, 16, H, D], random bits."""
    return torch.randn(3, 4, L, 2, 16, HEADS, D, generator=torch.Generator().manual_seed(seed))


def test_each_ranks_shard_arrives_byte_exact_at_the_matching_rank_under_the_receivers_ids():
    from actors.kv_transfer import KVTransfers

    senders, receivers = [_pool(r) for r in range(2)], [torch.zeros(3, 4, L, 2, 16, HEADS, D) for _ in range(2)]
    sent_ids, got_ids, tokens = (1, 6, 7), (9, 0, 4), 40   # the same ids on every rank of a group
    transfers = [KVTransfers(f"pre{r}", "node", "cpu") for r in range(2)] + \
        [KVTransfers(f"dec{r}", "node", "cpu") for r in range(2)]
    try:
        desc = GroupKVDescriptor(tuple(transfers[r].export("q", "big", KVBlocks(senders[r], sent_ids), tokens, "node")
                                       for r in range(2)))
        assert (desc.size, desc.num_tokens, desc.model) == (2, tokens, "big")
        assert desc.nbytes == 2 * 3 * L * 2 * 16 * HEADS * D * 4
        assert layout_mismatch(desc, 2, HEADS, L, D) is None
        for r in range(2):
            transfers[2 + r].import_(desc.shards[r], KVBlocks(receivers[r], got_ids))
            transfers[r].release(desc.shards[r])
        for r in range(2):
            flat_in, flat_out = senders[r].view(12, -1), receivers[r].view(12, -1)
            assert torch.equal(flat_out[list(got_ids)].view(torch.int32), flat_in[list(sent_ids)].view(torch.int32))
            untouched = [b for b in range(12) if b not in got_ids]
            assert not flat_out[untouched].any()   # nothing but the chosen blocks written
        assert not torch.equal(receivers[0], receivers[1])   # each rank got its own shard, not rank 0's
    finally:
        for t in transfers:
            t.close()


def test_a_group_descriptor_whose_shards_disagree_is_refused():
    from actors.kv_transports.base import KVDescriptor

    shard = KVDescriptor("q", "big", L, HEADS, D, "float32", (1, 2), 20)
    with pytest.raises(ValueError, match="rank 1"):
        GroupKVDescriptor((shard, dataclasses.replace(shard, block_ids=(1, 3))))
    with pytest.raises(ValueError, match="per rank"):
        GroupKVDescriptor((shard,))


def test_a_split_that_does_not_match_is_refused_with_its_reason():
    from actors.kv_transports.base import KVDescriptor

    shard = KVDescriptor("q", "big", L, HEADS, D, "float32", (1, 2), 20)
    group = GroupKVDescriptor((shard, shard))
    assert "over 2 rank(s), this model over 4" in layout_mismatch(group, 4, HEADS, L, D)
    assert "over 1 rank(s), this model over 2" in layout_mismatch(shard, 2, HEADS, L, D)
    assert "over 2 rank(s), this model over 1" in layout_mismatch(group, 1, 2 * HEADS, L, D)
    assert "1 KV heads x 8 of 2 layers per rank; a rank here holds 2 x 8" in layout_mismatch(group, 2, 2, L, D)


def test_a_group_kv_offered_to_a_single_device_model_recomputes_and_output_is_unchanged(zoo_model):
    """A TP-2 group's KV handed to a worker that serves the model whole: refused before any copy
    (its split does not match), the prefix recomputed there, greedy output unchanged."""
    from tests.test_handoff import MODEL, _ends, _engine, _prefill, _run

    path = zoo_model(MODEL)
    reference = _engine(path)
    reference.add_request(GenerateRequest("r", MODEL, [11, 400, 77, 1234, 9, 18, 600, 5, 42, 300, 17, 88, 1500, 3,
                                                       71, 20, 19, 33, 1200, 7],
                                          SamplingParams(max_tokens=24, ignore_eos=True)))
    want = _run(reference)["r"]
    (src, dst), transfers = _ends(lambda buf: _engine(path, buf), lambda: _engine(path))
    try:
        first, (state, desc) = _prefill(src, src.engine)
        assert dst.adopt(state, GroupKVDescriptor((desc, desc))) is False
        assert dst.counts().recomputed == 1
        src.end_export("r", handed_off=True)
        assert first + _run(dst.engine)["r"] == want
    finally:
        for t in transfers:
            t.close()


# ---- two TP-2 groups of DeviceWorkers: prefill on one, decode on the other ------------------

MAX_NEW = 20
PROMPTS = [list(range(40, 57)), [7] * 30 + [200, 300], [101, 7, 88, 9, 64, 22, 17]]


@pytest.mark.timeout(300)
def test_prefill_on_one_tp2_group_and_decode_on_another_equals_generate(ray_session):
    from actors.frame_stream import stream_frames
    from actors.zoo.zoo import ensure_model
    from tests.test_tp_group import _config, _group

    ray = ray_session
    path = ensure_model("llama-tiny-b")
    config = _config(path, kv_blocks=32)
    prefill = _group(ray, config, "big", path, prefix="pre")
    decode = _group(ray, config, "big", path, prefix="dec")
    from cluster.router import GlobalRouter

    router = GlobalRouter.remote(poll_interval_s=0.2)   # knows the two leaders: a group's requests go to its leader
    try:
        node = ray.get(prefill[0].node.remote())
        ray.get([prefill[0].set_role.remote("prefill"), decode[0].set_role.remote("decode"),
                 prefill[0].set_router.remote(router), router.add_worker.remote("pre0", prefill[0], node),
                 router.add_worker.remote("dec0", decode[0], node)])
        idle = ray.get(prefill[0].stats.remote()).engine.kv_free_frac   # the group's dedicated slabs are not free

        async def one(i, prompt):
            request = GenerateRequest(f"h{i}", "big", tuple(prompt), SamplingParams(max_tokens=MAX_NEW,
                                                                                    temperature=0.0))
            async with stream_frames(prefill[0].generate.remote(request), "pre0") as frames:
                return [f async for f in frames]

        async def main():
            return await asyncio.wait_for(asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)]), 180)

        answers = asyncio.run(main())
        sent, got = ray.get([prefill[0].stats.remote(), decode[0].stats.remote()])
    finally:
        for w in (*prefill, *decode, router):
            ray.kill(w)
    for prompt, frames in zip(PROMPTS, answers):
        assert all(f.error is None for f in frames), [f.error for f in frames]
        assert [t for f in frames for t in f.token_ids] == hf_greedy(path, prompt, MAX_NEW)
        assert frames[0].worker_id == "pre0" and frames[-1].worker_id == "dec0"
    assert sent.handoff.handed_off == len(PROMPTS) and got.handoff.adopted == len(PROMPTS)
    assert got.handoff.recomputed == 0   # every shard moved: nothing recomputed
    assert sent.engine.kv_free_frac == idle and not sent.engine.running   # released on the prefill group
