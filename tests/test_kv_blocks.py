"""BlockManager: a unified slab pool shared by KV shapes; ids never handed out twice, nothing leaks."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.kv_blocks import BLOCK_SIZE, BlockManager, KVShape, blocks_for_tokens

SMALL = KVShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=2)  # 512-byte blocks
BIG = KVShape(num_layers=4, num_kv_heads=2, head_dim=4, dtype_bytes=2)  # 2048-byte blocks
SLAB = 4096  # 8 SMALL blocks or 2 BIG blocks


def test_block_bytes_and_blocks_for_tokens():
    assert SMALL.block_bytes == 2 * 2 * BLOCK_SIZE * 1 * 4 * 2
    assert [blocks_for_tokens(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="num_layers"):
        KVShape(0, 1, 4, 2)


def test_slab_goes_to_one_shape_and_returns_when_empty():
    bm = BlockManager(num_slabs=2, slab_bytes=SLAB)
    small = bm.allocate(SMALL, 3)
    assert bm.num_free_slabs == 1
    assert bm.num_free_blocks(SMALL) == 5 + 8  # rest of its slab + one free slab
    assert bm.num_free_blocks(BIG) == 2  # only the untouched slab can hold BIG blocks
    big = bm.allocate(BIG, 2)
    assert bm.allocate(BIG, 1) is None  # no room: None, and nothing taken
    assert bm.num_free_blocks(SMALL) == 5
    bm.free(SMALL, small)
    assert bm.num_free_blocks(BIG) == 2  # the SMALL slab went back to the pool
    assert bm.allocate(BIG, 2) is not None
    bm.free(BIG, big)


def test_block_id_names_slab_and_index():
    bm = BlockManager(num_slabs=3, slab_bytes=SLAB)
    bm.allocate(BIG, 2)  # slab 0
    ids = bm.allocate(SMALL, 9)  # slab 1 fully, then slab 2
    per_slab = bm.blocks_per_slab(SMALL)
    assert sorted({g // per_slab for g in ids}) == [1, 2]
    assert len(set(ids)) == 9


def test_bad_frees_raise_and_change_nothing():
    bm = BlockManager(num_slabs=2, slab_bytes=SLAB)
    ids = bm.allocate(SMALL, 2)
    with pytest.raises(ValueError, match="double free"):
        bm.free(SMALL, [ids[0], ids[0]])
    with pytest.raises(ValueError, match="not in this pool"):
        bm.free(SMALL, [999])
    with pytest.raises(ValueError, match="does not hold"):
        bm.free(BIG, [ids[0]])
    assert bm.num_free_blocks(SMALL) == 14  # the failed frees left both blocks allocated
    bm.free(SMALL, ids)
    with pytest.raises(ValueError, match="double free"):
        bm.free(SMALL, ids[:1])


def test_bad_arguments():
    with pytest.raises(ValueError, match="slab_bytes"):
        BlockManager(1, 0)
    bm = BlockManager(1, 1024)
    with pytest.raises(ValueError, match="does not fit in a slab"):
        bm.allocate(BIG, 1)
    with pytest.raises(ValueError, match="non-negative"):
        bm.allocate(SMALL, -1)
    assert bm.allocate(SMALL, 0) == []


def test_usage_reports_bytes_per_shape():
    bm = BlockManager(num_slabs=4, slab_bytes=SLAB)
    bm.allocate(SMALL, 3)
    bm.allocate(BIG, 1)
    usage = bm.usage()
    assert usage["used_bytes"] == 3 * SMALL.block_bytes + BIG.block_bytes
    assert usage["num_free_slabs"] == 2
    assert usage["by_shape"][SMALL]["num_used_blocks"] == 3


SHAPES = [SMALL, BIG, KVShape(1, 1, 8, 4)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2), st.integers(0, 9), st.integers(0, 50)),
                max_size=60))
def test_random_allocate_free_never_double_hands_out_and_never_leaks(ops):
    bm = BlockManager(num_slabs=5, slab_bytes=SLAB)
    live: dict[int, list[tuple[int, list[int]]]] = {i: [] for i in range(len(SHAPES))}
    for is_alloc, s, n, pick in ops:
        shape = SHAPES[s]
        if is_alloc or not live[s]:
            before = bm.num_free_blocks(shape)
            ids = bm.allocate(shape, n)
            if ids is None:
                assert before < n
                assert bm.num_free_blocks(shape) == before
                continue
            assert len(ids) == n
            held = {g for _, blocks in live[s] for g in blocks}
            assert not held & set(ids) and len(set(ids)) == n
            assert bm.num_free_blocks(shape) == before - n
            live[s].append((n, ids))
        else:
            _, ids = live[s].pop(pick % len(live[s]))
            bm.free(shape, ids)
        used_bytes = sum(len(b) * SHAPES[i].block_bytes for i in live for _, b in live[i])
        assert bm.usage()["used_bytes"] == used_bytes
    for s, allocations in live.items():
        for _, ids in allocations:
            bm.free(SHAPES[s], ids)
    assert bm.num_free_slabs == 5
    assert bm.usage()["used_bytes"] == 0
    for shape in SHAPES:
        assert bm.num_free_blocks(shape) == bm.capacity_blocks(shape)


def test_a_dedicated_shape_holds_the_same_slabs_on_every_rank_and_only_those():
    """A tensor-parallel model's blocks are its leader's decision for every rank: each rank
    dedicates it the same slabs, which its own models never take and which stay dedicated
    when empty; the dedicated shape never spills into the rest of the pool."""
    leader, member = BlockManager(num_slabs=4, slab_bytes=SLAB), BlockManager(num_slabs=4, slab_bytes=SLAB)
    assert leader.dedicate(BIG, 2) == member.dedicate(BIG, 2) == [2, 3]
    assert leader.capacity_blocks(BIG) == leader.num_free_blocks(BIG) == 4
    ids = leader.allocate(BIG, 4)
    assert sorted(g // leader.blocks_per_slab(BIG) for g in ids) == [2, 2, 3, 3]
    assert leader.allocate(BIG, 1) is None          # no spill into the two free slabs
    own = member.allocate(SMALL, 16)                # the member's own model fills the rest...
    assert {g // member.blocks_per_slab(SMALL) for g in own} == {0, 1}
    assert member.allocate(SMALL, 1) is None        # ...and never the group's slabs
    leader.free(BIG, ids)
    assert leader.num_free_slabs == 2 and leader.num_free_blocks(BIG) == 4   # still the group's
    with pytest.raises(ValueError, match="already holds slabs"):
        leader.dedicate(BIG, 1)
    with pytest.raises(ValueError, match="cannot dedicate 3 slabs: 2 are free"):
        leader.dedicate(SMALL, 3)
