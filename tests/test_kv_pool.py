"""The unified KV pool: typed slab views of several KV shapes over one buffer, block copies."""
from __future__ import annotations

import pytest
import torch

from actors.device_memory import DeviceMemory
from actors.kv_pool import DeviceKVPool, HostKVPool, copy_blocks
from scheduler.kv_blocks import BLOCK_SIZE, BlockManager, KVShape

SLAB = 64 * 1024
SHAPE_A = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype_bytes=4)   # fp32
SHAPE_B = KVShape(num_layers=3, num_kv_heads=1, head_dim=24, dtype_bytes=2)   # bf16


def _pool(num_slabs=4, device="cpu") -> DeviceKVPool:
    mem = DeviceMemory(num_slabs * SLAB + 2 * 4096, num_slabs * SLAB, 1, device)
    return DeviceKVPool(mem.kv_buffer, SLAB)


def test_view_has_the_block_layout_and_each_block_is_contiguous():
    pool = _pool()
    view = pool.view(SHAPE_A, torch.float32)
    per_slab = SLAB // SHAPE_A.block_bytes
    assert tuple(view.shape) == (4, per_slab, 2, 2, BLOCK_SIZE, 2, 16)
    block = view[1, 3]
    assert block.is_contiguous()
    offset = block.data_ptr() - pool.buffer.data_ptr()
    assert offset == 1 * SLAB + 3 * SHAPE_A.block_bytes
    assert pool.view(SHAPE_A, torch.float32) is view     # built once


def test_two_shapes_share_the_buffer_without_overlap_across_slabs():
    pool = _pool()
    manager = BlockManager(pool.num_slabs, SLAB)
    ids_a = manager.allocate(SHAPE_A, manager.blocks_per_slab(SHAPE_A) + 1)   # spills into a second slab
    ids_b = manager.allocate(SHAPE_B, 3)
    va, vb = pool.view(SHAPE_A, torch.float32), pool.view(SHAPE_B, torch.bfloat16)
    pa, pb = va.shape[1], vb.shape[1]
    slabs_a, slabs_b = {g // pa for g in ids_a}, {g // pb for g in ids_b}
    assert slabs_a and slabs_b and not slabs_a & slabs_b

    for g in ids_a:
        va[g // pa, g % pa] = 1.5
    for g in ids_b:
        vb[g // pb, g % pb] = -2.0
    for g in ids_a:                                   # B's writes did not touch A's blocks
        assert bool((va[g // pa, g % pa] == 1.5).all())
    for g in ids_b:
        assert bool((vb[g // pb, g % pb] == -2.0).all())
    touched = pool.buffer.view(-1, SLAB).ne(0).any(dim=1).nonzero().flatten().tolist()
    assert set(touched) == slabs_a | slabs_b


def test_view_rejects_a_dtype_that_does_not_match_the_shape_and_oversized_blocks():
    pool = _pool()
    with pytest.raises(ValueError, match="dtype"):
        pool.view(SHAPE_A, torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        pool.view(KVShape(64, 8, 128, 2), torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 256"):
        DeviceKVPool(torch.zeros(4096, dtype=torch.uint8), 1000)


def _round_trip(device: str) -> None:
    pool = _pool(device=device)
    host = HostKVPool(num_slabs=2, slab_bytes=SLAB)
    dev_view = pool.view(SHAPE_B, torch.bfloat16)
    host_view = host.view(SHAPE_B, torch.bfloat16)
    dev_view.copy_(torch.randn(dev_view.shape, device=device).to(torch.bfloat16))
    dev_ids, host_ids = [7, 0, 12], [3, 1, 5]
    pb = dev_view.shape[1]
    before = torch.stack([dev_view[g // pb, g % pb] for g in dev_ids]).cpu()

    copy_blocks(dev_view, dev_ids, host_view, host_ids)          # swap out
    for g in dev_ids:
        dev_view[g // pb, g % pb] = 0
    back_ids = [2, 9, 4]
    copy_blocks(host_view, host_ids, dev_view, back_ids)         # swap in, to other blocks
    after = torch.stack([dev_view[g // pb, g % pb] for g in back_ids]).cpu()
    assert torch.equal(before.view(torch.int16), after.view(torch.int16))   # bit-exact


def test_copy_blocks_round_trip_device_host_device_preserves_bytes():
    _round_trip("cpu")


def test_copy_blocks_rejects_mismatched_requests():
    pool = _pool()
    host = HostKVPool(num_slabs=1, slab_bytes=SLAB)
    src, dst = pool.view(SHAPE_A, torch.float32), host.view(SHAPE_A, torch.float32)
    with pytest.raises(ValueError, match="destination"):
        copy_blocks(src, [0, 1], dst, [0])
    with pytest.raises(ValueError, match="out of range"):
        copy_blocks(src, [0], dst, [dst.shape[0] * dst.shape[1]])
    with pytest.raises(ValueError, match="block shapes differ"):
        copy_blocks(src, [0], host.view(SHAPE_B, torch.bfloat16), [0])


@pytest.mark.gpu
def test_copy_blocks_round_trip_on_gpu_with_pinned_host_pool():
    assert HostKVPool(num_slabs=1, slab_bytes=SLAB).buffer.is_pinned()
    _round_trip("cuda")
