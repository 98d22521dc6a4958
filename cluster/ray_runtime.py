"""Start or join the Ray cluster tokenmux runs on, and read what its nodes offer.

Joining: an explicit address, else $RAY_ADDRESS ("auto" finds a cluster started on this
machine with `ray start --head`). Starting: a local single-node Ray with explicit small
resources, so that several tokenmux processes (and test sessions) share a machine
without each claiming every core. On a CPU host the node declares `num_gpus=N` virtual
GPUs (one per virtual device of the inventory); Ray hands them out like real ones, and a
DeviceWorker asks for `num_gpus=1, num_cpus=0` either way.

A local start is private to this machine and this user: Ray's servers (GCS, raylet,
object manager, workers) bind to loopback only, and Ray's token authentication stays on
(Ray's default for a new cluster; tokenmux no longer turns it off). Whatever the user
configured wins: RAY_AUTH_MODE (e.g. `disabled`), RAY_AUTH_TOKEN(_PATH), and
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 to take the host's address instead of loopback.
Joining a cluster changes none of Ray's settings.

Nothing here calls `ray stop`: that kills every Ray on the machine.
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

from cluster.inventory import DEFAULT_VIRTUAL_MEMORY_BYTES, probe_nvml, discover_devices

logger = logging.getLogger(__name__)

# Ray puts AF_UNIX sockets at <temp_dir>/session_<date>_<pid>/sockets/<name>; sun_path
# holds 107 bytes, and the session part takes about 70 of them.
MAX_TEMP_DIR_CHARS = 36
DEFAULT_OBJECT_STORE_BYTES = 512 * 1024**2
DRIVER_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
# Set before a local start unless the user set it: at "0" Ray takes 127.0.0.1 as the node's
# address (on Linux too), and every server it starts binds there, not on all interfaces.
# RAY_worker_niceness: Ray starts its worker processes (every actor: DeviceWorkers, the
# router, the Serve proxy and ingress) at nice 15, so on a shared host any other process
# took their CPU first: the chaos bench's own load generator (nice 0, one process at 10x
# capacity) got 80-90% of a core while the server's processes waited, and accepted requests
# waited 7-11x their TTFT SLO. A server runs at the priority it was started with.
LOCAL_START_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_worker_niceness": "0"}
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
NAMESPACE = "tokenmux"


@dataclass(frozen=True)
class RayRuntime:
    address: str            # GCS address of the cluster this process is connected to
    started_locally: bool   # True: this process started it, and ray.shutdown() ends it
    num_gpus: int           # GPUs of this node as Ray sees them (virtual ones included)
    virtual_gpus: bool      # the node's GPUs are virtual devices of ordinary memory
    temp_dir: str | None


@dataclass(frozen=True)
class NodeResources:
    node_id: str
    address: str
    num_cpus: float
    num_gpus: float
    is_head: bool
    resources: dict


def connect_or_start(
    address: str | None = None,
    num_virtual_gpus: int | None = None,
    num_cpus: int | None = None,
    object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES,
    temp_dir: str | None = None,
    env_vars: dict[str, str] | None = None,
    log_to_driver: bool = True,
) -> RayRuntime:
    """Connect to the cluster at `address` (or $RAY_ADDRESS), else start a local one.

    If this process is already connected, that connection is kept and described.
    `num_virtual_gpus` only matters when a local Ray is started on a host without GPUs.
    """
    import ray

    for key, value in DRIVER_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return _describe(started_locally=False, temp_dir=None)
    runtime_env = {"env_vars": {**WORKER_ENV, **(env_vars or {})}}
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        logger.info("joining Ray cluster at %s", address)
        ray.init(address=address, namespace=NAMESPACE, runtime_env=runtime_env,
                 log_to_driver=log_to_driver, configure_logging=False)
        return _describe(started_locally=False, temp_dir=None)
    kwargs = local_init_kwargs(num_virtual_gpus, num_cpus, object_store_memory, temp_dir)
    logger.info("starting a local Ray: %d CPU, %d GPU%s, object store %d MiB, temp dir %s",
                kwargs["num_cpus"], kwargs["num_gpus"], " (virtual)" if kwargs["_virtual"] else "",
                object_store_memory // 1024**2, kwargs["_temp_dir"])
    kwargs.pop("_virtual")
    _private_local_start()
    ray.init(namespace=NAMESPACE, runtime_env=runtime_env, include_dashboard=False,
             log_to_driver=log_to_driver, configure_logging=False, **kwargs)
    return _describe(started_locally=True, temp_dir=kwargs["_temp_dir"])


def _private_local_start() -> None:
    """Loopback binding for the local start, unless the user chose otherwise."""
    for key, value in LOCAL_START_ENV.items():
        os.environ.setdefault(key, value)
    # Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER into a constant at import; the node address
    # is looked up through it when the local node starts (ray._private.services.get_node_ip_address).
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"].lower() in ("1", "true")


def local_init_kwargs(
    num_virtual_gpus: int | None = None,
    num_cpus: int | None = None,
    object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES,
    temp_dir: str | None = None,
) -> dict:
    """The resources a local start declares; `_virtual` says whether its GPUs are virtual."""
    if num_cpus is None:
        num_cpus = min(os.cpu_count() or 1, 8)
    if not isinstance(num_cpus, int) or isinstance(num_cpus, bool) or num_cpus < 1:
        raise ValueError(f"num_cpus must be a positive int, got {num_cpus!r}")
    if not isinstance(object_store_memory, int) or object_store_memory < 75 * 1024**2:
        raise ValueError(f"object_store_memory must be an int of at least 75 MiB (Ray's minimum), "
                         f"got {object_store_memory!r}")
    if temp_dir is None:
        temp_dir = tempfile.mkdtemp(prefix="tmx", dir="/tmp")
    if len(temp_dir) > MAX_TEMP_DIR_CHARS:
        raise ValueError(f"temp_dir {temp_dir!r} is {len(temp_dir)} characters; Ray's socket paths "
                         f"under it would pass the 107-byte AF_UNIX limit (keep it <= {MAX_TEMP_DIR_CHARS})")
    devices = discover_devices(virtual_count=num_virtual_gpus, virtual_memory_bytes=DEFAULT_VIRTUAL_MEMORY_BYTES)
    return {
        "num_cpus": num_cpus,
        "num_gpus": len(devices),
        "object_store_memory": object_store_memory,
        "_temp_dir": temp_dir,
        "_virtual": all(d.is_virtual for d in devices),
    }


def alive_nodes() -> list[NodeResources]:
    """Alive nodes of the connected cluster with what each declares, head first."""
    import ray

    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = dict(node.get("Resources", {}))
        nodes.append(NodeResources(
            node_id=node["NodeID"],
            address=node.get("NodeManagerAddress", ""),
            num_cpus=float(resources.get("CPU", 0.0)),
            num_gpus=float(resources.get("GPU", 0.0)),
            is_head="node:__internal_head__" in resources,
            resources=resources,
        ))
    return sorted(nodes, key=lambda n: (not n.is_head, n.node_id))


def node_ids() -> list[str]:
    """Ids of the alive nodes, head first."""
    return [n.node_id for n in alive_nodes()]


def current_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _describe(started_locally: bool, temp_dir: str | None) -> RayRuntime:
    import ray

    context = ray.get_runtime_context()
    here = context.get_node_id()
    gpus = next((n.num_gpus for n in alive_nodes() if n.node_id == here), 0.0)
    address = getattr(context, "gcs_address", "") or ""
    real_gpus, _ = probe_nvml()
    return RayRuntime(address=address, started_locally=started_locally, num_gpus=int(gpus),
                      virtual_gpus=gpus > 0 and not real_gpus, temp_dir=temp_dir)
