"""Test fixtures shared by the whole suite.

Ray starts once per test session (`ray_session`), with explicit small resources, a short
temp dir (AF_UNIX socket paths must stay under 107 bytes), no dashboard and a capped
object store. Tests never call `ray stop`: that kills every Ray on the machine.
"""
from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TOKENMUX_QUIET_WAIT_S", "1")   # load tests here judge behaviour, not speed

NUM_VIRTUAL_GPUS = 4
SHUTDOWN_WAIT_S = 60.0


def session_num_gpus() -> int:
    """GPUs the session Ray declares: virtual ones on a CPU host; on a CUDA host the real ones,
    since Ray gives each worker `CUDA_VISIBLE_DEVICES=<its GPU id>`, and a virtual id past the
    real devices leaves that worker without CUDA (the serve-app GPU test's setup error on the
    H200, where 4 declared GPUs made 3 workers with no device)."""
    if not _has_cuda():
        return NUM_VIRTUAL_GPUS
    import torch

    return torch.cuda.device_count()


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole session, with virtual GPUs on CPU hosts."""
    ray = pytest.importorskip("ray", reason="ray is not installed (e.g. on the bare GPU check machine)")

    if ray.is_initialized():
        yield ray
        return
    temp_dir = tempfile.mkdtemp(prefix="tmr", dir="/tmp")
    ray.init(
        num_cpus=4,
        num_gpus=session_num_gpus(),
        include_dashboard=False,
        object_store_memory=512 * 1024 * 1024,
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
        _system_config={"metrics_report_interval_ms": 1000},   # metrics reach Prometheus within ~1 s, not 10
    )
    yield ray
    _shutdown(ray)


def _shutdown(ray) -> None:
    """ray.shutdown(), waited for at most SHUTDOWN_WAIT_S: on the H200 the session once hung
    after its last test, and the GPU check lost every result with it; a shutdown that does not
    return is reported and left behind (its threads die with the process)."""
    import threading

    done = threading.Thread(target=ray.shutdown, daemon=True, name="ray-shutdown")
    done.start()
    done.join(SHUTDOWN_WAIT_S)
    if done.is_alive():
        import warnings

        warnings.warn(f"ray.shutdown() did not return within {SHUTDOWN_WAIT_S:g} s; leaving it")


@pytest.fixture(scope="session")
def zoo_model():
    """`zoo_model(name) -> Path`: a zoo checkpoint, built once into the default zoo dir."""
    from actors.zoo.zoo import ensure_model

    return ensure_model
