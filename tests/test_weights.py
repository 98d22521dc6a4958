"""Weight layout, node-wide host cache, device memory budget and weight slots (swap-in, LRU, prefetch)."""
from __future__ import annotations

import multiprocessing as mp
import re
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from actors.device_memory import DeviceMemory, format_bytes
from actors.host_cache import HostWeightCache
from actors.weight_layout import ALIGN, WeightLayout
from actors.weight_slots import WeightSlots

SHM = Path("/dev/shm")


def _make_checkpoint(out: Path, seed: int, hidden: int, layers: int, tie: bool = False,
                     max_shard_size: str | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=tie, dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    return out


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "a": _make_checkpoint(root / "a", seed=1, hidden=64, layers=2),
        "b": _make_checkpoint(root / "b", seed=2, hidden=64, layers=3, tie=True),
        "c": _make_checkpoint(root / "c", seed=3, hidden=32, layers=2),
    }


@pytest.fixture
def prefix():
    """A unique shm prefix per test; every file it made is removed afterwards."""
    p = f"tokenmux-test-{uuid.uuid4().hex[:12]}"
    yield p
    for f in SHM.glob(p + "-*"):
        f.unlink(missing_ok=True)


def _slots(models, prefix, num_slots, device="cpu", kv_bytes=4096, names=("a", "b", "c")):
    layouts = {n: WeightLayout.from_dir(models[n]) for n in names}
    slot_bytes = max(l.total_bytes for l in layouts.values()) + 256
    mem = DeviceMemory(kv_bytes + 256 + num_slots * slot_bytes, kv_bytes, num_slots, device)
    cache = HostWeightCache(prefix=prefix)
    return WeightSlots(mem, cache, layouts), cache


def _assert_exact(params: dict[str, torch.Tensor], path: Path) -> None:
    expected = _checkpoint_tensors(path)
    assert set(params) == set(expected)
    for name, t in expected.items():
        got = params[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.cpu(), t), name


def test_layout_entries_are_aligned_disjoint_and_cover_the_checkpoint(models):
    layout = WeightLayout.from_dir(models["a"])
    tensors = _checkpoint_tensors(models["a"])
    assert layout.names() and set(layout.names()) == set(tensors)
    spans = sorted((e.offset, e.offset + e.nbytes) for e in layout.entries)
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= layout.total_bytes
    for e in layout.entries:
        assert e.shape == tuple(tensors[e.name].shape) and e.dtype == tensors[e.name].dtype


def test_sharded_checkpoint_and_dtype_conversion(tmp_path, prefix):
    path = _make_checkpoint(tmp_path / "sharded", seed=4, hidden=64, layers=2, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    tensors = _checkpoint_tensors(path)
    layout = WeightLayout.from_dir(path, dtype=torch.bfloat16)
    assert len({e.file for e in layout.entries}) > 1
    assert set(layout.names()) == set(tensors)
    cache = HostWeightCache(prefix=prefix)
    cache.add("s", layout)
    flat = cache.flat("s")
    for e in layout.entries:
        got = flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, tensors[e.name].to(torch.bfloat16)), e.name


def _fill_in_child(path: str, prefix: str) -> tuple[int, bytes]:
    cache = HostWeightCache(prefix=prefix)
    cache.add("m", WeightLayout.from_dir(path))
    data = cache.flat("m").clone()
    return cache.num_fills, bytes(data.numpy()[:4096]) + data.sum().item().to_bytes(8, "little")


def test_host_cache_is_filled_once_per_node(models, prefix, monkeypatch):
    monkeypatch.setenv("TOKENMUX_KEEP_HOST_CACHE", "1")   # the filling child exits; its file stays for us
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:   # two fresh processes race to fill the same model
        results = pool.starmap(_fill_in_child, [(str(models["a"]), prefix)] * 2)
    assert sorted(fills for fills, _ in results) == [0, 1]
    assert results[0][1] == results[1][1]
    files = [f for f in SHM.glob(prefix + "-*") if f.suffix == ""]
    assert len(files) == 1

    monkeypatch.delenv("TOKENMUX_KEEP_HOST_CACHE")
    here = HostWeightCache(prefix=prefix)        # this process reuses the file too
    here.add("a", WeightLayout.from_dir(models["a"]))
    flat = here.flat("a")
    assert here.num_fills == 0
    assert here.stats()["bytes"] == flat.numel()
    here.evict("a")
    assert not list(SHM.glob(prefix + "-*"))


def test_swap_in_is_exact_and_lru_evicts_with_two_slots_for_three_models(models, prefix):
    slots, cache = _slots(models, prefix, num_slots=2)
    for name in ("a", "b", "c"):
        assert slots.ensure_resident(name) >= 0.0
        _assert_exact(slots.params(name), models[name])
    assert slots.resident() == {"b", "c"}        # a was least recently used
    with pytest.raises(RuntimeError, match="not resident"):
        slots.params("a")
    assert slots.ensure_resident("c") == 0.0    # already there: no copy
    slots.ensure_resident("a")                   # evicts b, the older of b and c
    assert slots.resident() == {"a", "c"}
    _assert_exact(slots.params("a"), models["a"])
    _assert_exact(slots.params("c"), models["c"])
    stats = slots.stats()
    assert stats["num_swaps"] == 4 and stats["num_hits"] == 1
    assert stats["swap_bytes"] == sum(slots.layouts[n].total_bytes for n in "abca")
    assert cache.num_fills == 3


