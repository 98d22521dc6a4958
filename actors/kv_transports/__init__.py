"""The ways KV blocks move between two workers' pools, behind one interface (base.py:
KVDescriptor, KVTransport): shared memory (same node, CPU), the Ray object store (across
nodes) and CUDA IPC (same node, GPU). actors/kv_transfer.py picks one per pair of workers."""
