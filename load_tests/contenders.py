"""The contenders of a side-by-side load test, each brought up on the same devices and budgets.

    token              DeviceWorkers, policy "token"   (tokenmux: models switch between decode steps)
    token-no-cap       the same without the quota cap (Aegaeon's fixed Q_max)       } ablations of
    token-no-overload  the same without overload control (every batch shares)     } the token policy
    request            DeviceWorkers, policy "request" (a model runs until its requests finish)
    dedicated          one DeviceWorker per model, policy "dedicated" (no switching; N devices)
    multiplexed-N      Ray Serve @serve.multiplexed over transformers models, max_ongoing_requests
                       N (1, 2, 8; "multiplexed" is N = 8): the peer, LRU swaps

Every multiplexing contender gets `num_workers` devices (Ray actors with num_gpus=1,
num_cpus=0 and `threads_per_worker` torch threads each) and the same engine budget (device
bytes and weight slots); the peer's replicas hold at most `num_slots` models each, its LRU
cache size. For the DeviceWorker contenders dispatch is a fixed assignment, the same for
every policy: model i of the deployment's list (most popular first) is served by worker
i mod W, so each worker multiplexes the same models under each policy.

`dedicated` is scored as the fleet it needs: one device per model, at the same SLO. Its
devices are independent, so each model's share of the trace is replayed on a device of its
own, one device after another (never sharing the cores), and the records are merged: the
same requests, at the same times, each on a device that serves only its model. Models that
are copies of one checkpoint are identical devices, so they are measured on one worker, one
after another; each device's idle stretches are skipped (driver.run's idle_skip_s: the
device is empty then, so nothing a request sees changes). Its `devices` in the report is
the model count.

A contender is started, warmed up, measured and stopped before the next one starts:
contenders never share the cores while they are measured.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from cluster.planner.metrics import RequestRecord, Turn
from load_tests.driver import Prompt, Target, TargetError
from actors.worker_reports import StepRecord
from scheduler.messages import GenerateRequest, OutputFrame
from scheduler.policy_registry import POLICY_NAMES
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO

logger = logging.getLogger(__name__)

ENGINE_POLICIES = POLICY_NAMES
# token-level ablations: contender name -> SchedulerConfig fields it changes
TOKEN_ABLATIONS = {"token-no-cap": {"quota_switch_factor": None},
                   "token-no-overload": {"overload_control": False}}
MULTIPLEXED = {"multiplexed": 8, "multiplexed-1": 1, "multiplexed-2": 2, "multiplexed-8": 8}  # -> max_ongoing
CONTENDERS = (*ENGINE_POLICIES, *TOKEN_ABLATIONS, *MULTIPLEXED)
TIMELINE_LEN = 200_000  # steps kept per worker: a whole sweep point's timeline


@dataclass(frozen=True)
class Deployment:
    """What every contender is given: the same models, devices, budgets and SLO."""

    models: dict[str, str]  # served name -> checkpoint dir; order = popularity rank
    num_workers: int
    engine: dict  # EngineConfig kwargs shared by every worker (budget_bytes, kv_bytes, num_slots, ...)
    threads_per_worker: int = 1
    slo: SLO = field(default_factory=SLO)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a deployment needs at least one model")
        object.__setattr__(self, "models", dict(self.models))
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {self.num_workers!r}")
        if self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads_per_worker!r}")
        if "policy" in self.engine:
            raise ValueError("the engine config of a deployment must not set policy: each contender sets its own")
        if int(self.engine.get("num_slots", 3)) < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.engine.get('num_slots')!r}")

    @property
    def num_slots(self) -> int:
        from actors.engine import EngineConfig

        return int(self.engine.get("num_slots", EngineConfig.num_slots))

    def assignment(self, policy: str) -> dict[str, int]:
        """Served model -> worker index (see the module docstring)."""
        names = list(self.models)
        if policy == "dedicated":
            return {m: i for i, m in enumerate(names)}
        return {m: i % self.num_workers for i, m in enumerate(names)}

    def devices(self, contender: str) -> int:
        """Devices the contender is scored as: dedicated needs one per model."""
        return len(self.models) if contender == "dedicated" else self.num_workers


class Contender(ABC):
    """One system under test: start(deployment) -> driver Target; stop(); turns()."""

    name: str

    @abstractmethod
    def start(self, deployment: Deployment) -> Target: ...

    @abstractmethod
    def stop(self) -> None: ...

    @abstractmethod
    def turns(self, since: float, records: Sequence[RequestRecord] = ()) -> list[Turn]:
        """Which model ran when on each worker since wall-clock `since` (time.time()),
        in seconds from `since`; `records` are the run's, for contenders without a timeline."""

    def notes(self, deployment: Deployment) -> list[str]:
        return []

    def describe(self, deployment: Deployment) -> str:
        return self.name


