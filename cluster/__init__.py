"""The control plane of a tokenmux cluster: who serves what, never a token.

What flows through: each DeviceWorker's WorkerStats into the GlobalRouter (router.py),
which turns them into WorkerViews and answers `pick(model, slo)` per request and
`pick_decode` per KV handoff; its LoadReport into the PlacementService
(placement_service.py), whose PlacementPlan goes back to the router and, as
register_model / set_role calls, to the workers. topology.py brings router, placement and
one worker per device up on every node and reports a ClusterStatus; inventory.py (NVML, or
virtual devices of a memory budget on a CPU host) and ray_runtime.py (join or start Ray)
say what a node offers; node_watcher.py follows nodes joining and leaving.
"""
