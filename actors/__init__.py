"""actors/: the Ray actors and the torch machinery they drive.

What flows through here:

- Requests arrive as `scheduler.messages.GenerateRequest` at the GlobalRouter, which picks
  a DeviceWorker for the model and never touches tokens; token frames
  (`OutputFrame`) stream back to the ingress in small batches.
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
"""
