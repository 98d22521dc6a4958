"""Which kernel path an engine runs with kernels="auto" (actors/kernel_check.py): the fast path
only where it was checked on that device; a path that gives other tokens, or fails, falls back
to the reference path with a warning the stats carry to `tokenmux status`."""
from __future__ import annotations

import pytest
import torch

from actors import kernel_check
from actors.engine import Engine, EngineConfig

MiB = 1 << 20


def test_auto_on_a_cpu_keeps_the_reference_path():
    engine = Engine(EngineConfig(budget_bytes=8 * MiB, kv_bytes=2 * MiB, slab_bytes=1 * MiB, host_kv_bytes=0))
    assert engine.kernels == "reference" and engine.kernel_warning == ""
    assert engine.stats().kernels == "reference"


def test_the_check_passes_for_paths_that_agree_and_names_requests_that_differ(monkeypatch):
    """Run on a CPU: the check's own engines and model, reference against the CPU fast path
    (fused and packed kernels), which agree; then against a path whose arithmetic is broken."""
    assert kernel_check.compare_paths(torch.device("cpu"), fast="fast") == []
    from actors import layer_kernels

    real = layer_kernels.FastKernels.lm_head

    def broken(self, p, x):   # a kernel that reorders the vocabulary: other greedy tokens
        return real(self, p, x).flip(-1)

    monkeypatch.setattr(layer_kernels.FastKernels, "lm_head", broken)
    assert kernel_check.compare_paths(torch.device("cpu"), fast="fast") == [0, 1, 2, 3]


def test_a_failing_or_mismatching_fast_path_falls_back_with_a_warning(monkeypatch):
    from deploy.cli.commands import format_status
    from scheduler.messages import WorkerStats
    from cluster.status import ClusterStatus, RouterStatus

    kernel_check._checked_on.cache_clear()
    monkeypatch.setattr(kernel_check, "compare_paths", lambda device: [1])
    choice = kernel_check._checked_on("cuda:7")
    assert choice.kernels == "reference" and "requests [1]" in choice.warning

    def boom(device):
        raise RuntimeError("no kernel image is available")

    kernel_check._checked_on.cache_clear()
    monkeypatch.setattr(kernel_check, "compare_paths", boom)
    choice = kernel_check._checked_on("cuda:7")
    assert choice.kernels == "reference" and "no kernel image" in choice.warning
    kernel_check._checked_on.cache_clear()

    engine = Engine(EngineConfig(budget_bytes=8 * MiB, kv_bytes=2 * MiB, slab_bytes=1 * MiB, host_kv_bytes=0))
    engine.kernel_warning = choice.warning
    status = ClusterStatus(workers={"w0": WorkerStats(worker_id="w0", node_id="n", device="cuda:7",
                                                      engine=engine.stats())},
                           router=RouterStatus(workers={}, pending={}, servable=()), plan=None)
    assert "w0: WARNING fast kernel path failed its check" in format_status(status)