def test_tied_embeddings_have_no_lm_head_even_when_the_file_stores_one(models, tmp_path, prefix):
    import shutil

    from safetensors.torch import save_file

    tied = tmp_path / "tied"
    shutil.copytree(models["b"], tied)
    tensors = _checkpoint_tensors(tied)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tied / "model.safetensors", metadata={"format": "pt"})
    layout = WeightLayout.from_dir(tied)
    assert "lm_head.weight" not in layout.names() and "model.embed_tokens.weight" in layout.names()
    assert layout.total_bytes == WeightLayout.from_dir(models["b"]).total_bytes


def test_prefetch_then_ensure_resident_waits_and_never_evicts_the_running_model(models, prefix):
    slots, _ = _slots(models, prefix, num_slots=2)
    slots.ensure_resident("a")
    assert slots.prefetch("b")
    slots.ensure_resident("b")                   # waits for the background copy
    _assert_exact(slots.params("b"), models["b"])
    assert slots.prefetch("c")                   # b is running: a (older) makes room
    assert slots.ensure_resident("c") >= 0.0
    assert slots.resident() == {"b", "c"}
    _assert_exact(slots.params("c"), models["c"])
    _assert_exact(slots.params("b"), models["b"])
    assert slots.stats()["num_prefetches"] == 2


def test_prefetch_declines_when_only_the_running_model_holds_a_slot(models, prefix):
    slots, _ = _slots(models, prefix, num_slots=1)
    slots.ensure_resident("a")
    assert slots.prefetch("b") is False
    assert slots.resident() == {"a"}
    slots.ensure_resident("b")
    _assert_exact(slots.params("b"), models["b"])


def test_model_larger_than_a_slot_is_refused_with_the_numbers(models, prefix):
    layout = WeightLayout.from_dir(models["a"])
    kv = 4096
    mem = DeviceMemory(kv + 4 * (layout.total_bytes // 2), kv, 4)
    with pytest.raises(ValueError) as err:
        WeightSlots(mem, HostWeightCache(prefix=prefix), {"big": layout})
    msg = str(err.value)
    assert "'big'" in msg
    assert format_bytes(layout.total_bytes) in msg and format_bytes(mem.slot_bytes) in msg
    assert re.search(r"budget .* = KV .* \+ 4 slots", msg)
    assert not list(SHM.glob(prefix + "-*"))     # refused before any host memory was used


def test_device_memory_rejects_a_budget_without_room_for_slots():
    with pytest.raises(ValueError, match="no room"):
        DeviceMemory(1 << 20, 1 << 20, 2)
    with pytest.raises(ValueError, match="num_slots"):
        DeviceMemory(1 << 20, 0, 0)


def test_slots_are_disjoint_parts_of_one_buffer():
    mem = DeviceMemory(10_000_000, 1_000_003, 3)
    spans = [(mem.kv_buffer.data_ptr(), mem.kv_buffer.data_ptr() + mem.kv_bytes)]
    spans += [(mem.slot(i).data_ptr(), mem.slot(i).data_ptr() + mem.slot_bytes) for i in range(3)]
    base = mem.buffer.data_ptr()
    assert all(b <= a2 for (_, b), (a2, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= base + mem.total_bytes
    assert mem.slot_bytes >= (10_000_000 - 1_000_003) // 3 - 2 * 256


@pytest.mark.gpu
def test_gpu_swap_prefetch_and_pinned_host_cache(models, prefix):
    slots, cache = _slots(models, prefix, num_slots=2, device="cuda")
    assert cache.flat("a").is_pinned()
    slots.ensure_resident("a")
    assert slots.prefetch("b")
    slots.ensure_resident("b")
    _assert_exact(slots.params("b"), models["b"])
    slots.ensure_resident("c")
    assert slots.resident() == {"b", "c"}
    for name in ("b", "c"):
        assert slots.params(name)["model.norm.weight"].device.type == "cuda"
        _assert_exact(slots.params(name), models[name])


@pytest.mark.gpu
def test_refused_registration_falls_back_to_a_pinned_copy_and_leaves_cuda_usable(models, prefix):
    from actors.host_cache import _pin

    cache = HostWeightCache(prefix=prefix)
    cache.add("a", WeightLayout.from_dir(models["a"]))
    flat = cache.flat("a")                       # registered by the cache
    copy, registered = _pin(flat, "a")           # a second registration of the same range is refused
    assert not registered and copy.is_pinned() and copy.data_ptr() != flat.data_ptr()
    assert torch.equal(copy, flat)
    x = torch.ones(1024, device="cuda") * 2      # the refusal did not poison later CUDA calls
    torch.cuda.synchronize()
    assert float(x.sum()) == 2048.0
