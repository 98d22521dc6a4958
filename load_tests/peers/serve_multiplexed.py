"""The peer baseline: Ray Serve's own model multiplexing over plain transformers models.

This is what a Ray user serves many models with today. Each replica holds an LRU cache of
at most `max_models_per_replica` models (`@serve.multiplexed`); a request names its model
(`handle.options(multiplexed_model_id=...)`), Serve routes it to a replica that already
holds that model when one has room, and a replica that does not hold it loads it with
`AutoModelForCausalLM.from_pretrained`, evicting its least recently used model.

Concurrency inside a replica: a replica owns one device (num_gpus=1, like tokenmux's
workers) and Hugging Face models have no continuous batching, so by default one request
generates at a time (a FIFO asyncio lock held across load + generation). Running two
`generate` loops on one device only time-slices it, and holding the lock across the load
keeps at most `max_models_per_replica` models resident, as the cache promises. The lock
can be turned off (`serialize_generation=False`) to measure the time-sliced variant;
`max_ongoing_requests` bounds how many requests Serve queues at a replica either way.

Generation is a token loop over the model's own KV cache (past_key_values) run in a
thread, so the replica's event loop keeps accepting and streaming; each frame carries the
tokens produced since the previous one with their wall-clock times (time.time()).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Mapping

from ray import serve

from actors.heap import freeze_heap
from scheduler.messages import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, OutputFrame

logger = logging.getLogger(__name__)

APP_NAME = "multiplexed-peer"


@dataclass(frozen=True)
class MultiplexedConfig:
    models: Mapping[str, str]  # model name -> local checkpoint directory
    max_models_per_replica: int = 1
    threads_per_replica: int = 1  # torch intra-op threads: the replica's share of the cores
    serialize_generation: bool = True
    dtype: str = "float32"  # what from_pretrained loads the weights as (bfloat16 on a GPU)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("models must name at least one model")
        models = {str(name): str(path) for name, path in dict(self.models).items()}
        for name, path in models.items():
            if not name:
                raise ValueError("model names must be non-empty")
            if not (Path(path) / "config.json").is_file():
                raise ValueError(f"model {name!r}: no checkpoint (config.json) at {path!r}")
        object.__setattr__(self, "models", models)
        if self.max_models_per_replica < 1:
            raise ValueError(f"max_models_per_replica must be >= 1, got {self.max_models_per_replica!r}")
        if self.threads_per_replica < 1:
            raise ValueError(f"threads_per_replica must be >= 1, got {self.threads_per_replica!r}")


@dataclass
class LoadedModel:
    name: str
    model: object  # a transformers PreTrainedModel, eval mode, on the replica's device
    eos_token_ids: frozenset[int]
    load_s: float


def _decode(loaded: LoadedModel, device: str, prompt_ids: list[int], max_tokens: int,
            ignore_eos: bool, temperature: float, seed: int | None,
            emit: Callable[[int, float], None], stop: threading.Event) -> str:
    """Prefill then decode one token per forward over past_key_values; returns the finish reason."""
    import torch

    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else int(time.time_ns()) & 0x7FFFFFFF)
    with torch.inference_mode():
        input_ids = torch.tensor([prompt_ids], device=device)  # [1, T] then [1, 1]
        past = None
        for _ in range(max_tokens):
            if stop.is_set():
                return FINISH_CANCELLED
            out = loaded.model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()  # [1, V]
            if generator is None:
                token = int(logits.argmax(dim=-1).item())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator).item())
            emit(token, time.time())  # .item() synchronised with the device: the token exists now
            if not ignore_eos and token in loaded.eos_token_ids:
                return FINISH_STOP
            input_ids = torch.tensor([[token]], device=device)
    return FINISH_LENGTH


@serve.deployment
class MultiplexedLLM:
    """One replica: an LRU cache of transformers models, one streaming generate method."""

    def __init__(self, config: MultiplexedConfig):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        self.config = config
        hf_logging.disable_progress_bar()  # no "Loading weights" bar per swap
        # Import each architecture's modeling code now (about 1.5 s the first time), as a
        # deployment importing its model classes would, so a swap costs just the load.
        for path in config.models.values():
            AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(path))]
        torch.set_num_threads(config.threads_per_replica)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.loads: list[tuple[str, float]] = []  # (model, seconds) per load, in order
        self._tokenizers: dict[str, object] = {}
        self._lock = asyncio.Lock() if config.serialize_generation else None
        self.num_decoded = 0    # tokens this replica decoded, over all requests
        self.num_decoding = 0   # generation threads running now
        # Wired up here rather than as a decorated method so the cache size is a build
        # argument; Serve detects multiplexing on instance attributes too.
        # (Serve keeps the cache on the wrapped function, so that must be a plain function.)
        async def load(model_id: str) -> LoadedModel:
            return await self._load(model_id)

        self._get_model = serve.multiplexed(
            max_num_models_per_replica=config.max_models_per_replica)(load)
        # the same start-up heap freeze as tokenmux's own processes (actors/heap.py): the peer
        # must not lose a comparison to collector pauses the other side is spared
        freeze_heap()

    async def _load(self, name: str) -> LoadedModel:
        t0 = time.perf_counter()
        model = await asyncio.to_thread(self._load_sync, self.config.models[name])
        load_s = time.perf_counter() - t0
        self.loads.append((name, load_s))
        eos = model.generation_config.eos_token_id
        eos = eos if eos is not None else model.config.eos_token_id
        eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        logger.info("replica %s loaded %s in %.3f s", self.replica_id, name, load_s)
        return LoadedModel(name, model, eos_ids, load_s)

    def _load_sync(self, path: str):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.config.dtype))
        model = model.to(self.device).eval()
        if self.device == "cuda":
            torch.cuda.synchronize()
        return model

    async def _prompt_ids(self, name: str, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if name not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[name] = await asyncio.to_thread(
                AutoTokenizer.from_pretrained, self.config.models[name])
        return self._tokenizers[name].encode(prompt)

    def stats(self) -> dict:
        """This replica's id, its loads so far, its resident models (LRU first), the tokens it
        decoded and the generations running now."""
        wrapper = getattr(self._get_model.__wrapped__, "__serve_multiplex_wrapper", None)
        resident = list(wrapper.models) if wrapper is not None else []
        return {"replica_id": self.replica_id, "loads": list(self.loads), "resident": resident,
                "num_decoded": self.num_decoded, "num_decoding": self.num_decoding}

    def _check(self, name: str, prompt, max_tokens: int, temperature: float) -> str | None:
        if name not in self.config.models:
            return f"unknown model {name!r}; this deployment serves {sorted(self.config.models)}"
        if not prompt:
            return "prompt must contain at least one token"
        if max_tokens < 1:
            return f"max_tokens must be >= 1, got {max_tokens!r}"
        if temperature < 0:
            return f"temperature must be >= 0, got {temperature!r}"
        return None

    async def generate(self, prompt: str | list[int], max_tokens: int, ignore_eos: bool = True,
                       temperature: float = 0.0, seed: int | None = None) -> AsyncIterator[dict]:
        """Stream one request's output as frame dicts (token_ids, token_times, finish_reason,
        error); the first also says whether this request loaded its model (model_load_s)."""
        name = serve.get_multiplexed_model_id()
        meta = {"replica_id": self.replica_id, "model": name}
        problem = self._check(name, prompt, max_tokens, temperature)
        if problem is not None:
            yield {**meta, "token_ids": [], "token_times": [], "finish_reason": FINISH_ERROR,
                   "error": problem}
            return
        async with self._lock or contextlib.nullcontext():
            async for frame in self._generate_locked(name, prompt, max_tokens, ignore_eos,
                                                     temperature, seed, meta):
                yield frame

    async def _generate_locked(self, name, prompt, max_tokens, ignore_eos, temperature, seed,
                               meta) -> AsyncIterator[dict]:
        num_loads = len(self.loads)
        try:
            loaded = await self._get_model(name)
            prompt_ids = await self._prompt_ids(name, prompt)
        except Exception as e:  # an error is a value in the stream
            logger.exception("replica %s could not load %s", self.replica_id, name)
            yield {**meta, "token_ids": [], "token_times": [], "finish_reason": FINISH_ERROR,
                   "error": f"loading {name}: {type(e).__name__}: {e}"}
            return
        meta.update(num_prompt_tokens=len(prompt_ids), num_loads=len(self.loads),
                    model_load_s=loaded.load_s if len(self.loads) > num_loads else None)

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def emit(token: int, t: float) -> None:
            self.num_decoded += 1
            loop.call_soon_threadsafe(queue.put_nowait, (token, t))

        def run() -> None:
            self.num_decoding += 1
            try:
                reason, error = _decode(loaded, self.device, prompt_ids, max_tokens, ignore_eos,
                                        temperature, seed, emit, stop), None
            except Exception as e:
                logger.exception("generation failed for %s", name)
                reason, error = FINISH_ERROR, f"{type(e).__name__}: {e}"
            finally:
                self.num_decoding -= 1
            loop.call_soon_threadsafe(queue.put_nowait, (reason, error))

        worker = loop.run_in_executor(None, run)
        try:
            done = False
            while not done:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                frame = {**meta, "token_ids": [], "token_times": [], "finish_reason": None,
                         "error": None}
                for a, b in items:
                    if isinstance(a, int):
                        frame["token_ids"].append(a)
                        frame["token_times"].append(b)
                    else:
                        frame["finish_reason"], frame["error"], done = a, b, True
                meta = {"replica_id": self.replica_id, "model": name}  # metadata once
                yield frame
        finally:
            stop.set()  # the client went away, or we are done: the thread must end first
            await asyncio.shield(worker)


def build_multiplexed_app(models: dict[str, str], num_replicas: int, max_models_per_replica: int,
                          threads_per_replica: int, *, max_ongoing_requests: int = 8,
                          serialize_generation: bool = True, dtype: str = "float32") -> serve.Application:
    """A Serve application of `num_replicas` MultiplexedLLM replicas, one (virtual) GPU each."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas!r}")
    if max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests must be >= 1, got {max_ongoing_requests!r}")
    config = MultiplexedConfig(models, max_models_per_replica, threads_per_replica,
                               serialize_generation, dtype)
    return MultiplexedLLM.options(
        num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_gpus": 1, "num_cpus": 0}).bind(config)


@dataclass
class MultiplexedTarget:
    """load_tests.driver Target over a MultiplexedLLM handle; records each request's load."""

    handle: object  # serve DeploymentHandle of MultiplexedLLM
    ignore_eos: bool = True
    temperature: float = 0.0
    # one entry per request that reached a replica: (request_id, model, replica_id, load s or None)
    placements: list[tuple[str, str, str, float | None]] = field(default_factory=list)

    async def stream(self, model: str, prompt: str | list[int], max_tokens: int,
                     request_id: str) -> AsyncIterator[OutputFrame]:
        gen = self.handle.options(multiplexed_model_id=model, stream=True).generate.remote(
            prompt, max_tokens, self.ignore_eos, self.temperature)
        try:
            async for d in gen:
                if "num_loads" in d:
                    self.placements.append((request_id, model, d["replica_id"], d["model_load_s"]))
                yield OutputFrame(request_id, token_ids=d["token_ids"], token_times=d["token_times"],
                                  finish_reason=d["finish_reason"], error=d["error"],
                                  num_prompt_tokens=d.get("num_prompt_tokens", 0),
                                  worker_id=d["replica_id"])
        finally:
            gen.cancel()  # no-op once the stream ended; stops the replica's loop otherwise


def start_multiplexed(models: dict[str, str], num_replicas: int = 2, max_models_per_replica: int = 1,
                      threads_per_replica: int = 1, *, app_name: str = APP_NAME,
                      max_ongoing_requests: int = 8, serialize_generation: bool = True,
                      ignore_eos: bool = True, dtype: str = "float32") -> tuple[MultiplexedTarget, Callable[[], None]]:
    """Deploy on the already-initialised Ray (handles only, no HTTP proxy started by us);
    returns the Target and a function that deletes this application, and Serve too when this
    call started it (a Serve left running without a proxy would be joined, proxy-less, by the
    next `tokenmux serve` on the same Ray)."""
    from ray.serve.context import _get_global_client
    from ray.serve.exceptions import RayServeException

    app = build_multiplexed_app(models, num_replicas, max_models_per_replica, threads_per_replica,
                                max_ongoing_requests=max_ongoing_requests,
                                serialize_generation=serialize_generation, dtype=dtype)
    try:
        _get_global_client()
        started_serve = False
    except RayServeException:   # no Serve on this cluster yet
        started_serve = True
    serve.start(proxy_location="Disabled")  # joins a running Serve as it is
    handle = serve.run(app, name=app_name, route_prefix=None)

    def shutdown() -> None:
        serve.delete(app_name)
        if started_serve:
            serve.shutdown()

    return MultiplexedTarget(handle, ignore_eos=ignore_eos), shutdown
