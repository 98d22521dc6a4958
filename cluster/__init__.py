"""Bring-up and topology: what a node has and how it joins the cluster.

inventory: NVML (or virtual devices of a memory budget on a CPU host) -> DeviceInfo list,
and the PCIe bandwidth that switch-cost estimates divide by. ray_runtime: join a Ray
cluster or start a small local one (virtual GPUs on CPU hosts), and list the alive nodes
with the GPUs each declares. The actor topology built on these lives here as well.
"""
