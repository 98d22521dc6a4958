"""Step costs of one model type on one device, fitted once from its measured profiles.

A profile directory holds `iNbB.json` files: B requests of N prompt tokens each, with
`avg_prefill_latency` and `avg_decode_latency` in seconds (the format of Aegaeon's
artifact, `../shared/data/profiles/MODEL/GPU`, and of `tokenmux profile`). The fits are
the shapes Aegaeon's simulator uses (aegaeon/sim/estimator.py):

    prefill  t = a + b * T + c * Q    T = new tokens of the step, Q = sum_i n_i * (n_i + 2 p_i)
    decode   t = a + b * B + c * C    B = requests in the batch,  C = their context tokens

Q is the attention term: request i computes n_i new tokens over a prefix of p_i (0 for a
fresh prompt, the computed tokens when a preempted request resumes), so its attention work
grows as n_i^2 + 2 n_i p_i. Both fits are least squares on relative error with slopes kept
>= 0 (the estimator's `OnlineLinearFit`, with nothing forgotten: a profile is a table).
The artifact's profiles were taken with a 4096-token step budget: a prefill of more tokens
timed only its first 4096 (every H100/H20 profile flattens there), so those points are left
out of the prefill fit, and longer prefills are extrapolated.

`fit_profile(dir)` is cached per directory: a fleet of 16 workers x 20 models of three
types reads and fits three directories, once. `ProfiledEstimator` hands the fits to the
scheduling policies of simulated workers, so every policy predicts with the device's own
costs and nothing is re-fitted per worker.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from scheduler.estimator import OnlineLinearFit, StepLatencyEstimator

logger = logging.getLogger(__name__)

PROFILE_NAME = re.compile(r"^i(\d+)b(\d+)\.json$")
# Features scaled to O(1) so the normal equations stay well conditioned.
_PREFILL_SCALE = (1.0, 1 / 1024, 1 / (1024 * 1024))   # 1, T, Q
_DECODE_SCALE = (1.0, 1 / 32, 1 / 8192)               # 1, B, C
PROFILED_PREFILL_TOKENS = 4096   # the step budget the profiles were measured with


@dataclass(frozen=True)
class ProfilePoint:
    input_len: int       # N: prompt tokens per request
    batch_size: int      # B
    prefill_s: float     # one prefill step of B prompts of N tokens
    decode_s: float      # one decode step of B requests with N tokens of context each


@dataclass(frozen=True)
class StepCostFit:
    """Fitted step times of one model on one device (coefficients on the scaled features)."""

    prefill_coef: tuple[float, float, float]
    decode_coef: tuple[float, float, float]
    num_points: int
    source: str

    def prefill_s(self, num_tokens: int, attention_tokens2: float) -> float:
        """One prefill step of `num_tokens` new tokens whose attention term is `attention_tokens2`."""
        a, b, c = self.prefill_coef
        return max(1e-6, a + b * num_tokens * _PREFILL_SCALE[1] + c * attention_tokens2 * _PREFILL_SCALE[2])

    def prefill_prompts_s(self, prompt_lens: Sequence[int]) -> float:
        """One prefill step of fresh prompts of these lengths."""
        return self.prefill_s(sum(prompt_lens), sum(n * n for n in prompt_lens))

    def decode_s(self, batch_size: int, num_context_tokens: int) -> float:
        a, b, c = self.decode_coef
        return max(1e-6, a + b * batch_size * _DECODE_SCALE[1] + c * num_context_tokens * _DECODE_SCALE[2])

    def scaled(self, weights: float, kv: float) -> "StepCostFit":
        """This fit for a model that reads `weights` times the weights a step (its active
        parameters) and `kv` times the KV per context token: the fixed and per-token terms
        follow the weights, the attention terms the KV. Derived, not measured."""
        (pa, pb, pc), (da, db, dc) = self.prefill_coef, self.decode_coef
        return StepCostFit((pa * weights, pb * weights, pc * kv), (da * weights, db * weights, dc * kv),
                           self.num_points, f"{self.source} (scaled: weights x{weights:.3f}, KV x{kv:.3f})")

    def with_all_reduce(self, per_step_s: float, per_token_s: float) -> "StepCostFit":
        """This fit plus a tensor-parallel group's all-reduces: `per_step_s` on every step and
        `per_token_s` for each token it computes (a prefill's new tokens, a decode's batch)."""
        (pa, pb, pc), (da, db, dc) = self.prefill_coef, self.decode_coef
        return StepCostFit((pa + per_step_s, pb + per_token_s / _PREFILL_SCALE[1], pc),
                           (da + per_step_s, db + per_token_s / _DECODE_SCALE[1], dc), self.num_points,
                           f"{self.source} (+ all-reduce {per_step_s * 1e3:.2f} ms/step, "
                           f"{per_token_s * 1e6:.2f} us/token)")


def read_profile(profile_dir: str | Path) -> list[ProfilePoint]:
    """Every iNbB.json of a directory, as points; ValueError names the file that is wrong."""
    profile_dir = Path(profile_dir)
    if not profile_dir.is_dir():
        raise ValueError(f"profile directory {str(profile_dir)!r} does not exist")
    points = []
    for name in sorted(os.listdir(profile_dir)):
        m = PROFILE_NAME.match(name)
        if not m:
            continue
        path = profile_dir / name
        try:
            data = json.loads(path.read_text())
            points.append(ProfilePoint(int(m.group(1)), int(m.group(2)),
                                       float(data["avg_prefill_latency"]), float(data["avg_decode_latency"])))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: missing or bad avg_prefill_latency/avg_decode_latency ({e})") from None
    if not points:
        raise ValueError(f"no iNbB.json profiles in {str(profile_dir)!r}")
    return points


@functools.lru_cache(maxsize=None)
def _fit_cached(resolved_dir: str) -> StepCostFit:
    points = read_profile(resolved_dir)
    prefill, decode = OnlineLinearFit(3, forget=1.0), OnlineLinearFit(3, forget=1.0)
    # Some profiles measured no real decode step (i4096b2 on H20 reports 0.35 ms against
    # ~12 ms everywhere else): a decode step far below the median is dropped.
    floor = sorted(p.decode_s for p in points)[len(points) // 2] / 4
    for p in points:
        tokens, attention = p.input_len * p.batch_size, p.input_len * p.input_len * p.batch_size
        if tokens <= PROFILED_PREFILL_TOKENS:
            prefill.observe(_scaled(_PREFILL_SCALE, tokens, attention), p.prefill_s, 1.0 / p.prefill_s ** 2)
        if p.decode_s >= floor:
            decode.observe(_scaled(_DECODE_SCALE, p.batch_size, tokens), p.decode_s, 1.0 / p.decode_s ** 2)
    fit = StepCostFit(tuple(prefill.coef), tuple(decode.coef), len(points), resolved_dir)
    logger.info("fitted %s from %d profiles", resolved_dir, len(points))
    return fit


def fit_profile(profile_dir: str | Path) -> StepCostFit:
    """The cached fit of one profile directory (read and fitted on first use only)."""
    return _fit_cached(str(Path(profile_dir).resolve()))


def num_fits() -> int:
    """Profile directories fitted so far in this process (each exactly once)."""
    return _fit_cached.cache_info().misses


class ProfiledEstimator(StepLatencyEstimator):
    """The estimator of a simulated worker: step times come from each model's fitted profile.

    A real worker learns its step times online; a simulated device *is* its profile, so the
    policy predicts with the same costs the simulator charges. Switch times are still
    learnt from what the worker observes (a prefetched swap costs less than its bytes say),
    as on a real worker.
    """

    def __init__(self, fits: Mapping[str, StepCostFit], switch_bandwidth_bytes_s: float):
        super().__init__(switch_bandwidth_bytes_s=switch_bandwidth_bytes_s)
        self._fits = fits   # model name -> fit, shared by every worker of a run

    def predict_prefill(self, model: str, num_tokens: int, num_requests: int = 1) -> float:
        fit = self._fits.get(model)
        if fit is None:
            return super().predict_prefill(model, num_tokens, num_requests)
        return fit.prefill_s(num_tokens, num_tokens * num_tokens / max(1, num_requests))

    def predict_decode(self, model: str, batch_size: int, num_context_tokens: int) -> float:
        fit = self._fits.get(model)
        if fit is None:
            return super().predict_decode(model, batch_size, num_context_tokens)
        return fit.decode_s(batch_size, num_context_tokens)

    def observe_prefill(self, *args, **kwargs) -> None:
        """Nothing to learn: the profile is the device."""

    def observe_decode(self, *args, **kwargs) -> None:
        """Nothing to learn: the profile is the device."""


def _scaled(scale, a: float, b: float) -> list[float]:
    return [scale[0], a * scale[1], b * scale[2]]
