"""The live catalog without a cluster: its data (versions, retiring keys, refusals that name
the field), and a model unregistered from a real Engine giving back its slot, its KV blocks,
its host-cache mapping and file, and the process's shared memory."""
from __future__ import annotations

import pytest

from scheduler.catalog import CatalogEntry, CatalogError, ModelCatalog, serving_key
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams

MiB = 1 << 20
ENGINE = {"budget_bytes": 48 * MiB, "kv_bytes": 8 * MiB, "num_slots": 2, "slab_bytes": 96 * 1024 * 4,
          "host_kv_bytes": 4 * MiB}


def test_an_update_places_the_new_version_beside_the_old_until_it_retires():
    catalog = ModelCatalog.of_models({"a": "/ckpt/a", "b": "/ckpt/b"})
    assert catalog.placed() == {"a": "/ckpt/a", "b": "/ckpt/b"}
    updated = catalog.with_entry(CatalogEntry("a", "/ckpt/a2", version=2), "update")
    assert updated.entry("a").key == serving_key("a", 2) == "a@v2"
    assert updated.entry("a").fingerprint == "a@v2"
    assert updated.placed() == {"a@v2": "/ckpt/a2", "a": "/ckpt/a", "b": "/ckpt/b"}
    assert updated.retired("a").placed() == {"a@v2": "/ckpt/a2", "b": "/ckpt/b"}
    assert [e.kind for e in updated.events] == ["add", "add", "update"]
    assert updated.revision > catalog.revision


def test_a_removed_model_reaches_nothing_new_but_stays_placed_while_it_drains():
    catalog = ModelCatalog.of_models({"a": "/ckpt/a"}).without("a")
    assert catalog.entries == {} and catalog.placed() == {"a": "/ckpt/a"}
    assert ModelCatalog.from_dict(catalog.to_dict()) == catalog   # what the GCS store keeps


@pytest.mark.parametrize("kwargs, field", [
    ({"name": "", "path": "/p"}, "name"),
    ({"name": "a@v2", "path": "/p"}, "name"),        # '@' is the version separator
    ({"name": "a", "path": ""}, "path"),
    ({"name": "a", "path": "/p", "ttft_s": 0}, "ttft_s"),
    ({"name": "a", "path": "/p", "tbt_s": "fast"}, "tbt_s"),
    ({"name": "a", "path": "/p", "version": 0}, "version"),
])
def test_bad_entries_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(CatalogError) as info:
        CatalogEntry(**kwargs)
    assert info.value.field == field and info.value.status == 400


def test_an_unknown_name_is_a_404_naming_the_field():
    with pytest.raises(CatalogError) as info:
        ModelCatalog.of_models({"a": "/ckpt/a"}).without("b")
    assert info.value.field == "name" and info.value.status == 404


def _shared_rss_bytes() -> int:
    """This process's resident shared memory (mapped /dev/shm pages: the host weight cache)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def test_unregistering_frees_the_slot_kv_blocks_host_cache_and_shared_memory(tmp_path, zoo_model):
    from actors.engine import Engine, EngineConfig
    from actors.host_cache import HostWeightCache

    cache = HostWeightCache(shm_dir="/dev/shm", prefix=f"tokenmux-test-{tmp_path.name}")
    engine = Engine(EngineConfig(**ENGINE), host_cache=cache)
    engine.register_model("keep", zoo_model("llama-tiny-a"))
    free_before = engine.blocks.num_free_slabs
    shared_before = _shared_rss_bytes()
    engine.register_model("gone", zoo_model("qwen2-tiny-b"))
    cache_file = cache.file_for("gone")
    engine.add_request(GenerateRequest("r1", "gone", [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True)))
    engine.add_request(GenerateRequest("r2", "keep", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    with pytest.raises(ValueError, match="unfinished"):   # nothing accepted is lost
        engine.unregister_model("gone")
    tokens = {"r1": [], "r2": []}
    while engine.has_unfinished():
        for frame in engine.step():
            tokens[frame.request_id] += frame.token_ids
    assert len(tokens["r1"]) == 6 and len(tokens["r2"]) == 4
    assert cache_file.exists() and "gone" in engine.slots.resident()
    engine.unregister_model("gone", evict_host=True)
    assert "gone" not in engine.models and "gone" not in engine.slots.resident()
    assert "gone" not in cache.models() and not cache_file.exists()
    assert engine.stats().registered == ("keep",)
    assert engine.blocks.num_free_slabs == free_before and engine.stats().kv_free_frac == 1.0
    assert _shared_rss_bytes() <= shared_before * 1.05 + 4096
    # the freed slot serves again: a new model, and the kept one, still run
    engine.register_model("next", zoo_model("mistral-tiny-a"))
    engine.add_request(GenerateRequest("r3", "next", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True)))
    engine.add_request(GenerateRequest("r4", "keep", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True)))
    done = set()
    while engine.has_unfinished():
        done |= {f.request_id for f in engine.step() if f.finished}
    assert done == {"r3", "r4"}
    cache.remove_created()
