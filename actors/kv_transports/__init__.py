"""The KV handoff transports behind actors.kv_transfer.KVTransport: shared memory (same
node, CPU), the Ray object store (across nodes) and CUDA IPC (same node, GPU)."""
