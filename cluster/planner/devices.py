"""The devices a fleet plan can buy, and how one device's memory is carved.

`DEVICES` is a small table of what the planner needs to know about a GPU: its memory and
the bandwidths that price a model switch (host -> device), a KV handoff between devices
of one node (NVLink or PCIe peer to peer) and one across nodes (the network). Any figure
can be overridden (`tokenmux plan --memory-gb --h2d-gbps ...`), and a CPU profile written
by `tokenmux profile` carries its own `device.json`.

Host -> device bandwidth is what a weight swap-in from pinned host memory really gets:
tokenmux's engine benchmark measured 55 GB/s on an H200 (PCIe Gen5 x16,
docs/results/engine-h200.json `swap_gb_s`); the Gen5 parts (H100, H800, H20) get 50 GB/s
in the table, the A10 (Gen4 x16) half that. Aegaeon's simulator prices every swap at
16 GB/s instead (aegaeon/sim/worker.py, PCIE = 16): `--h2d-gbps 16` plans with that.

`DeviceLayout` is EngineConfig's carving (actors/device_memory.py): N equal weight slots,
one KV region and a reserve for activations and the CUDA context. A layout that does not
fit the device is refused with the numbers.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

GB = 10 ** 9
GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int             # what the device reports (nvidia-smi total)
    h2d_bytes_per_s: float        # host -> device copies: weight swap-in, KV swap-in
    d2d_bytes_per_s: float        # device -> device on one node: KV handoff
    net_bytes_per_s: float        # across nodes: KV handoff
    devices_per_node: int = 8

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"device {self.name!r}: memory_bytes must be > 0, got {self.memory_bytes}")
        for name in ("h2d_bytes_per_s", "d2d_bytes_per_s", "net_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"device {self.name!r}: {name} must be > 0, got {getattr(self, name)!r}")
        if self.devices_per_node < 1:
            raise ValueError(f"device {self.name!r}: devices_per_node must be >= 1")

    def to_dict(self) -> dict:
        return asdict(self)


# Memory: the total nvidia-smi reports. d2d: NVLink of the SXM parts (H800's is cut to
# 400 GB/s bidirectional), PCIe peer to peer on the A10; what a bulk copy gets, about half
# the peak. net: one 200 Gb/s NIC per GPU.
DEVICES: dict[str, DeviceSpec] = {
    "H100": DeviceSpec("H100", 81559 * MiB, 50 * GB, 200 * GB, 25 * GB),
    "H800": DeviceSpec("H800", 81559 * MiB, 50 * GB, 100 * GB, 25 * GB),
    "H20": DeviceSpec("H20", 97871 * MiB, 50 * GB, 200 * GB, 25 * GB),
    "A10": DeviceSpec("A10", 23028 * MiB, 25 * GB, 10 * GB, 12.5 * GB, devices_per_node=4),
}


def device_spec(name_or_path: str, **overrides) -> DeviceSpec:
    """A table entry (case-insensitive) or a device.json written by `tokenmux profile`;
    keyword overrides that are not None replace its figures."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"device file {name_or_path!r} does not exist")
        spec = DeviceSpec(**json.loads(path.read_text()))
    else:
        spec = next((d for k, d in DEVICES.items() if k.lower() == name_or_path.lower()), None)
        if spec is None:
            raise ValueError(f"unknown device {name_or_path!r}; known: {', '.join(DEVICES)} "
                             f"(or a device.json from `tokenmux profile`)")
    return replace(spec, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class DeviceLayout:
    """One device's memory: num_slots weight slots of slot_bytes, a KV pool, a reserve."""

    device: DeviceSpec
    num_slots: int
    slot_bytes: int
    kv_bytes: int
    reserve_bytes: int
    host_kv_bytes: int = 64 * GiB    # host swap space for preempted KV
    slab_bytes: int = 64 * MiB       # KV pool granularity between models of different shapes

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.slot_bytes <= 0 or self.reserve_bytes < 0 or self.host_kv_bytes < 0:
            raise ValueError("slot_bytes must be > 0; reserve_bytes and host_kv_bytes >= 0")
        if self.kv_bytes < self.slab_bytes:
            raise ValueError(
                f"layout leaves {_gib(self.kv_bytes)} for KV on the {self.device.name}, less than one "
                f"{_gib(self.slab_bytes)} slab: {self._sum_text()}")
        if self.total_bytes > self.device.memory_bytes:
            raise ValueError(f"layout does not fit the {self.device.name}: {self._sum_text()}")

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes + self.kv_bytes + self.reserve_bytes

    def _sum_text(self) -> str:
        return (f"{self.num_slots} slots x {_gib(self.slot_bytes)} + KV {_gib(self.kv_bytes)} + "
                f"reserve {_gib(self.reserve_bytes)} = {_gib(self.total_bytes)} "
                f"{'>' if self.total_bytes > self.device.memory_bytes else '<='} "
                f"{_gib(self.device.memory_bytes)} of device memory")

    @classmethod
    def carve(cls, device: DeviceSpec, largest_weight_bytes: int, num_slots: int = 2,
              kv_bytes: int | None = None, reserve_frac: float = 0.1, **kw) -> "DeviceLayout":
        """Slots sized to the largest model; KV takes what is left after the reserve
        (`reserve_frac` of memory, vLLM's default headroom) unless given."""
        if not 0 <= reserve_frac < 1:
            raise ValueError(f"reserve_frac must be in [0, 1), got {reserve_frac!r}")
        reserve = int(device.memory_bytes * reserve_frac)
        slot = -(-largest_weight_bytes // 256) * 256
        if kv_bytes is None:
            kv_bytes = device.memory_bytes - reserve - num_slots * slot
        return cls(device, num_slots, slot, int(kv_bytes), reserve, **kw)

    def to_dict(self) -> dict:
        return {"device": self.device.to_dict(), "num_slots": self.num_slots, "slot_bytes": self.slot_bytes,
                "kv_bytes": self.kv_bytes, "reserve_bytes": self.reserve_bytes,
                "host_kv_bytes": self.host_kv_bytes, "slab_bytes": self.slab_bytes}


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"
