"""Which devices this node has: real GPUs through NVML, or virtual devices on a CPU host.

A virtual device is a budget of ordinary memory (`memory_total_bytes`) that a worker
enforces the same way it would a GPU's, so the scheduling problem stays real on a
laptop or in CI. NVML being absent is the normal case on such hosts: it is reported
with one log line, never a traceback.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_VIRTUAL_MEMORY_BYTES = 2 * 1024**3
VIRTUAL_COUNT_ENV = "TOKENMUX_NUM_VIRTUAL_DEVICES"

# Usable bytes per second per lane and direction, after line encoding (8b/10b up to
# gen 2, 128b/130b from gen 3; gen 6 counted at its FLIT payload rate).
_PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
# What a switch copies through when the link is unknown (virtual device, or NVML could
# not say): a host memcpy on a CPU host, a gen-4 x16 link on a GPU.
VIRTUAL_COPY_BYTES_PER_S = 8e9
UNKNOWN_LINK = (4, 16)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    pcie_gen: int          # 0 = unknown (virtual device, or NVML could not read it)
    pcie_width: int        # lanes; 0 = unknown
    mig_mode: bool
    uuid: str
    is_virtual: bool

    def __post_init__(self):
        for field_name in ("index", "memory_total_bytes", "memory_free_bytes", "pcie_gen", "pcie_width"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"DeviceInfo.{field_name} must be a non-negative int, got {value!r}")
        if self.memory_total_bytes == 0:
            raise ValueError("DeviceInfo.memory_total_bytes must be positive")
        if self.memory_free_bytes > self.memory_total_bytes:
            raise ValueError(
                f"DeviceInfo.memory_free_bytes ({self.memory_free_bytes}) exceeds "
                f"memory_total_bytes ({self.memory_total_bytes})"
            )
        if not self.name or not self.uuid:
            raise ValueError("DeviceInfo.name and DeviceInfo.uuid must be non-empty")


def discover_devices(
    virtual_count: int | None = None,
    virtual_memory_bytes: int = DEFAULT_VIRTUAL_MEMORY_BYTES,
    backend: str = "auto",
) -> list[DeviceInfo]:
    """The node's devices, in NVML index order.

    backend "auto": real GPUs when NVML finds any, else `virtual_count` virtual devices
    (default: $TOKENMUX_NUM_VIRTUAL_DEVICES, else 1) of `virtual_memory_bytes` each.
    "nvml": real GPUs or RuntimeError. "virtual": virtual devices even on a GPU host.
    """
    if backend not in ("auto", "nvml", "virtual"):
        raise ValueError(f"backend must be 'auto', 'nvml' or 'virtual', got {backend!r}")
    if backend != "nvml":
        count = _virtual_count(virtual_count)
        if not isinstance(virtual_memory_bytes, int) or isinstance(virtual_memory_bytes, bool) \
                or virtual_memory_bytes <= 0:
            raise ValueError(f"virtual_memory_bytes must be a positive int, got {virtual_memory_bytes!r}")
    if backend == "virtual":
        return _virtual_devices(count, virtual_memory_bytes)
    devices, why_not = probe_nvml()
    if devices:
        logger.info("found %d GPU(s) through NVML: %s", len(devices), ", ".join(d.name for d in devices))
        return devices
    if backend == "nvml":
        raise RuntimeError(f"no GPU found through NVML: {why_not}")
    logger.info("no GPU through NVML (%s); using %d virtual device(s) of %.2f GiB each",
                why_not, count, virtual_memory_bytes / 1024**3)
    return _virtual_devices(count, virtual_memory_bytes)


def pcie_bandwidth_bytes_per_s(info: DeviceInfo) -> float:
    """Host-to-device bytes per second one direction of the link can carry (an estimate).

    Used for switch-cost estimates (weight bytes / bandwidth); the estimator refines it
    online from measured swap-ins.
    """
    if info.is_virtual:
        return VIRTUAL_COPY_BYTES_PER_S
    gen, width = (info.pcie_gen, info.pcie_width) if info.pcie_gen and info.pcie_width else UNKNOWN_LINK
    lane = _PCIE_LANE_BYTES_PER_S.get(gen, _PCIE_LANE_BYTES_PER_S[max(_PCIE_LANE_BYTES_PER_S)])
    return lane * width


def _virtual_count(virtual_count: int | None) -> int:
    if virtual_count is None:
        raw = os.environ.get(VIRTUAL_COUNT_ENV, "1")
        try:
            virtual_count = int(raw)
        except ValueError:
            raise ValueError(f"${VIRTUAL_COUNT_ENV} must be an int, got {raw!r}") from None
    if not isinstance(virtual_count, int) or isinstance(virtual_count, bool) or virtual_count < 1:
        raise ValueError(f"virtual_count must be a positive int, got {virtual_count!r}")
    return virtual_count


def _virtual_devices(count: int, memory_bytes: int) -> list[DeviceInfo]:
    return [
        DeviceInfo(index=i, name="virtual", memory_total_bytes=memory_bytes, memory_free_bytes=memory_bytes,
                   pcie_gen=0, pcie_width=0, mig_mode=False, uuid=f"VIRTUAL-{i}", is_virtual=True)
        for i in range(count)
    ]


def probe_nvml() -> tuple[list[DeviceInfo], str]:
    """(devices, reason there are none). Never raises: a host without a driver is normal."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML: {exc}"
    try:
        return [_read_device(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())], "NVML reports 0 devices"
    except pynvml.NVMLError as exc:
        return [], f"NVML: {exc}"
    finally:
        pynvml.nvmlShutdown()


def _read_device(pynvml, index: int) -> DeviceInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)

    def optional(query, default):
        # Link and MIG queries are unsupported on some boards and in some sandboxes.
        try:
            return query(handle)
        except pynvml.NVMLError:
            return default

    mig = optional(pynvml.nvmlDeviceGetMigMode, (0, 0))
    return DeviceInfo(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_total_bytes=int(memory.total),
        memory_free_bytes=int(memory.free),
        pcie_gen=int(optional(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, 0)),
        pcie_width=int(optional(pynvml.nvmlDeviceGetMaxPcieLinkWidth, 0)),
        mig_mode=int(mig[0]) == pynvml.NVML_DEVICE_MIG_ENABLE,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        is_virtual=False,
    )


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
