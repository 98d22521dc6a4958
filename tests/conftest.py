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

NUM_VIRTUAL_GPUS = 4


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
        num_gpus=NUM_VIRTUAL_GPUS,
        include_dashboard=False,
        object_store_memory=512 * 1024 * 1024,
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}},
        _system_config={"metrics_report_interval_ms": 1000},   # metrics reach Prometheus within ~1 s, not 10
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def zoo_model():
    """`zoo_model(name) -> Path`: a zoo checkpoint, built once into the default zoo dir."""
    from actors.zoo.zoo import ensure_model

    return ensure_model
