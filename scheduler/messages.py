"""Typed messages that cross process and actor boundaries: one schema, one producer each.

    data plane     GenerateRequest   ingress -> worker             (deploy/serve_app/cluster_engine.py)
                   OutputFrame       worker -> ingress, per frame  (actors/engine.py, actors/worker.py); a
                                     handed-off request's frames come straight from its decode worker
                   HandoffState      prefill worker -> decode worker, with the KV descriptor (actors/engine.py)
                   HandoffAck        decode worker -> prefill worker, adopt_prefilled's answer (actors/worker.py)
    control plane  RegisteredModel   worker -> placement           (actors/engine.py register_model)
                   WorkerStats       worker -> router, status      (actors/worker.py; EngineStats: actors/engine.py)
                   WorkerView        router's snapshot of a worker (scheduler/routing.py, from WorkerStats)
                   PlacementPlan     placement -> router           (scheduler/placement.py, the plan update)

Only diffs travel: a request is sent once; afterwards each OutputFrame carries just the
tokens produced since the previous frame (never one actor call per token). Ray carries the
dataclasses themselves; `to_dict` (and `from_dict` where a reader needs one) gives the
plain form for msgpack and JSON. A consumer reads fields, never keys a producer may not
write: a drifted key once left the router blind to every worker's step time.

What a worker reports of itself to the layers above (WorkerHealth, WorkerTelemetry with its
DeviceReading, StepRecord) is in actors/worker_reports.py; what the control plane says to
itself and to operators (LoadReport, RouterStatus, ClusterStatus, ...) in cluster/status.py; the HTTP edge's own request (IngressRequest) in
deploy/openai_api/protocol.py: each beside its readers.
"""
from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple

from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    slo: SLO = field(default_factory=SLO)
    arrival_time: float = 0.0  # wall clock (time.time()) when the system accepted it

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be non-empty")
        if not self.model:
            raise ValueError("model must be non-empty")
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")

    def check(self) -> "GenerateRequest":
        """Run the constructors' checks again (this request's, its sampling params', its SLO's)
        and return self. For a receiver: Ray unpickles a request without running them, so a
        caller that built one around them (object.__setattr__) would otherwise reach the engine."""
        for part in (self, self.sampling_params, self.slo):
            type(part).__post_init__(part)
        return self

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "model": self.model,
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling_params": self.sampling_params.to_dict(),
            "slo": asdict(self.slo),
            "arrival_time": self.arrival_time,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "GenerateRequest":
        return cls(
            request_id=d["request_id"],
            model=d["model"],
            prompt_token_ids=tuple(d["prompt_token_ids"]),
            sampling_params=SamplingParams.from_dict(d.get("sampling_params", {})),
            slo=SLO(**d.get("slo", {})),
            arrival_time=d.get("arrival_time", 0.0),
        )


# Named actors of one tokenmux cluster, looked up by name from any process (the worker
# finds the router by it without importing the control plane).
ROUTER_NAME = "tokenmux-router"
PLACEMENT_NAME = "tokenmux-placement"

# finish_reason values, as in the OpenAI API, plus "cancelled" and "error".
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_CANCELLED = "cancelled"
FINISH_ERROR = "error"


