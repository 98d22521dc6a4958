"""Device telemetry: the virtual device's gauges from this process, and NVML on a real GPU."""
from __future__ import annotations

import time

import pytest

from actors.device_telemetry import NvmlSampler, ProcessSampler, device_sampler, export_reading
from actors.worker_reports import DeviceReading
from tests.test_engine_metrics import RecordingExporter


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def test_virtual_device_reads_cpu_share_and_rss():
    sampler = ProcessSampler("gpu0", budget_bytes=1 << 30, num_threads=1)
    _burn(0.3)
    busy = sampler.sample(copy_bytes_per_s=5e8)
    time.sleep(0.3)
    idle = sampler.sample()
    assert busy.virtual and busy.memory_total_bytes == 1 << 30
    assert busy.memory_used_bytes > 10 << 20                # this Python process's RSS
    # the burn shows, the sleep does not (how much of a core the burn got depends on the machine's load)
    assert 0 < busy.utilization <= 1 and busy.utilization > idle.utilization
    assert busy.pcie_rx_bytes_per_s == 5e8 and busy.power_watts is None and busy.temperature_celsius is None


def test_a_reading_exports_only_what_it_has():
    out = RecordingExporter()
    export_reading(DeviceReading("gpu0", True, 0.25, 100, 200, pcie_rx_bytes_per_s=1.0, pcie_tx_bytes_per_s=0.0),
                   out, "w0")
    names = {n for _, n, _, _ in out.calls}
    assert "tokenmux_device_power_watts" not in names and "tokenmux_device_temperature_celsius" not in names
    assert out.total("tokenmux_device_utilization", virtual="true", worker="w0", device="gpu0") == 0.25
    assert out.count("tokenmux_device_pcie_bytes_per_second") == 2


def test_cpu_engine_gets_the_process_sampler():
    assert isinstance(device_sampler("cpu", "gpu0", 1 << 20, 2), ProcessSampler)
    with pytest.raises(ValueError):
        ProcessSampler("gpu0", 1 << 20, 0)


@pytest.mark.gpu
def test_nvml_reads_the_gpu_this_process_drives():
    import torch

    from actors.device_telemetry import cuda_uuid

    sampler = device_sampler("cuda:0", "unused", 0, None)
    assert isinstance(sampler, NvmlSampler)
    try:
        x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")   # 256 MiB the reading must see
        reading = sampler.sample()
        assert not reading.virtual and reading.device.startswith("gpu")
        assert reading.memory_used_bytes >= 256 << 20 and reading.memory_total_bytes > reading.memory_used_bytes
        assert 0.0 <= reading.utilization <= 1.0
        assert reading.temperature_celsius is None or 0 < reading.temperature_celsius < 120
        assert reading.power_watts is None or reading.power_watts > 0
        assert cuda_uuid("cuda:0").startswith("GPU-")
        del x
    finally:
        sampler.close()
