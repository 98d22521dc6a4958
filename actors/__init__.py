"""actors/: the data plane of one device: the DeviceWorker actor and the torch machinery it drives.

What flows through here:

- A `scheduler.messages.GenerateRequest` arrives at `DeviceWorker.generate` (the router in
  cluster/ picked the worker); `OutputFrame`s stream back in small batches through a
  FrameBuffer (frame_stream.py), read by callers with `stream_frames`. `stats()` answers a
  `WorkerStats`: what the router and placement know of this device.
- Inside a DeviceWorker, the pure scheduler (scheduler/) decides each step; this package
  executes the decision: weights of the chosen model are made resident in a device slot
  (`WeightSlots.ensure_resident`, one bulk copy from the node-wide `HostWeightCache`,
  prefetched in the background for the next model), the model runner reads them as
  typed views (`WeightSlots.params`) and reads/writes KV blocks in the unified
  `DeviceKVPool`; preempted KV moves whole blocks to the `HostKVPool` and back
  (`kv_pool.copy_blocks`).
- Memory is explicit: `DeviceMemory` reserves one buffer at start and carves it into a
  KV region and equal weight slots; nothing is allocated per model switch.
- Checkpoints are read from local directories only (`ModelSpec`, `WeightLayout`); disk
  is the cold path, touched once per node per model.
- Prefill/decode disaggregation: a prefill worker's HandoffRelay (handoff.py) detaches a
  request after its first frame, exports its KV blocks (`KVBlocks`) through KVTransfers
  (kv_transfer.py, transports in kv_transports/), and dispatches `adopt_prefilled(state,
  descriptor)` to a decode worker, which adopts the request with its KV and acks; the prefill
  worker's stream ends naming it, and the caller reads the frames from its
  `generate_prefilled` (frame_stream.py follows the move).
"""
