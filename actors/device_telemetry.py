"""Telemetry of the worker's own device: NVML on a GPU, the worker process on a virtual device.

    sampler = device_sampler(device, label, budget_bytes, num_threads)
    reading = sampler.sample(copy_bytes_per_s)      # from the worker's metrics thread, never the engine's

GPU (nvidia-ml-py): utilisation, memory used/total, board power, temperature and PCIe
throughput of the GPU this process drives, found by its UUID (Ray sets
CUDA_VISIBLE_DEVICES per worker, so "cuda:0" here is some physical GPU). A query the board
does not support reads as None, never an error.

Virtual device (a CPU host): the device is the worker process and its budget, so the same
gauges come from the process: utilisation = CPU seconds / (wall seconds x torch threads
the worker owns), memory used = RSS (it includes the Python runtime, so it exceeds the
budget), memory total = the budget, PCIe = the host-to-device weight copies the engine made
(`copy_bytes_per_s`, the traffic a PCIe link would carry). Power and temperature do not
exist there and read as None; readings say `virtual=True`.
"""
from __future__ import annotations

import logging
import os
import time

from actors.worker_reports import DeviceReading

logger = logging.getLogger(__name__)


class ProcessSampler:
    """A virtual device: this process's CPU share and RSS, against the budget it enforces."""

    def __init__(self, label: str, budget_bytes: int, num_threads: int):
        import psutil

        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads!r}")
        self.label = label
        self.budget_bytes = int(budget_bytes)
        self.num_threads = num_threads
        self._process = psutil.Process(os.getpid())
        self._last = (time.perf_counter(), self._cpu_seconds())

    def _cpu_seconds(self) -> float:
        t = self._process.cpu_times()
        return t.user + t.system

    def sample(self, copy_bytes_per_s: float = 0.0) -> DeviceReading:
        now, cpu = time.perf_counter(), self._cpu_seconds()
        (then, cpu_then), self._last = self._last, (now, cpu)
        busy = (cpu - cpu_then) / max(1e-9, (now - then) * self.num_threads)
        return DeviceReading(self.label, True, min(1.0, max(0.0, busy)), int(self._process.memory_info().rss),
                             self.budget_bytes, pcie_rx_bytes_per_s=float(copy_bytes_per_s),
                             pcie_tx_bytes_per_s=0.0)


class NvmlSampler:
    """The GPU this process drives, through NVML."""

    def __init__(self, uuid: str | None = None, index: int | None = None):
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        try:
            if uuid:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(0 if index is None else index)
            self.index = int(pynvml.nvmlDeviceGetIndex(self._handle))
        except pynvml.NVMLError:
            pynvml.nvmlShutdown()
            raise
        self.label = f"gpu{self.index}"

    def _optional(self, query, *args):
        try:
            return query(self._handle, *args)
        except self._nvml.NVMLError:
            return None

    def sample(self, copy_bytes_per_s: float = 0.0) -> DeviceReading:
        n = self._nvml
        util = self._optional(n.nvmlDeviceGetUtilizationRates)
        memory = n.nvmlDeviceGetMemoryInfo(self._handle)
        power_mw = self._optional(n.nvmlDeviceGetPowerUsage)
        temperature = self._optional(n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU)
        rx_kb = self._optional(n.nvmlDeviceGetPcieThroughput, n.NVML_PCIE_UTIL_RX_BYTES)   # KB/s, ~20 ms window
        tx_kb = self._optional(n.nvmlDeviceGetPcieThroughput, n.NVML_PCIE_UTIL_TX_BYTES)
        return DeviceReading(
            self.label, False, (util.gpu / 100.0) if util is not None else 0.0, int(memory.used), int(memory.total),
            power_watts=None if power_mw is None else power_mw / 1000.0,
            temperature_celsius=None if temperature is None else float(temperature),
            pcie_rx_bytes_per_s=None if rx_kb is None else rx_kb * 1024.0,
            pcie_tx_bytes_per_s=None if tx_kb is None else tx_kb * 1024.0)

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def device_sampler(device: str, label: str, budget_bytes: int, num_threads: int | None):
    """NvmlSampler for a CUDA device (None if NVML cannot open it), else a ProcessSampler."""
    if device.startswith("cuda"):
        try:
            return NvmlSampler(uuid=cuda_uuid(device))
        except Exception as exc:   # no driver library, a sandbox without NVML: no device telemetry
            logger.warning("device telemetry: NVML unavailable for %s (%s)", device, exc)
            return None
    import torch

    return ProcessSampler(label, budget_bytes, num_threads or torch.get_num_threads())


def cuda_uuid(device: str) -> str | None:
    """NVML's UUID string of the CUDA device this process calls `device`."""
    import torch

    index = torch.device(device).index or 0
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def export_reading(reading: DeviceReading, exporter, worker_id: str) -> None:
    """The reading's gauges (what it lacks is not exported: no made-up zeros)."""
    tags = {"device": reading.device, "worker": worker_id, "virtual": "true" if reading.virtual else "false"}
    exporter.set("tokenmux_device_utilization", reading.utilization, tags)
    exporter.set("tokenmux_device_memory_used_bytes", reading.memory_used_bytes, tags)
    exporter.set("tokenmux_device_memory_total_bytes", reading.memory_total_bytes, tags)
    if reading.power_watts is not None:
        exporter.set("tokenmux_device_power_watts", reading.power_watts, tags)
    if reading.temperature_celsius is not None:
        exporter.set("tokenmux_device_temperature_celsius", reading.temperature_celsius, tags)
    for direction, value in (("rx", reading.pcie_rx_bytes_per_s), ("tx", reading.pcie_tx_bytes_per_s)):
        if value is not None:
            exporter.set("tokenmux_device_pcie_bytes_per_second", value, {**tags, "direction": direction})
