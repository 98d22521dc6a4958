"""KV handoff: the descriptor's wire format and the CPU transports, between real processes."""
from __future__ import annotations

import multiprocessing as mp

import msgpack
import pytest
import torch

from actors.kv_transfer import (
    CudaIPCTransport,
    KVDescriptor,
    KVTransferError,
    ObjectStoreTransport,
    SharedMemoryTransport,
    choose_transport,
    make_transport,
)

LAYOUT = dict(model="tiny-llama", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")


def descriptor(request_id="req-1", block_ids=(5, 2, 7), num_tokens=40, **kw) -> KVDescriptor:
    return KVDescriptor(request_id=request_id, block_ids=tuple(block_ids), num_tokens=num_tokens,
                        src_node_id="node-a", src_worker_id="worker-0", **{**LAYOUT, **kw})


def random_blocks(desc: KVDescriptor, n: int, seed: int = 0) -> torch.Tensor:
    """`[n, L, 2, 16, H, D]` of arbitrary bit patterns (NaNs and infinities included)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * desc.block_bytes,), dtype=torch.uint8, generator=g)
    return raw.view(desc.torch_dtype).view(n, *desc.block_shape)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# ---- descriptor ---------------------------------------------------------------------

def test_descriptor_round_trips_through_msgpack():
    desc = descriptor().with_handle("shm", {"path": "/dev/shm/x", "offsets": [0, 96, 192], "raw": b"\x00\xff"})
    again = KVDescriptor.from_bytes(desc.to_bytes())
    assert again == desc
    assert again.block_ids == (5, 2, 7) and again.handle["raw"] == b"\x00\xff"
    assert again.nbytes == 3 * 3 * 2 * 16 * 2 * 8 * 2


@pytest.mark.parametrize("data", [
    b"",
    b"\xc1garbage",
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"v": 99, "request_id": "r"}),
    descriptor().to_bytes()[:-5],
    msgpack.packb({**msgpack.unpackb(descriptor().to_bytes()), "surprise": 1}),
    msgpack.packb({**msgpack.unpackb(descriptor().to_bytes()), "block_ids": [1, -2, 3]}),
    msgpack.packb({**msgpack.unpackb(descriptor().to_bytes()), "num_layers": "3"}),
    msgpack.packb({k: v for k, v in msgpack.unpackb(descriptor().to_bytes()).items() if k != "head_dim"}),
])
def test_malformed_descriptor_bytes_are_rejected(data):
    with pytest.raises(ValueError):
        KVDescriptor.from_bytes(data)


def test_descriptor_rejects_inconsistent_fields():
    with pytest.raises(ValueError, match="need 3 blocks"):
        descriptor(num_tokens=33, block_ids=(1, 2))
    with pytest.raises(ValueError, match="dtype"):
        descriptor(dtype="float64")
    with pytest.raises(ValueError, match="duplicates"):
        descriptor(block_ids=(1, 1, 2))
    with pytest.raises(ValueError, match="handle"):
        descriptor().with_handle("shm", {"fn": print})


# ---- shared memory, two processes -----------------------------------------------------

def _receive_shm(shm_dir, desc_bytes, dst_block_ids, pool_blocks, queue):
    desc = KVDescriptor.from_bytes(desc_bytes)
    transport = SharedMemoryTransport(shm_dir=shm_dir)
    try:
        if dst_block_ids is None:
            out = transport.import_(desc)
        else:
            out = torch.zeros((pool_blocks, *desc.block_shape), dtype=desc.torch_dtype)
            transport.import_(desc, out, dst_block_ids)
            out = out[dst_block_ids]
        queue.put(("ok", as_bytes(out)))
    except KVTransferError as exc:
        queue.put(("KVTransferError", str(exc)))
    finally:
        transport.close()


def run_receiver(shm_dir, desc: KVDescriptor, dst_block_ids=None, pool_blocks=0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receive_shm, args=(str(shm_dir), desc.to_bytes(), dst_block_ids, pool_blocks, queue))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    return result


def test_shm_handoff_to_another_process_preserves_bytes(tmp_path):
    desc = descriptor()
    blocks = random_blocks(desc, desc.num_blocks)
    sender = SharedMemoryTransport(shm_dir=tmp_path)
    exported = sender.export(blocks, desc)
    status, received = run_receiver(tmp_path, exported)
    assert status == "ok" and received == as_bytes(blocks)
    sender.release(exported)
    sender.close()
    assert list(tmp_path.iterdir()) == []


def test_shm_handoff_from_a_shared_pool_into_a_pool(tmp_path):
    desc = descriptor(block_ids=(6, 1, 3))
    sender = SharedMemoryTransport(shm_dir=tmp_path)
    pool = sender.allocate_region(8 * desc.block_bytes).view(desc.torch_dtype).view(8, *desc.block_shape)
    pool.copy_(random_blocks(desc, 8, seed=1))
    exported = sender.export(pool, desc, from_pool=True)
    assert exported.handle["offsets"] == [i * desc.block_bytes for i in (6, 1, 3)]   # read in place
    status, received = run_receiver(tmp_path, exported, dst_block_ids=[0, 4, 2], pool_blocks=5)
    assert status == "ok" and received == as_bytes(pool[[6, 1, 3]])
    sender.release(exported)
    del pool
    sender.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_shm_handoff_keeps_every_bit_for_each_layout_and_dtype(tmp_path, dtype):
    """The layouts the CUDA IPC handoff moves, through the shared-memory transport: several
    layers, KV heads and head dims, non-contiguous source block ids (runs and gaps) into
    scattered destination blocks; every bit pattern (NaN payloads included) arrives."""
    desc = descriptor(block_ids=(9, 2, 3, 4, 11, 0), num_tokens=90, dtype=dtype, num_layers=5,
                      num_kv_heads=4, head_dim=16)
    sender = SharedMemoryTransport(shm_dir=tmp_path)
    pool = sender.allocate_region(12 * desc.block_bytes).view(desc.torch_dtype).view(12, *desc.block_shape)
    pool.copy_(random_blocks(desc, 12, seed=3))
    exported = sender.export(pool, desc, from_pool=True)
    status, received = run_receiver(tmp_path, exported, dst_block_ids=[7, 1, 2, 3, 0, 12], pool_blocks=13)
    assert status == "ok" and received == as_bytes(pool[list(desc.block_ids)])
    sender.release(exported)
    del pool
    sender.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("on_grid", [True, False])
def test_copy_from_offsets_is_byte_exact_on_and_off_the_block_grid(dtype, on_grid):
    """What a CUDA IPC receiver does with a mapped allocation (uint8 [nbytes]) and the
    sender's byte offsets, run on a CPU: blocks on a common grid merge into runs, others go
    one by one; either way each block lands whole at its destination, bit for bit, and
    nothing else in the pool changes. The copy moves integer views (base.as_bits): a copy
    through float rewrites NaN payloads, which once corrupted every IPC handoff."""
    from actors.kv_transports.base import as_bits, copy_from_offsets
    desc = descriptor(block_ids=(1, 2, 3, 7), num_tokens=60, dtype=dtype, num_layers=4)
    bb = desc.block_bytes
    offsets = [bb * i + (0 if on_grid else 8 * i) for i in (4, 5, 6, 0)]   # a run of three, then a jump back
    src = random_blocks(descriptor(dtype=dtype, num_layers=4, block_ids=tuple(range(8)), num_tokens=128), 8, seed=5)
    raw = src.view(-1).view(torch.uint8)
    out = torch.zeros((10, *desc.block_shape), dtype=desc.torch_dtype)
    before = as_bytes(out)
    copy_from_offsets(raw, offsets, desc, out, [9, 3, 4, 0])
    for dst, off in zip([9, 3, 4, 0], offsets):
        assert as_bytes(out[dst]) == raw[off:off + bb].numpy().tobytes()
    untouched = [i for i in range(10) if i not in (9, 3, 4, 0)]
    assert as_bytes(out[untouched]) == before[:len(untouched) * bb]
    assert as_bits(out).dtype.is_floating_point is False


def test_shm_staging_is_reused_after_release(tmp_path):
    desc = descriptor()
    sender = SharedMemoryTransport(shm_dir=tmp_path)
    first = sender.export(random_blocks(desc, 3), desc)
    sender.release(first)
    second = sender.export(random_blocks(desc, 3, seed=2), descriptor(request_id="req-2"))
    assert second.handle["path"] == first.handle["path"]
    assert len(list(tmp_path.iterdir())) == 1
    sender.close()


def test_shm_handoff_whose_sender_is_gone_raises_kv_transfer_error(tmp_path):
    desc = descriptor()
    sender = SharedMemoryTransport(shm_dir=tmp_path)
    exported = sender.export(random_blocks(desc, 3), desc)
    sender.close()
    status, message = run_receiver(tmp_path, exported)
    assert status == "KVTransferError" and "req-1" in message


def test_export_rejects_blocks_that_do_not_match_the_descriptor(tmp_path):
    sender = SharedMemoryTransport(shm_dir=tmp_path)
    desc = descriptor()
    with pytest.raises(ValueError, match="shape"):
        sender.export(torch.zeros(3, 3, 2, 16, 2, 4, dtype=torch.bfloat16), desc)
    with pytest.raises(ValueError, match="float32"):
        sender.export(torch.zeros(3, *desc.block_shape), desc)
    with pytest.raises(ValueError, match="2 blocks given"):
        sender.export(random_blocks(desc, 2), desc)
    with pytest.raises(ValueError, match="outside a pool"):
        sender.export(random_blocks(desc, 4), desc, from_pool=True)
    sender.close()


# ---- object store, two actors ---------------------------------------------------------

def _actors(ray):
    @ray.remote(num_cpus=0)
    class Sender:
        def __init__(self):
            self.transport = ObjectStoreTransport()

        def export(self, desc, seed):
            # Self-contained: the test module is not importable in Ray's workers.
            g = torch.Generator().manual_seed(seed)
            raw = torch.randint(0, 256, (desc.nbytes,), dtype=torch.uint8, generator=g)
            blocks = raw.view(desc.torch_dtype).view(desc.num_blocks, *desc.block_shape)
            return self.transport.export(blocks, desc), raw.numpy().tobytes()

        def release(self, desc):
            self.transport.release(desc)

    @ray.remote(num_cpus=0)
    class Receiver:
        def __init__(self):
            self.transport = ObjectStoreTransport(get_timeout_s=20)

        def receive(self, descs):
            try:
                out = self.transport.import_(descs[0])
                return "ok", out.view(-1).view(torch.uint8).numpy().tobytes()
            except KVTransferError as exc:
                return "KVTransferError", str(exc)

    return Sender, Receiver


def test_object_store_handoff_between_actors_preserves_bytes(ray_session):
    ray = ray_session
    Sender, Receiver = _actors(ray)
    sender, receiver = Sender.remote(), Receiver.remote()
    desc, sent = ray.get(sender.export.remote(descriptor(), 3))
    status, received = ray.get(receiver.receive.remote([desc]))
    assert status == "ok" and received == sent
    ray.get(sender.release.remote(desc))

    # The msgpack bytes alone carry no ObjectRef: the receiver says so instead of hanging.
    desc2, _ = ray.get(sender.export.remote(descriptor(request_id="req-2"), 4))
    status, message = ray.get(receiver.receive.remote([KVDescriptor.from_bytes(desc2.to_bytes())]))
    assert status == "KVTransferError" and "ObjectRef" in message
    ray.get(sender.release.remote(desc2))
    ray.kill(sender)
    ray.kill(receiver)


# ---- choosing -------------------------------------------------------------------------

def test_choose_transport_by_topology():
    assert choose_transport("node-a", "node-b", "cpu") == "object_store"
    assert choose_transport("node-a", "node-b", "cuda") == "object_store"
    assert choose_transport("node-a", "node-a", "cpu") == "shm"
    expected = "cuda_ipc" if CudaIPCTransport.available() else "shm"
    assert choose_transport("node-a", "node-a", "cuda") == expected
    with pytest.raises(ValueError, match="device_kind"):
        choose_transport("a", "a", "tpu")
    with pytest.raises(ValueError, match="unknown KV transport"):
        make_transport("carrier-pigeon")


@pytest.mark.skipif(CudaIPCTransport.available(), reason="CUDA IPC is available here")
def test_cuda_ipc_is_unavailable_cleanly_without_cupy():
    with pytest.raises(KVTransferError, match="unavailable"):
        CudaIPCTransport()


@pytest.mark.parametrize("method", ["runs", "index"])
@pytest.mark.parametrize("src_ids,dst_ids", [
    ([1, 3, 5, 7], [0, 1, 2, 3]),      # scattered source, contiguous destination: one gather
    ([2, 3, 4, 5], [9, 0, 4, 6]),      # contiguous source, scattered destination: one scatter
    ([7, 1, 4, 2], [3, 8, 0, 5]),      # both scattered: gather then scatter
    ([0, 1, 2, 6, 7], [4, 5, 6, 0, 1]),  # runs
])
def test_block_copy_methods_are_bit_exact_and_touch_only_their_blocks(method, src_ids, dst_ids):
    """Both ways copy_block_runs moves blocks (a GPU takes "index" for several runs, a CPU
    "runs"), run on a CPU: every bit of each block arrives (random bit patterns, NaNs
    included), in bf16 and fp32, and the other blocks of the destination pool are untouched."""
    from actors.kv_transports.base import copy_block_runs
    for dtype in ("bfloat16", "float32"):
        desc = descriptor(dtype=dtype, num_layers=3, block_ids=tuple(range(10)), num_tokens=160)
        src, dst = random_blocks(desc, 10, seed=1), random_blocks(desc, 10, seed=2)
        before = dst.clone()
        copy_block_runs(dst, dst_ids, src, src_ids, method=method)
        for s, d in zip(src_ids, dst_ids):
            assert as_bytes(dst[d]) == as_bytes(src[s])
        others = [i for i in range(10) if i not in dst_ids]
        assert as_bytes(dst[others]) == as_bytes(before[others])


def test_block_pointers_are_the_blocks_own_addresses():
    """What a CUDA IPC export sends as offsets (kv_transports.base.block_pointers), checked on a
    CPU against each block's own data_ptr: a pool's scattered blocks, a strided view of slabs,
    and a plain run of blocks."""
    from actors.kv_transports.base import block_pointers
    desc = descriptor(block_ids=(1, 2), num_tokens=32)
    pool = random_blocks(desc, 12, seed=4)
    assert block_pointers(pool, (9, 2, 5)) == [pool[i].data_ptr() for i in (9, 2, 5)]
    slabs = pool.view(3, 4, *desc.block_shape)[:, 1:3].reshape(-1, *desc.block_shape)   # a copy: reshape of a gap
    assert block_pointers(slabs, None) == [b.data_ptr() for b in slabs]
    every_other = pool[::2]   # a view with a stride of two blocks
    assert block_pointers(every_other, (0, 3, 5)) == [every_other[i].data_ptr() for i in (0, 3, 5)]