def make_contender(name: str, scheduler: dict | None = None, via: str = "engine",
                   port: int | None = None) -> Contender:
    """A contender by name; `scheduler` (SchedulerConfig fields) applies to the token policy.
    via "http": the token and request policies as the Serve app on loopback `port`, driven
    over HTTP (one port for every contender of a run: Serve keeps the port it started with)."""
    if via == "http":
        if name not in ("token", "request"):
            raise ValueError(f"--via http runs the token and request contenders, got {name!r}")
        return ServeContender(name, scheduler=scheduler if name == "token" else None, port=port)
    if via != "engine":
        raise ValueError(f"via must be engine or http, got {via!r}")
    if name in ("token", "request"):
        return EngineContender(name, scheduler=scheduler if name == "token" else None)
    if name in TOKEN_ABLATIONS:
        return EngineContender("token", name=name, scheduler={**(scheduler or {}), **TOKEN_ABLATIONS[name]})
    if name == "dedicated":
        return DedicatedContender()
    if name in MULTIPLEXED:
        return MultiplexedContender(max_ongoing_requests=MULTIPLEXED[name], name=name)
    raise ValueError(f"unknown contender {name!r}; known: {', '.join(CONTENDERS)}")


# ---------------------------------------------------------------- DeviceWorker contenders


class EngineTarget:
    """A driver Target that sends each request to the worker its model is assigned to."""

    def __init__(self, workers: dict[str, object], slo: SLO, policy: str):
        self.workers = workers  # served model -> DeviceWorker handle
        self.slo = slo
        self.policy = policy
        self._ids = itertools.count()

    async def stream(self, model: str, prompt: Prompt, max_tokens: int,
                     request_id: str) -> AsyncIterator[OutputFrame]:
        from actors.frame_stream import stream_frames

        worker = self.workers.get(model)
        if worker is None:
            raise TargetError(f"no worker serves model {model!r} under the {self.policy} policy")
        if isinstance(prompt, str):
            raise ValueError("DeviceWorker targets take token-id prompts; run the driver with vocab_size")
        # ids stay unique on the worker across sweep points and warm-ups
        req = GenerateRequest(f"{request_id}.{next(self._ids)}", model, tuple(prompt),
                              SamplingParams(max_tokens=max_tokens, ignore_eos=True), self.slo,
                              arrival_time=time.time())
        async with stream_frames(worker.generate.remote(req)) as frames:   # left early: the worker aborts it
            async for frame in frames:
                yield frame