@dataclass
class OutputFrame:
    """New output of one request since its previous frame.

    token_times[i] is the wall-clock time token_ids[i] was produced (for TTFT/TBT).
    An error is a value in the stream (finish_reason="error", error=message), never an
    exception through the layers.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    worker_id: str | None = None
    # The model version that served it (the live catalog's fingerprint, name@vN): set at the edge.
    model_version: str | None = None
    # Set on a prefill worker's last frame: the request goes on at this decode worker, whose
    # `generate_prefilled(request_id)` the reader opens (actors/frame_stream.py follows it).
    moved_to: DecodeTarget | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict:
        d = asdict(replace(self, moved_to=None))   # a handoff is followed where frames are read, never sent on
        del d["moved_to"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "OutputFrame":
        return cls(**d)


# ---- KV handoff (prefill worker <-> decode worker) ---------------------------------------


@dataclass(frozen=True)
class HandoffState:
    """What rides with the KV descriptor on the decode dispatch: the request and its output so far."""

    request: GenerateRequest
    output_token_ids: tuple[int, ...]
    token_times: tuple[float, ...]
    num_computed_tokens: int      # tokens whose KV the descriptor carries (0: recompute them)
    num_sent_chars: int           # output text the caller already has

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_token_ids", tuple(int(t) for t in self.output_token_ids))
        object.__setattr__(self, "token_times", tuple(float(t) for t in self.token_times))
        if self.num_computed_tokens < 0 or self.num_sent_chars < 0:
            raise ValueError(f"num_computed_tokens and num_sent_chars must be >= 0, got "
                             f"{self.num_computed_tokens}, {self.num_sent_chars}")

    @classmethod
    def continuing(cls, request: GenerateRequest, output_token_ids, token_times, num_sent_chars: int,
                   num_computed_tokens: int = 0) -> "HandoffState":
        """`request`, continued on another worker after `output_token_ids`. num_computed_tokens: the
        tokens whose KV rides along (the prefill worker's detach); 0 when none does, and the receiver
        recomputes the prompt and the output so far (a broken decode stream, a resume after a death)."""
        return cls(request, tuple(output_token_ids), tuple(token_times), num_computed_tokens, num_sent_chars)


@dataclass(frozen=True)
class HandoffAck:
    """The decode worker's answer, before any frame: KV adopted, queued for recompute, or refused."""

    adopted: bool
    error: str | None = None      # refused (unknown model, bad state): the sender keeps the request


class DecodeTarget(NamedTuple):
    """The worker a prefilled request's KV goes to (router.pick_decode)."""

    worker_id: str
    node_id: str
    handle: Any


# ---- worker stats (worker -> router, placement, status) -----------------------------------


@dataclass(frozen=True)
class RegisteredModel:
    """A model a worker can serve now (producer: Engine.register_model)."""

    name: str
    path: str
    architecture: str
    max_context: int
    weight_bytes: int
    kv_block_bytes: int

ROLES = ("mixed", "prefill", "decode")
RESIDENT, HOST_CACHED, COLD = 0, 1, 2  # residency tiers, best first


@dataclass(frozen=True)
class HandoffCounts:
    handed_off: int = 0     # prefilled here, decoded elsewhere
    adopted: int = 0        # prefilled elsewhere, KV adopted here
    recomputed: int = 0     # prefilled elsewhere, KV could not be adopted: prefix recomputed here


@dataclass(frozen=True)
class EngineStats:
    """What one engine measured (producer: actors/engine.py Engine.stats)."""

    registered: tuple[str, ...] = ()
    resident: tuple[str, ...] = ()          # weights in a device slot now
    num_slots: int = 1
    slot_bytes: int = 0
    budget_bytes: int = 0
    queue_depth: Mapping[str, int] = field(default_factory=dict)   # per model: requests not running yet
    running: Mapping[str, int] = field(default_factory=dict)       # per model: requests decoding
    kv_free_frac: float = 1.0
    num_steps: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0
    decode_step_s: float = 0.0              # EMA of a decode step's wall time, all models (0: none yet)
    decode_step_s_by_model: Mapping[str, float] = field(default_factory=dict)   # the same, per model
    alpha: float | None = None              # quota rule's alpha of the latest round (token-level policy)
    weights: Mapping[str, Any] = field(default_factory=dict)   # weight-slot counters (WeightSlots.stats)
    kernels: str = "reference"              # the kernel path it runs ("reference" | "fast")
    kernel_warning: str = ""                # why the fast path was refused on its device ("" = none)
    num_preemptions: int = 0                # requests preempted for KV blocks (swapped to host or recomputed)

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_free_frac <= 1.0:
            raise ValueError(f"kv_free_frac must be in [0, 1], got {self.kv_free_frac!r}")
        if self.decode_step_s < 0 or any(v < 0 for v in self.decode_step_s_by_model.values()):
            raise ValueError("decode step times must be >= 0")
        object.__setattr__(self, "registered", tuple(self.registered))
        object.__setattr__(self, "resident", tuple(self.resident))


@dataclass(frozen=True)
class WorkerStats:
    """What DeviceWorker.stats() reports (producer: actors/worker.py): who it is, and its engine."""

    worker_id: str
    node_id: str
    engine: EngineStats
    role: str = "mixed"
    device: str = "cpu"
    pid: int = 0
    handoff: HandoffCounts = field(default_factory=HandoffCounts)

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    def to_dict(self) -> dict:
        return asdict(self)


# ---- the router's view of a worker, and what it reports ----------------------------------


@dataclass(frozen=True)
class WorkerView:
    """Snapshot of one worker, as the router last saw it (built by `from_stats`)."""

    worker_id: str
    node_id: str
    registered: frozenset[str] = frozenset()
    resident: frozenset[str] = frozenset()       # weights in a device slot now
    host_cached: frozenset[str] = frozenset()    # in the host weight cache of this node
    load_by_model: Mapping[str, int] = field(default_factory=dict)  # queued + running
    kv_free_frac: float = 1.0
    role: str = "mixed"
    num_slots: int = 1
    slot_bytes: int = 0
    step_time_s: float = 0.0                     # EMA of one decode step; 0 = unknown
    alive: bool = True

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0.0 <= self.kv_free_frac <= 1.0:
            raise ValueError(f"kv_free_frac must be in [0, 1], got {self.kv_free_frac!r}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots!r}")
        if self.slot_bytes < 0 or self.step_time_s < 0:
            raise ValueError("slot_bytes and step_time_s must be >= 0")
        if any(v < 0 for v in self.load_by_model.values()):
            raise ValueError(f"load_by_model values must be >= 0, got {dict(self.load_by_model)!r}")
        for name in ("registered", "resident", "host_cached"):
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        object.__setattr__(self, "load_by_model", dict(self.load_by_model))

    @property
    def load(self) -> int:
        """Requests queued or running on this worker, all models together."""
        return sum(self.load_by_model.values())

    def residency(self, model: str) -> int:
        if model in self.resident:
            return RESIDENT
        if model in self.host_cached or model in self.registered:
            return HOST_CACHED
        return COLD

    @classmethod
    def from_stats(cls, stats: WorkerStats, host_cached=(), extra_load: Mapping[str, int] | None = None,
                   alive: bool = True, node_id: str | None = None) -> "WorkerView":
        """The view of a worker from its `stats()`.

        `extra_load` holds requests the router dispatched that the worker may not have
        counted yet (sent after its last stats); per model the larger count wins.
        `node_id`: where the router placed the worker (overrides what the worker says).
        """
        engine = stats.engine
        load: collections.Counter = collections.Counter()
        for counts in (engine.queue_depth, engine.running):
            load.update({m: int(n) for m, n in counts.items()})
        for model, n in (extra_load or {}).items():
            load[model] = max(load[model], int(n))
        return cls(
            worker_id=stats.worker_id, node_id=node_id if node_id is not None else stats.node_id,
            registered=frozenset(engine.registered), resident=frozenset(engine.resident),
            host_cached=frozenset(host_cached), load_by_model={m: n for m, n in load.items() if n > 0},
            kv_free_frac=engine.kv_free_frac, role=stats.role, num_slots=engine.num_slots,
            slot_bytes=engine.slot_bytes, step_time_s=engine.decode_step_s, alive=alive)

    def to_dict(self) -> dict:
        return {
            "worker_id": self.worker_id, "node_id": self.node_id,
            "registered": sorted(self.registered), "resident": sorted(self.resident),
            "host_cached": sorted(self.host_cached), "load_by_model": dict(self.load_by_model),
            "load": self.load, "kv_free_frac": self.kv_free_frac, "role": self.role,
            "num_slots": self.num_slots, "slot_bytes": self.slot_bytes,
            "step_time_s": self.step_time_s, "alive": self.alive,
        }
