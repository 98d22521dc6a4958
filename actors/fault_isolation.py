"""Which request an engine step's failure belongs to, so that it fails that request alone.

    run_isolated(forward, sample, requests) -> ({request_id: token}, {request_id: why it failed})

Sampling is per request: a row that cannot be sampled (logits not finite) or a sampler
that raises fails only the requests it names. A forward that raises is retried one
request at a time (rerunning a chunk rewrites the same KV positions with the same values,
so there is nothing to undo); only the requests that fail alone too are failed. What no
request explains raises: a device fault (a CUDA error leaves the device unusable for
everyone), or a batch none of whose requests runs even alone. The engine's caller then
ends every request on the device (`Engine.fail_all`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from actors.sampler import INVALID_TOKEN
from scheduler.request import Request

logger = logging.getLogger(__name__)


class GroupLost(RuntimeError):
    """A member of a tensor-parallel group is gone mid-step: the fault of no request, nor of
    this device; the leader's requests of the group wait for it to be formed again (Engine.strand)."""

Forward = Callable[[list[Request]], torch.Tensor]             # requests -> logits [B, vocab]
Sample = Callable[[list[Request], torch.Tensor], list[int]]   # (requests, logits) -> B tokens


def run_isolated(forward: Forward, sample: Sample, requests: list[Request]
                 ) -> tuple[dict[str, int], dict[str, str]]:
    try:
        logits = forward(requests)
    except Exception as exc:
        if is_device_fault(exc) or isinstance(exc, GroupLost):
            raise
        return _one_by_one(forward, sample, requests, exc)
    return _sample(sample, requests, logits)


def is_device_fault(exc: BaseException) -> bool:
    """A CUDA error (torch raises AcceleratorError) poisons the device for every request."""
    return isinstance(exc, torch.AcceleratorError) or "CUDA error" in str(exc)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _one_by_one(forward: Forward, sample: Sample, requests: list[Request], batch_exc: Exception
                ) -> tuple[dict[str, int], dict[str, str]]:
    if len(requests) == 1:
        return {}, {requests[0].request_id: f"forward failed: {describe(batch_exc)}"}
    logger.warning("forward of %d requests failed (%s); running them one by one", len(requests),
                   describe(batch_exc))
    sampled: dict[str, int] = {}
    failed: dict[str, str] = {}
    for request in requests:
        try:
            logits = forward([request])
        except Exception as exc:
            if is_device_fault(exc) or isinstance(exc, GroupLost):
                raise
            failed[request.request_id] = f"forward failed: {describe(exc)}"
            continue
        one_sampled, one_failed = _sample(sample, [request], logits)
        sampled.update(one_sampled)
        failed.update(one_failed)
    if not sampled:   # not one request runs alone: the device, not a request
        raise batch_exc
    return sampled, failed


def _sample(sample: Sample, requests: list[Request], logits: torch.Tensor
            ) -> tuple[dict[str, int], dict[str, str]]:
    try:
        tokens = sample(requests, logits)
    except Exception as exc:
        if len(requests) == 1:
            return {}, {requests[0].request_id: f"sampling failed: {describe(exc)}"}
        # Unexpected (the sampler marks bad rows itself): find the culprit row by row; a
        # seeded row has then drawn twice this step.
        tokens = []
        for i, request in enumerate(requests):
            try:
                tokens += sample([request], logits[i:i + 1])
            except Exception:
                tokens.append(INVALID_TOKEN)
    sampled = {r.request_id: t for r, t in zip(requests, tokens) if t != INVALID_TOKEN}
    failed = {r.request_id: "sampling failed: the model's logits for this request are not finite"
              for r, t in zip(requests, tokens) if t == INVALID_TOKEN}
    return sampled, failed
