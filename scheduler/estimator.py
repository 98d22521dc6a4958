"""Step-latency estimator: how long a prefill, a decode step and a model switch will take.

Per model, small linear models are fitted online (least squares on relative error, over
exponentially forgotten observations, so the fit follows the machine it runs on):

  prefill  t = a + b * num_tokens + c * num_requests
  decode   t = a + b * batch_size + c * num_context_tokens
  switch   t = EWMA of measured switch times, else weight_bytes / bandwidth

`seed_from_profile` feeds the same fits with Aegaeon's measured GPU profiles
(profiles/MODEL/GPU/iNbB.json: B requests of N input tokens; avg_prefill_latency and
avg_decode_latency in seconds), which is how the fleet simulator gets real costs.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re

logger = logging.getLogger(__name__)

_PROFILE_NAME = re.compile(r"^i(\d+)b(\d+)\.json$")
# Features are scaled to O(1) so the normal equations stay well conditioned.
_PREFILL_SCALE = (1.0, 1 / 1024, 1 / 8)  # 1, num_tokens, num_requests
_DECODE_SCALE = (1.0, 1 / 32, 1 / 8192)  # 1, batch_size, num_context_tokens


class OnlineLinearFit:
    """y ~ coef . x, fitted by least squares over observations forgotten at rate `forget`.

    x[0] is the intercept feature (1.0). A small ridge on the other coefficients keeps the
    solution defined before the data spans every direction (then those slopes stay ~0).

    The fit is redone lazily: the sums are updated on every observation (cheap), but the
    solve (a few 3x3 systems, ~30 us of Python) only after `refit_every` observations, or
    sooner when `refit_misses` observations in a row are off the current fit by more than
    `refit_tol` (relative): a change of regime persists, while one slow step (a page fault,
    a neighbour's burst) is noise, and on a busy machine such outliers came every ~8 steps
    and made the engine solve four times as often as it needed to. The engine observes every
    step, and one observation barely moves a fit over ~1 / (1 - forget) of them.
    """

    def __init__(self, num_features: int, forget: float = 0.99, ridge: float = 1e-6,
                 refit_tol: float = 0.5, refit_every: int = 32, refit_misses: int = 2):
        if not 0 < forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {forget!r}")
        if refit_tol < 0 or refit_every < 1 or refit_misses < 1:
            raise ValueError(f"refit_tol must be >= 0, refit_every and refit_misses >= 1; got {refit_tol!r}, "
                             f"{refit_every!r}, {refit_misses!r}")
        self.num_features = num_features
        self.forget = forget
        self.ridge = ridge
        self.refit_tol = refit_tol
        self.refit_every = refit_every
        self.refit_misses = refit_misses
        self.num_observations = 0
        self.num_fits = 0
        self._xtx = [[0.0] * num_features for _ in range(num_features)]
        self._xty = [0.0] * num_features
        self._yty = 0.0
        self._coef: list[float] | None = None
        self._stale = 0   # observations since the last solve
        self._misses = 0  # consecutive observations the current fit was off by more than refit_tol

    def observe(self, x, y: float, weight: float = 1.0, forget: float | None = None) -> None:
        if len(x) != self.num_features:
            raise ValueError(f"expected {self.num_features} features, got {len(x)}")
        lam = self.forget if forget is None else forget
        self._yty = lam * self._yty + weight * y * y
        # x'x is symmetric: update the upper triangle and mirror it (this runs every engine step)
        xty, xtx = self._xty, self._xtx
        for i, xi in enumerate(x):
            wxi = weight * xi
            xty[i] = lam * xty[i] + wxi * y
            row = xtx[i]
            for j in range(i, len(x)):
                v = lam * row[j] + wxi * x[j]
                row[j] = v
                xtx[j][i] = v
        self.num_observations += 1
        self._stale += 1
        coef = self._coef
        if coef is not None and self._stale < self.refit_every:
            predicted = sum(c * v for c, v in zip(coef, x))
            if abs(predicted - y) <= self.refit_tol * abs(y):
                self._misses = 0
                return   # the current fit still explains the data: keep it
            self._misses += 1
            if self._misses < self.refit_misses:
                return   # one outlier is noise; a run of them is a new regime
        self._coef = None

    def refit(self) -> None:
        """Solve now (e.g. after a table of observations, which should fit exactly)."""
        self._coef = None

    @property
    def coef(self) -> list[float] | None:
        if self.num_observations == 0:
            return None
        if self._coef is None:
            self._coef = self._fit_nonnegative_slopes()
            self._stale = self._misses = 0
            self.num_fits += 1
        return self._coef

    def _fit_nonnegative_slopes(self) -> list[float]:
        # A step never gets faster with more tokens, so slopes are constrained to be >= 0
        # (noise, or a cost curve that is not linear, would otherwise turn one negative).
        # With so few features the exact answer is cheap: fit every subset of slopes and keep
        # the feasible fit with the least (weighted) squared error.
        k = self.num_features
        best, best_err = None, math.inf
        for mask in range(1 << (k - 1)):
            active = [0] + [i for i in range(1, k) if mask >> (i - 1) & 1]
            coef = self._solve_subset(active)
            if any(c < 0 for c in coef[1:]):
                continue
            err = self._yty - 2 * sum(c * b for c, b in zip(coef, self._xty)) + sum(
                coef[i] * self._xtx[i][j] * coef[j] for i in range(k) for j in range(k)
            )
            if err < best_err:
                best, best_err = coef, err
        return best

    def _solve_subset(self, active: list[int]) -> list[float]:
        a = [[self._xtx[i][j] for j in active] + [self._xty[i]] for i in active]
        scale = max(self._xtx[0][0], 1e-12)
        for r in range(1, len(active)):
            a[r][r] += self.ridge * scale
        coef = [0.0] * self.num_features
        for i, c in zip(active, _solve(a)):
            coef[i] = c
        return coef

    def predict(self, x) -> float | None:
        coef = self.coef
        return None if coef is None else sum(c * v for c, v in zip(coef, x))


def _solve(a: list[list[float]]) -> list[float]:
    """Gaussian elimination with partial pivoting on an augmented k x (k+1) matrix."""
    k = len(a)
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            continue
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            for c in range(col, k + 1):
                a[r][c] -= f * a[col][c]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        if abs(a[r][r]) < 1e-300:
            continue
        x[r] = (a[r][k] - sum(a[r][c] * x[c] for c in range(r + 1, k))) / a[r][r]
    return x


class StepLatencyEstimator:
    def __init__(
        self,
        switch_bandwidth_bytes_s: float = 8e9,
        default_prefill_s_per_token: float = 2e-4,
        default_decode_step_s: float = 0.02,
        forget: float = 0.99,
        switch_ewma: float = 0.3,
        min_step_s: float = 1e-5,
    ):
        if switch_bandwidth_bytes_s <= 0:
            raise ValueError(f"switch_bandwidth_bytes_s must be > 0, got {switch_bandwidth_bytes_s!r}")
        if default_prefill_s_per_token <= 0 or default_decode_step_s <= 0:
            raise ValueError("default step times must be > 0")
        if not 0 < switch_ewma <= 1:
            raise ValueError(f"switch_ewma must be in (0, 1], got {switch_ewma!r}")
        self.switch_bandwidth_bytes_s = switch_bandwidth_bytes_s
        self.default_prefill_s_per_token = default_prefill_s_per_token
        self.default_decode_step_s = default_decode_step_s
        self.forget = forget
        self.switch_ewma = switch_ewma
        self.min_step_s = min_step_s
        self._weight_bytes: dict[str, int] = {}
        self._prefill: dict[str, OnlineLinearFit] = {}
        self._decode: dict[str, OnlineLinearFit] = {}
        self._switch: dict[str, float] = {}

    def register_model(self, model: str, weight_bytes: int) -> None:
        if weight_bytes < 0:
            raise ValueError(f"weight_bytes of {model!r} must be >= 0, got {weight_bytes!r}")
        self._weight_bytes[model] = weight_bytes

    # -- predictions ---------------------------------------------------------------------

    def predict_prefill(self, model: str, num_tokens: int, num_requests: int = 1) -> float:
        fit = self._prefill.get(model)
        t = fit.predict(_scaled(_PREFILL_SCALE, num_tokens, num_requests)) if fit else None
        if t is None:
            t = self.default_prefill_s_per_token * num_tokens
        return max(t, self.min_step_s)

    def predict_decode(self, model: str, batch_size: int, num_context_tokens: int) -> float:
        fit = self._decode.get(model)
        t = fit.predict(_scaled(_DECODE_SCALE, batch_size, num_context_tokens)) if fit else None
        return max(self.default_decode_step_s if t is None else t, self.min_step_s)

    def predict_switch(self, model: str) -> float:
        """Time to bring `model`'s weights onto the device (0 for an unknown size)."""
        if model in self._switch:
            return self._switch[model]
        return self._weight_bytes.get(model, 0) / self.switch_bandwidth_bytes_s

    # -- online fit ----------------------------------------------------------------------

    def observe_prefill(self, model: str, num_tokens: int, num_requests: int, seconds: float,
                        _forget: float | None = None) -> None:
        fit = self._prefill.get(model) or self._prefill.setdefault(model, OnlineLinearFit(3, self.forget))   # no new fit a step
        fit.observe(_scaled(_PREFILL_SCALE, num_tokens, num_requests), seconds, _relative(seconds), _forget)

    def observe_decode(self, model: str, batch_size: int, num_context_tokens: int, seconds: float,
                       _forget: float | None = None) -> None:
        fit = self._decode.get(model) or self._decode.setdefault(model, OnlineLinearFit(3, self.forget))   # no new fit a step
        fit.observe(_scaled(_DECODE_SCALE, batch_size, num_context_tokens), seconds, _relative(seconds), _forget)

    def observe_switch(self, model: str, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"switch time must be >= 0, got {seconds!r}")
        old = self._switch.get(model)
        self._switch[model] = seconds if old is None else old + self.switch_ewma * (seconds - old)

    def seed_from_profile(self, model: str, profile_dir: str) -> int:
        """Fit `model` from a directory of iNbB.json profiles; returns the number of files read."""
        if not os.path.isdir(profile_dir):
            raise ValueError(f"profile directory {profile_dir!r} does not exist")
        points = []  # (num_input_tokens, batch_size, prefill_s, decode_s)
        for name in sorted(os.listdir(profile_dir)):
            m = _PROFILE_NAME.match(name)
            if not m:
                continue
            path = os.path.join(profile_dir, name)
            with open(path) as f:
                data = json.load(f)
            try:
                prefill_s = float(data["avg_prefill_latency"])
                decode_s = float(data["avg_decode_latency"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}: missing or bad avg_prefill_latency/avg_decode_latency") from e
            points.append((int(m.group(1)), int(m.group(2)), prefill_s, decode_s))
        if not points:
            raise ValueError(f"no iNbB.json profiles in {profile_dir!r}")
        # Some profiles measured no real decode step (e.g. i4096b2 on H20 reports 0.35 ms
        # against ~12 ms everywhere else); a decode step far below the median is dropped.
        floor = sorted(p[3] for p in points)[len(points) // 2] / 4
        for n_in, batch, prefill_s, decode_s in points:
            # a profile is a table, not a time series: no forgetting among its points
            self.observe_prefill(model, n_in * batch, batch, prefill_s, _forget=1.0)
            if decode_s >= floor:
                self.observe_decode(model, batch, n_in * batch, decode_s, _forget=1.0)
        for fit in (self._prefill.get(model), self._decode.get(model)):
            if fit is not None:
                fit.refit()
        count = len(points)
        logger.info("seeded %s from %d profiles in %s", model, count, profile_dir)
        return count


def _relative(seconds: float) -> float:
    # weight 1/y^2: least squares on relative error, so short steps are predicted as well as long ones
    return 1.0 / max(seconds, 1e-6) ** 2


def _scaled(scale, a: float, b: float) -> list[float]:
    return [scale[0], a * scale[1], b * scale[2]]
