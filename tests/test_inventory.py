"""Device inventory and Ray bring-up, as a CPU host sees them."""
from __future__ import annotations

import logging

import pytest

from conftest import NUM_VIRTUAL_GPUS
from cluster.inventory import DeviceInfo, discover_devices, pcie_bandwidth_bytes_per_s, probe_nvml
from cluster.ray_runtime import alive_nodes, connect_or_start, current_node_id, local_init_kwargs, node_ids

GiB = 1024**3
no_real_gpu = pytest.mark.skipif(bool(probe_nvml()[0]), reason="this host has GPUs visible to NVML")


def real_device(**kw) -> DeviceInfo:
    fields = dict(index=0, name="NVIDIA H100", memory_total_bytes=80 * GiB, memory_free_bytes=79 * GiB,
                  pcie_gen=5, pcie_width=16, mig_mode=False, uuid="GPU-1234", is_virtual=False)
    return DeviceInfo(**{**fields, **kw})


@no_real_gpu
def test_cpu_host_gets_virtual_devices_with_the_budget_and_one_log_line(caplog):
    with caplog.at_level(logging.DEBUG, logger="cluster.inventory"):
        devices = discover_devices(virtual_count=3, virtual_memory_bytes=3 * GiB // 2)
    assert [d.index for d in devices] == [0, 1, 2]
    assert all(d.is_virtual and d.memory_total_bytes == d.memory_free_bytes == 3 * GiB // 2 for d in devices)
    assert len({d.uuid for d in devices}) == 3
    records = [r for r in caplog.records if r.name == "cluster.inventory"]
    assert len(records) == 1 and "NVML" in records[0].getMessage()
    assert records[0].levelno in (logging.INFO, logging.WARNING) and records[0].exc_info is None


@no_real_gpu
def test_virtual_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENMUX_NUM_VIRTUAL_DEVICES", "2")
    assert len(discover_devices()) == 2
    monkeypatch.setenv("TOKENMUX_NUM_VIRTUAL_DEVICES", "two")
    with pytest.raises(ValueError, match="TOKENMUX_NUM_VIRTUAL_DEVICES"):
        discover_devices()
    with pytest.raises(RuntimeError, match="no GPU found"):
        discover_devices(backend="nvml")


def test_bad_inventory_arguments_are_named():
    with pytest.raises(ValueError, match="virtual_count"):
        discover_devices(virtual_count=0, backend="virtual")
    with pytest.raises(ValueError, match="virtual_memory_bytes"):
        discover_devices(virtual_count=1, virtual_memory_bytes=-5, backend="virtual")
    with pytest.raises(ValueError, match="backend"):
        discover_devices(backend="rocm")
    with pytest.raises(ValueError, match="memory_free_bytes"):
        real_device(memory_free_bytes=81 * GiB)
    with pytest.raises(ValueError, match="pcie_gen"):
        real_device(pcie_gen=-1)


def test_pcie_bandwidth_grows_with_generation_and_width():
    gen4 = pcie_bandwidth_bytes_per_s(real_device(pcie_gen=4))
    gen5 = pcie_bandwidth_bytes_per_s(real_device(pcie_gen=5))
    x8 = pcie_bandwidth_bytes_per_s(real_device(pcie_gen=5, pcie_width=8))
    assert gen5 == pytest.approx(2 * gen4, rel=0.01)
    assert x8 == pytest.approx(gen5 / 2)
    unknown = pcie_bandwidth_bytes_per_s(real_device(pcie_gen=0, pcie_width=0))
    assert 0 < unknown <= gen5
    virtual = discover_devices(virtual_count=1, backend="virtual")[0]
    assert pcie_bandwidth_bytes_per_s(virtual) > 0


def test_local_start_declares_virtual_gpus_and_a_short_temp_dir(tmp_path):
    kwargs = local_init_kwargs(num_virtual_gpus=3, num_cpus=2, temp_dir="/tmp/tmx-test")
    if kwargs["_virtual"]:
        assert kwargs["num_gpus"] == 3
    assert kwargs["num_cpus"] == 2 and kwargs["_temp_dir"] == "/tmp/tmx-test"
    with pytest.raises(ValueError, match="107-byte"):
        local_init_kwargs(temp_dir=str(tmp_path / ("x" * 80)))
    with pytest.raises(ValueError, match="object_store_memory"):
        local_init_kwargs(object_store_memory=1024, temp_dir="/tmp/tmx-test")


def test_connect_keeps_the_running_session_and_lists_its_gpus(ray_session):
    runtime = connect_or_start()
    assert not runtime.started_locally and runtime.num_gpus == NUM_VIRTUAL_GPUS
    nodes = alive_nodes()
    assert node_ids() == [n.node_id for n in nodes] and current_node_id() in node_ids()
    here = next(n for n in nodes if n.node_id == current_node_id())
    assert here.num_gpus == NUM_VIRTUAL_GPUS and here.num_cpus >= 1 and here.is_head
    if not probe_nvml()[0]:
        assert runtime.virtual_gpus
