"""Synthetic workloads: when requests arrive, which model they ask for, how long they are.

A workload is three independent, seeded choices combined by `generate`:
arrivals (Poisson, Gamma with a chosen burstiness, on/off bursts), model popularity
(uniform, Zipf, or a long tail calibrated to a production figure) and lengths (resampled
from a real trace, or drawn from a distribution). Everything takes a numpy Generator, so
one seed reproduces the same workload bit for bit.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Iterator, Protocol, Sequence

import numpy as np

logger = logging.getLogger(__name__)

# Aegaeon's production observation: 94.1% of models receive 1.35% of requests.
AEGAEON_TAIL_MODEL_SHARE = 0.941
AEGAEON_TAIL_REQUEST_SHARE = 0.0135


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds since the start of the workload
    model: str
    input_len: int  # prompt tokens
    output_len: int  # tokens to generate

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if not self.model:
            raise ValueError("model must be non-empty")
        if self.input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {self.input_len!r}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len!r}")


@dataclass(frozen=True)
class Workload:
    """Requests sorted by arrival time."""

    requests: tuple[TraceRequest, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        times = [r.arrival_s for r in self.requests]
        if any(b < a for a, b in zip(times, times[1:])):
            raise ValueError("workload requests must be sorted by arrival_s")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> TraceRequest:
        return self.requests[i]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def models(self) -> list[str]:
        """Distinct models, most requested first (ties by name)."""
        counts: dict[str, int] = {}
        for r in self.requests:
            counts[r.model] = counts.get(r.model, 0) + 1
        return sorted(counts, key=lambda m: (-counts[m], m))

    def time_scaled(self, speedup: float) -> "Workload":
        """Replay `speedup` times faster (2.0 halves every arrival time)."""
        if not speedup > 0 or not math.isfinite(speedup):
            raise ValueError(f"speedup must be a finite number > 0, got {speedup!r}")
        return Workload(tuple(replace(r, arrival_s=r.arrival_s / speedup) for r in self.requests))

    def window(self, start_s: float = 0.0, end_s: float | None = None,
               max_requests: int | None = None) -> "Workload":
        """Requests arriving in [start_s, end_s), re-based to start at 0, at most max_requests."""
        if start_s < 0:
            raise ValueError(f"start_s must be >= 0, got {start_s!r}")
        if end_s is not None and end_s <= start_s:
            raise ValueError(f"end_s must be > start_s, got start_s={start_s!r} end_s={end_s!r}")
        if max_requests is not None and max_requests < 0:
            raise ValueError(f"max_requests must be >= 0, got {max_requests!r}")
        kept = [replace(r, arrival_s=r.arrival_s - start_s) for r in self.requests
                if r.arrival_s >= start_s and (end_s is None or r.arrival_s < end_s)]
        if max_requests is not None:
            kept = kept[:max_requests]
        return Workload(tuple(kept))


# ---------------------------------------------------------------- arrival processes


class ArrivalProcess(Protocol):
    @property
    def mean_rate(self) -> float: ...

    def sample(self, rng: np.random.Generator, duration_s: float | None = None,
               num_requests: int | None = None) -> np.ndarray: ...


def _check_bounds(duration_s: float | None, num_requests: int | None) -> None:
    if duration_s is None and num_requests is None:
        raise ValueError("give duration_s or num_requests (or both) to bound the arrivals")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests!r}")


def _renewal(gaps_fn, mean_gap: float, rng: np.random.Generator, duration_s: float | None,
             num_requests: int | None) -> np.ndarray:
    """Arrival times from i.i.d. gaps, cut at duration_s and/or num_requests."""
    _check_bounds(duration_s, num_requests)
    if num_requests is not None:
        times = np.cumsum(gaps_fn(rng, num_requests))
    else:
        times = np.empty(0)
        while not times.size or times[-1] < duration_s:
            batch = max(16, int(1.2 * (duration_s - (times[-1] if times.size else 0)) / mean_gap))
            start = times[-1] if times.size else 0.0
            times = np.concatenate([times, start + np.cumsum(gaps_fn(rng, batch))])
    if duration_s is not None:
        times = times[times < duration_s]
    return times


@dataclass(frozen=True)
class Poisson:
    """Exponential gaps: the memoryless baseline (coefficient of variation 1)."""

    rate: float  # requests per second

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate!r}")

    @property
    def mean_rate(self) -> float:
        return self.rate

    def sample(self, rng, duration_s=None, num_requests=None) -> np.ndarray:
        return _renewal(lambda g, n: g.exponential(1.0 / self.rate, n), 1.0 / self.rate,
                        rng, duration_s, num_requests)


@dataclass(frozen=True)
class Gamma:
    """Gamma gaps with a chosen coefficient of variation: cv > 1 is burstier than Poisson.

    A plain Gamma with cv = 4 (shape 1/16) puts most of its gaps within a hair of 0: 55% of
    them are under 0.1% of the mean gap, so a burst is dozens of requests at one instant,
    which no client sends and which no time scaling separates again. The gaps here are
    shifted: gap = min_gap + Gamma, the Gamma's mean and shape chosen so that the gaps keep
    exactly the mean 1 / rate and the coefficient of variation cv. min_gap is a share of the
    mean gap (`min_gap_frac`, default 5%), so a burst arrives at up to 20x the mean rate and
    a sample time-scaled to another rate keeps the same shape. min_gap_frac = 0 is the plain
    Gamma.
    """

    rate: float  # requests per second
    cv: float  # std / mean of the gaps
    min_gap_frac: float = 0.05  # smallest gap, as a share of the mean gap 1 / rate

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate!r}")
        if not self.cv > 0:
            raise ValueError(f"cv must be > 0, got {self.cv!r}")
        if not 0 <= self.min_gap_frac < 1:
            raise ValueError(f"min_gap_frac must be in [0, 1), got {self.min_gap_frac!r}")

    @property
    def mean_rate(self) -> float:
        return self.rate

    def sample(self, rng, duration_s=None, num_requests=None) -> np.ndarray:
        mean = 1.0 / self.rate
        floor = self.min_gap_frac * mean
        # gap = floor + G: E[G] = mean - floor, std(G) = cv * mean (a shift keeps the std)
        shape = ((mean - floor) / (self.cv * mean)) ** 2
        scale = (mean - floor) / shape
        return _renewal(lambda g, n: floor + g.gamma(shape, scale, n), mean,
                        rng, duration_s, num_requests)


@dataclass(frozen=True)
class OnOff:
    """Poisson at rate_on for on_s seconds, then silence for off_s seconds, repeated."""

    rate_on: float
    on_s: float
    off_s: float

    def __post_init__(self) -> None:
        if not self.rate_on > 0:
            raise ValueError(f"rate_on must be > 0, got {self.rate_on!r}")
        if not self.on_s > 0:
            raise ValueError(f"on_s must be > 0, got {self.on_s!r}")
        if self.off_s < 0:
            raise ValueError(f"off_s must be >= 0, got {self.off_s!r}")

    @property
    def mean_rate(self) -> float:
        return self.rate_on * self.on_s / (self.on_s + self.off_s)

    def sample(self, rng, duration_s=None, num_requests=None) -> np.ndarray:
        # Arrivals in "on time" are Poisson; stretch on-time onto the wall clock by
        # inserting off_s after every on_s of it.
        on_duration = None
        if duration_s is not None:
            period = self.on_s + self.off_s
            full, rest = divmod(duration_s, period)
            on_duration = full * self.on_s + min(rest, self.on_s)
        on_times = Poisson(self.rate_on).sample(rng, on_duration, num_requests)
        return on_times + np.floor(on_times / self.on_s) * self.off_s


# ---------------------------------------------------------------- model popularity


class Popularity(Protocol):
    def weights(self, num_models: int) -> np.ndarray: ...  # [num_models], sums to 1, rank order


def _check_num_models(num_models: int) -> None:
    if num_models < 1:
        raise ValueError(f"num_models must be >= 1, got {num_models!r}")


@dataclass(frozen=True)
class Uniform:
    def weights(self, num_models: int) -> np.ndarray:
        _check_num_models(num_models)
        return np.full(num_models, 1.0 / num_models)


@dataclass(frozen=True)
class Zipf:
    """Model of rank i (1-based) gets weight proportional to i ** -alpha."""

    alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha!r}")

    def weights(self, num_models: int) -> np.ndarray:
        _check_num_models(num_models)
        w = np.arange(1, num_models + 1, dtype=float) ** -self.alpha
        return w / w.sum()


@dataclass(frozen=True)
class LongTail:
    """Zipf weights whose exponent is solved so that the least popular `tail_model_share`
    of the models receives exactly `tail_request_share` of the requests.

    The tail holds round(tail_model_share * M) models, kept within [1, M - 1] so that
    there is always a head and a tail. The tail's share falls monotonically as the Zipf
    exponent grows (from its model share at alpha = 0 towards 0), so bisection finds it.
    """

    tail_model_share: float = AEGAEON_TAIL_MODEL_SHARE
    tail_request_share: float = AEGAEON_TAIL_REQUEST_SHARE

    def __post_init__(self) -> None:
        if not 0 < self.tail_model_share < 1:
            raise ValueError(f"tail_model_share must be in (0, 1), got {self.tail_model_share!r}")
        if not 0 < self.tail_request_share < 1:
            raise ValueError(
                f"tail_request_share must be in (0, 1), got {self.tail_request_share!r}")

    def num_tail_models(self, num_models: int) -> int:
        return min(num_models - 1, max(1, round(self.tail_model_share * num_models)))

    def weights(self, num_models: int) -> np.ndarray:
        _check_num_models(num_models)
        if num_models < 2:
            raise ValueError("a long tail needs at least 2 models")
        n_tail = self.num_tail_models(num_models)
        if self.tail_request_share >= n_tail / num_models:
            raise ValueError(
                f"tail_request_share {self.tail_request_share} is not a long tail for "
                f"{n_tail} of {num_models} models (uniform already gives {n_tail / num_models:.3f})")

        def tail_share(alpha: float) -> float:
            w = Zipf(alpha).weights(num_models)
            return float(w[num_models - n_tail:].sum())

        lo, hi = 0.0, 1.0
        while tail_share(hi) > self.tail_request_share:
            hi *= 2
            if hi > 1e4:
                raise ValueError("cannot calibrate the long tail: exponent diverges")
        for _ in range(200):
            mid = (lo + hi) / 2
            if tail_share(mid) > self.tail_request_share:
                lo = mid
            else:
                hi = mid
        return Zipf((lo + hi) / 2).weights(num_models)


def sample_models(popularity: Popularity, models: Sequence[str], n: int,
                  rng: np.random.Generator) -> list[str]:
    """n model names; models[0] is the most popular."""
    if not models:
        raise ValueError("models must be non-empty")
    if len(set(models)) != len(models):
        raise ValueError(f"models must be distinct, got {list(models)}")
    idx = rng.choice(len(models), size=n, p=popularity.weights(len(models)))
    return [models[i] for i in idx]


# ---------------------------------------------------------------- lengths


class LengthSampler(Protocol):
    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]: ...


def _scale_clip(x: np.ndarray, scale: float, max_len: int | None) -> np.ndarray:
    y = np.maximum(1, np.rint(x * scale)).astype(np.int64)
    return np.minimum(y, max_len) if max_len is not None else y


@dataclass(frozen=True)
class _LengthLimits:
    input_scale: float = 1.0
    output_scale: float = 1.0
    max_input: int | None = None  # tiny CPU models have short contexts
    max_output: int | None = None

    def __post_init__(self) -> None:
        for name in ("input_scale", "output_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("max_input", "max_output"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v!r}")

    def apply(self, inputs: np.ndarray, outputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (_scale_clip(inputs, self.input_scale, self.max_input),
                _scale_clip(outputs, self.output_scale, self.max_output))


@dataclass(frozen=True)
class EmpiricalLengths(_LengthLimits):
    """Resample (input, output) pairs from a real trace, keeping each pair together."""

    pairs: np.ndarray = field(default_factory=lambda: np.empty((0, 2)), repr=False)  # [N, 2]

    def __post_init__(self) -> None:
        super().__post_init__()
        pairs = np.asarray(self.pairs)
        if pairs.ndim != 2 or pairs.shape[1] != 2 or not len(pairs):
            raise ValueError(f"pairs must be a non-empty [N, 2] array, got shape {pairs.shape}")
        object.__setattr__(self, "pairs", pairs)

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        picked = self.pairs[rng.integers(0, len(self.pairs), size=n)]
        return self.apply(picked[:, 0], picked[:, 1])


@dataclass(frozen=True)
class LogNormalLengths(_LengthLimits):
    """Lengths drawn from log-normal distributions with the given medians."""

    input_median: float = 512.0
    output_median: float = 128.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.input_median > 0 or not self.output_median > 0:
            raise ValueError("input_median and output_median must be > 0")
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma!r}")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        inputs = rng.lognormal(math.log(self.input_median), self.sigma, n)
        outputs = rng.lognormal(math.log(self.output_median), self.sigma, n)
        return self.apply(inputs, outputs)


@dataclass(frozen=True)
class FixedLengths:
    input_len: int
    output_len: int

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"lengths must be >= 1, got {self.input_len}, {self.output_len}")

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return np.full(n, self.input_len), np.full(n, self.output_len)


# ---------------------------------------------------------------- putting it together


def generate(arrivals: ArrivalProcess, popularity: Popularity, models: Sequence[str],
             lengths: LengthSampler, *, seed: int, duration_s: float | None = None,
             num_requests: int | None = None) -> Workload:
    """A seeded workload: arrival times, then a model and lengths for each arrival."""
    rng = np.random.default_rng(seed)
    times = arrivals.sample(rng, duration_s=duration_s, num_requests=num_requests)
    names = sample_models(popularity, models, len(times), rng)
    inputs, outputs = lengths.sample(len(times), rng)
    logger.info("generated %d requests over %.1f s for %d models", len(times),
                times[-1] if len(times) else 0.0, len(models))
    return Workload(tuple(
        TraceRequest(float(t), m, int(i), int(o))
        for t, m, i, o in zip(times, names, inputs, outputs)))