class EngineContender(Contender):
    def __init__(self, policy: str, name: str | None = None, scheduler: dict | None = None):
        if policy not in ENGINE_POLICIES:
            raise ValueError(f"policy must be one of {ENGINE_POLICIES}, got {policy!r}")
        self.policy = policy
        self.name = name or policy
        self.scheduler = dict(scheduler or {})  # SchedulerConfig fields for every worker
        self.actors: list = []

    def start(self, deployment: Deployment) -> Target:
        assignment = deployment.assignment(self.policy)
        return self._start(deployment, assignment, deployment.num_workers)

    def _start(self, deployment: Deployment, assignment: dict[str, int], num_workers: int) -> Target:
        import ray

        from actors.engine import EngineConfig
        from actors.worker import DeviceWorker
        from scheduler.policy import SchedulerConfig

        if self.actors:
            raise RuntimeError(f"contender {self.name} is already started")
        config = EngineConfig(**deployment.engine, policy=self.policy, timeline_len=TIMELINE_LEN,
                              scheduler=SchedulerConfig(**(self.scheduler or {})))
        remote = ray.remote(num_gpus=1, num_cpus=0)(DeviceWorker)
        self.actors = [remote.remote(f"{self.name}-w{i}", config, num_threads=deployment.threads_per_worker)
                       for i in range(num_workers)]
        ray.get([a.ready.remote() for a in self.actors])
        ray.get([self.actors[w].register_model.remote(m, deployment.models[m])
                 for m, w in assignment.items()])
        logger.info("%s: %d workers, models per worker %s", self.name, len(self.actors),
                    [sum(1 for w in assignment.values() if w == i) for i in range(len(self.actors))])
        return EngineTarget({m: self.actors[w] for m, w in assignment.items()}, deployment.slo, self.name)

    def describe(self, deployment: Deployment) -> str:
        what = {"token": "tokenmux token-level multiplexing", "request": "request-level multiplexing "
                "(a model runs until its requests finish; ServerlessLLM / Serve-multiplexing style) on the "
                "same engine"}[self.policy]
        if self.scheduler:
            what += " with " + ", ".join(f"{k}={v}" for k, v in sorted(self.scheduler.items()))
        return (f"{what}; {deployment.num_workers} DeviceWorker(s), {deployment.num_slots} weight slots each, "
                f"{deployment.threads_per_worker} torch thread(s)")

    def stop(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

    def turns(self, since: float, records: Sequence[RequestRecord] = ()) -> list[Turn]:
        import ray

        timelines = ray.get([a.timeline.remote() for a in self.actors])
        return turns_from_timelines({f"w{i}": steps for i, steps in enumerate(timelines)}, since)



class DedicatedContender(EngineContender):
    """One device per model (see the module docstring): the fleet most of a marketplace runs."""

    sequential_by_model = True  # measured one device at a time (load_tests/experiment.py)

    def __init__(self):
        super().__init__("dedicated")
        self.stand_in: dict[str, str] = {}  # served model -> the model registered on its device

    def start(self, deployment: Deployment) -> Target:
        # one worker per distinct checkpoint: copies of a checkpoint are identical devices
        by_path: dict[str, str] = {}
        for model, path in deployment.models.items():
            by_path.setdefault(path, model)
        self.stand_in = {m: by_path[p] for m, p in deployment.models.items()}
        firsts = list(by_path.values())
        target = self._start(deployment, {m: i for i, m in enumerate(firsts)}, len(firsts))
        return _StandInTarget(target, self.stand_in)

    def stop(self) -> None:
        super().stop()
        self.stand_in = {}

    def describe(self, deployment: Deployment) -> str:
        return (f"dedicated: one device per model ({len(deployment.models)} devices), each serving its model "
                f"alone with continuous batching; devices measured one after another")

    def notes(self, deployment: Deployment) -> list[str]:
        return [f"dedicated is scored as {len(deployment.models)} devices (one per model) at the same SLO"]


class _StandInTarget:
    """Sends a model's requests to the device of the identical model registered for it."""

    def __init__(self, target: EngineTarget, stand_in: dict[str, str]):
        self.target, self.stand_in = target, stand_in

    def stream(self, model: str, prompt: Prompt, max_tokens: int, request_id: str):
        return self.target.stream(self.stand_in.get(model, model), prompt, max_tokens, request_id)


# ---------------------------------------------------------------- the Ray Serve peer


class MultiplexedContender(Contender):
    """Ray Serve's @serve.multiplexed peer. `max_ongoing_requests` is how many requests a
    replica takes at once; they generate concurrently on its device (time-sliced threads,
    as concurrent requests on a Serve replica do), so 1 means one request at a time."""

    def __init__(self, max_ongoing_requests: int = 8, name: str = "multiplexed",
                 app_name: str = "loadtest-multiplexed"):
        if max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {max_ongoing_requests!r}")
        self.name = name
        self.max_ongoing_requests = max_ongoing_requests
        self.app_name = app_name
        self._shutdown = None

    def start(self, deployment: Deployment) -> Target:
        from load_tests.peers.serve_multiplexed import start_multiplexed

        if self._shutdown is not None:
            raise RuntimeError(f"contender {self.name} is already started")
        target, self._shutdown = start_multiplexed(
            deployment.models, num_replicas=deployment.num_workers,
            max_models_per_replica=deployment.num_slots,
            threads_per_replica=deployment.threads_per_worker, app_name=self.app_name,
            max_ongoing_requests=self.max_ongoing_requests, serialize_generation=False,
            dtype=deployment.engine.get("dtype") or "float32")
        return target

    def describe(self, deployment: Deployment) -> str:
        return (f"Ray Serve @serve.multiplexed over transformers models: {deployment.num_workers} replica(s), "
                f"LRU of {deployment.num_slots} models each (a miss loads with from_pretrained), "
                f"max_ongoing_requests={self.max_ongoing_requests} generating concurrently, no batching, "
                f"{deployment.threads_per_worker} torch thread(s)")

    def stop(self) -> None:
        if self._shutdown is not None:
            self._shutdown()
            self._shutdown = None

    def turns(self, since: float, records: Sequence[RequestRecord] = ()) -> list[Turn]:
        # A replica generates one request at a time, so a request's token span is its turn.
        return [Turn(r.worker_id, r.model, r.token_times[0], r.token_times[-1])
                for r in records if r.ok and r.worker_id]


# ---------------------------------------------------------------- over HTTP


class UrlContender(Contender):
    """A server already running at `url` (tokenmux, vLLM, any OpenAI-compatible one): nothing
    to start or stop; requests go to its /v1/completions (driver.OpenAIHTTPTarget)."""

    def __init__(self, url: str, name: str = "server", *, api_key: str | None = None, ignore_eos: bool = True):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--url must be an http(s) URL, got {url!r}")
        self.url, self.name, self.api_key, self.ignore_eos = url.rstrip("/"), name, api_key, ignore_eos

    def start(self, deployment: Deployment) -> Target:
        from load_tests.driver import OpenAIHTTPTarget

        return OpenAIHTTPTarget(self.url, api_key=self.api_key, ignore_eos=self.ignore_eos)

    def stop(self) -> None:
        pass

    def turns(self, since: float, records: Sequence[RequestRecord] = ()) -> list[Turn]:
        return []

    def describe(self, deployment: Deployment) -> str:
        return f"the server at {self.url}, through its OpenAI-compatible HTTP API"


class ServeContender(Contender):
    """tokenmux as a user runs it, with one policy: the Serve app (HTTP edge, router, placement,
    workers) brought up by deploy.local.run_local on the deployment's devices and budgets, and
    driven over HTTP by the client `--url` uses (`--via http`)."""

    def __init__(self, policy: str, name: str | None = None, scheduler: dict | None = None,
                 port: int | None = None):
        if policy not in ENGINE_POLICIES:
            raise ValueError(f"policy must be one of {ENGINE_POLICIES}, got {policy!r}")
        self.policy, self.name, self.scheduler, self.port = policy, name or policy, dict(scheduler or {}), port
        self._app = None

    def app_args(self, deployment: Deployment) -> dict:
        """The Serve app's args (deploy/serve_app/app_args.py) for this deployment and policy."""
        engine = deployment.engine
        return {"devices_per_node": deployment.num_workers, "threads_per_worker": deployment.threads_per_worker,
                "budget_bytes": int(engine["budget_bytes"]),
                "kv_fraction": engine["kv_bytes"] / engine["budget_bytes"],
                "host_kv_gb": engine.get("host_kv_bytes", 0) / (1 << 30), "num_slots": deployment.num_slots,
                "policy": self.policy, "scheduler": self.scheduler, "max_tokens_cap": 1 << 16,
                "slo": {"ttft_s": deployment.slo.ttft_s, "tbt_s": deployment.slo.tbt_s},
                # no refusals on predicted TTFT: engine-direct contenders have no admission, and a
                # refusal is scored as a miss anyway; the bound on waiting requests stays
                "ttft_slo_multiple": 0}

    def start(self, deployment: Deployment) -> Target:
        from deploy.local import run_local
        from load_tests.driver import OpenAIHTTPTarget

        if self._app is not None:
            raise RuntimeError(f"contender {self.name} is already started")
        port = self.port or free_loopback_port()
        self._app = run_local(dict(deployment.models), port=port, host="127.0.0.1",
                              num_devices=deployment.num_workers, app_name=f"loadtest-{self.name}",
                              **self.app_args(deployment))
        url = self._app.__enter__()
        return OpenAIHTTPTarget(url)

    def stop(self) -> None:
        if self._app is not None:
            app, self._app = self._app, None
            app.__exit__(None, None, None)

    def turns(self, since: float, records: Sequence[RequestRecord] = ()) -> list[Turn]:
        return []

    def describe(self, deployment: Deployment) -> str:
        return (f"tokenmux's Serve app with policy {self.policy} (HTTP edge, router, {deployment.num_workers} "
                f"workers), driven over HTTP")

    def notes(self, deployment: Deployment) -> list[str]:
        return ["--via http: the Serve app runs without admission's predicted-TTFT refusals "
                "(ttft_slo_multiple 0), as the engine-direct contenders have none"]


def free_loopback_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def warm_up(target: Target, models: Sequence[str], *, prompt_len: int = 8,
                  max_tokens: int = 2, timeout_s: float = 120.0) -> dict[str, str | None]:
    """One short request per model, one after another: weights loaded, code paths compiled.
    Returns {model: error or None}; a model no worker serves (dedicated) shows its error."""
    errors: dict[str, str | None] = {}
    for i, model in enumerate(models):
        prompt = [10 + (i + k) % 100 for k in range(prompt_len)]
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in target.stream(model, prompt, max_tokens, f"warmup-{i}"):
                    if isinstance(chunk, OutputFrame) and chunk.error:
                        raise TargetError(chunk.error)
            errors[model] = None
        except Exception as e:  # a warm-up failure is reported, the measured run decides
            errors[model] = f"{type(e).__name__}: {e}"
    return errors


def turns_from_timelines(timelines: dict[str, list[StepRecord]], since: float) -> list[Turn]:
    """DeviceWorker timelines (a StepRecord per step, wall clock) -> turns in
    seconds from wall-clock `since`; consecutive steps of one model on a worker make one turn."""
    turns: list[Turn] = []
    for worker, steps in timelines.items():
        for step in steps:
            if step.start < since:
                continue
            model, start, end = step.model, step.start - since, step.end - since
            if turns and turns[-1].worker == worker and turns[-1].model == model:
                turns[-1] = Turn(worker, model, turns[-1].start, end)
            else:
                turns.append(Turn(worker, model, start, end))
    return turns
