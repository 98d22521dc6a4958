"""The worker engine: many models on one device, switched between steps.

    step():  schedule -> run -> update -> emit

The policy (scheduler/) decides which model runs and which requests advance; the engine
makes that happen on the device: weights resident in a slot (prefetching the next model
in the background), KV blocks swapped between the device pool and host swap space, one
forward of the model runner, sampling, and OutputFrames with detokenised text deltas.
Everything is made once at start (device memory, KV pool, host swap space); a model
switch is a bulk copy into a slot, never a re-initialisation.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.device_memory import DeviceMemory, format_bytes
from actors.engine_metrics import EngineRecorder
from actors.host_cache import HostWeightCache
from actors.kernel_path import KERNELS, KernelPath
from actors.kv_pool import DeviceKVPool, HostKVPool, copy_blocks
from actors.model_runner import ModelRunner, SeqChunk
from actors.model_spec import ModelSpec
from actors.output_stream import OutputAssembler
from actors.sampler import Sampler
from actors.weight_layout import WeightLayout
from actors.weight_slots import WeightSlots
from scheduler.estimator import StepLatencyEstimator
from scheduler.kv_blocks import BlockManager, blocks_for_tokens
from scheduler.messages import FINISH_ERROR, GenerateRequest, OutputFrame
from scheduler.policy import SchedulerConfig, SchedulerOutput, SchedulingPolicy
from scheduler.policy_registry import make_policy
from scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    """The device budget and how it is carved. On a CPU host the budget is ordinary memory,
    enforced the same way, so "not every model fits" is real there too."""

    device: str = "cpu"
    budget_bytes: int = 1024 * MiB       # weights slots + KV region
    kv_bytes: int = 128 * MiB            # the unified KV pool inside the budget
    num_slots: int = 3                   # resident models + one prefetch slot
    slab_bytes: int = 4 * MiB            # KV pool granularity between models of different shapes
    host_kv_bytes: int = 256 * MiB       # host swap space for preempted KV (0 = recompute instead)
    policy: str = "token"                # token | request | dedicated
    dtype: str | None = None             # None = the checkpoint's dtype
    timeline_len: int = 4096             # turns kept for stats/plots
    scheduler: SchedulerConfig | None = None   # the policy's knobs (a dict of its fields is accepted)
    # "reference": transformers' arithmetic, token for token (the oracle tests); "fast":
    # fused q/k/v and gate/up, oneDNN-packed weights on CPU, CUDA graphs for decode on GPU
    # (actors/kernel_path.py). bf16 on CPU (dtype="bfloat16") needs AVX512-BF16 or AMX.
    kernels: str = "reference"

    def __post_init__(self) -> None:
        if isinstance(self.scheduler, dict):   # configs cross actor boundaries as plain dicts
            object.__setattr__(self, "scheduler", SchedulerConfig(**self.scheduler))
        if self.policy not in ("token", "request", "dedicated"):
            raise ValueError(f"policy must be one of token, request, dedicated; got {self.policy!r}")
        if self.kv_bytes < self.slab_bytes:
            raise ValueError(f"kv_bytes ({format_bytes(self.kv_bytes)}) must hold at least one slab "
                             f"({format_bytes(self.slab_bytes)})")
        if self.slab_bytes % 256:
            raise ValueError(f"slab_bytes must be a multiple of 256, got {self.slab_bytes}")
        if self.host_kv_bytes < 0:
            raise ValueError(f"host_kv_bytes must be >= 0, got {self.host_kv_bytes}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}; got {self.kernels!r}")


@dataclass
class LoadedModel:
    name: str
    spec: ModelSpec
    layout: WeightLayout
    runner: ModelRunner
    tokenizer: object
    dtype: torch.dtype


class Engine:
    def __init__(self, config: EngineConfig, host_cache: HostWeightCache | None = None, clock=time.time,
                 kv_buffer: torch.Tensor | None = None):
        self.config = config
        self.clock = clock
        self.device = torch.device(config.device)
        self.memory = DeviceMemory(config.budget_bytes, config.kv_bytes, config.num_slots, self.device, kv_buffer)
        self.kv_pool = DeviceKVPool(self.memory.kv_buffer, config.slab_bytes)
        self.blocks = BlockManager(self.kv_pool.num_slabs, config.slab_bytes)
        host_slabs = config.host_kv_bytes // config.slab_bytes
        self.host_kv = HostKVPool(host_slabs, config.slab_bytes) if host_slabs else None
        self.host_blocks = BlockManager(host_slabs, config.slab_bytes) if host_slabs else None
        self.slots = WeightSlots(self.memory, host_cache or HostWeightCache())
        self.estimator = StepLatencyEstimator()
        self.policy: SchedulingPolicy = make_policy(config.policy, self.blocks, self.host_blocks, self.estimator,
                                                    config.scheduler)
        self.sampler = Sampler()
        self.kernel_path = KernelPath(config.kernels, self.device.type)
        self.models: dict[str, LoadedModel] = {}
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, OutputAssembler] = {}
        self.timeline: deque[tuple[str, float, float, bool]] = deque(maxlen=config.timeline_len)
        self.num_steps = 0
        self.forward_seconds = 0.0
        self.step_seconds = 0.0
        self.held: dict[str, tuple[Request, OutputAssembler]] = {}   # detached for a KV handoff
        self.metrics = EngineRecorder()   # local counters; the worker's metrics thread exports them

    # -- models ---------------------------------------------------------------------------

    def register_model(self, name: str, path: str | Path) -> dict:
        """Make `name` servable from the checkpoint at `path`; refuse it if it can never fit.
        Registering the same name and checkpoint again is a no-op (placement may retry)."""
        if name in self.models:
            if Path(self.models[name].spec.path).resolve() == Path(path).resolve():
                return self.model_info(name)
            raise ValueError(f"model {name!r} is already registered from {self.models[name].spec.path}")
        spec = ModelSpec.from_dir(path)
        dtype = getattr(torch, self.config.dtype or spec.torch_dtype)
        layout = self.kernel_path.weight_layout(path, dtype)
        kv_shape = _kv_shape(spec, dtype)
        if kv_shape.block_bytes > self.config.slab_bytes:
            raise ValueError(f"model {name!r}: one KV block takes {format_bytes(kv_shape.block_bytes)} but a "
                             f"KV slab holds {format_bytes(self.config.slab_bytes)}; raise slab_bytes")
        self.slots.add_model(name, layout)   # refuses weights larger than a slot, with the numbers
        from transformers import AutoTokenizer   # heavy import, only where a model is registered

        tokenizer = AutoTokenizer.from_pretrained(str(spec.path))
        runner = ModelRunner(spec, self.device, self.config.kernels, cuda_graphs=self.kernel_path.cuda_graphs)
        self.models[name] = LoadedModel(name, spec, layout, runner, tokenizer, dtype)
        self.estimator.register_model(name, layout.total_bytes)
        self.policy.add_model(name, kv_shape, layout.total_bytes)
        logger.info("registered %s (%s, %s weights)", name, spec.architecture, format_bytes(layout.total_bytes))
        return self.model_info(name)

    def unregister_model(self, name: str) -> None:
        """Stop serving `name`. Refused while it has requests here: nothing accepted is lost
        (placement retries once they have finished)."""
        self._model(name)
        live = sum(r.model == name for r in self.requests.values()) + \
            sum(r.model == name for r, _ in self.held.values())
        if live:
            raise ValueError(f"model {name!r} still has {live} unfinished requests on this worker")
        self.policy.remove_model(name)
        del self.models[name]

    def model_info(self, name: str) -> dict:
        m = self._model(name)
        return {"name": name, "path": str(m.spec.path), "architecture": m.spec.architecture,
                "max_context": m.spec.max_position_embeddings, "weight_bytes": m.layout.total_bytes,
                "kv_block_bytes": _kv_shape(m.spec, m.dtype).block_bytes}

    # -- requests -------------------------------------------------------------------------

    def add_request(self, req: GenerateRequest) -> None:
        """Accept a request or raise ValueError naming the problem; nothing accepted is lost."""
        m = self._model(req.model)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        max_context = m.spec.max_position_embeddings
        num_prompt = len(req.prompt_token_ids)
        if num_prompt + req.sampling_params.max_tokens > max_context:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({req.sampling_params.max_tokens}) "
                             f"exceeds the context of model {req.model!r} ({max_context} tokens)")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < m.spec.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary of {req.model!r} "
                             f"(size {m.spec.vocab_size}): {bad[:5]}")
        shape = _kv_shape(m.spec, m.dtype)
        need = blocks_for_tokens(num_prompt + req.sampling_params.max_tokens)
        if need > self.blocks.capacity_blocks(shape):
            raise ValueError(f"request needs {need} KV blocks but the whole pool holds "
                             f"{self.blocks.capacity_blocks(shape)} for model {req.model!r}")
        request = Request.from_generate_request(req, m.spec.eos_token_ids)
        self.requests[req.request_id] = request
        self.outputs[req.request_id] = OutputAssembler(m.tokenizer, request, self.device)
        self.policy.add_request(request)

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """Cancel a request and free its KV; False when it is unknown or already finished."""
        if request_id not in self.requests:
            return False
        self.policy.abort_request(request_id, status)
        self.requests.pop(request_id, None)
        self.outputs.pop(request_id, None)
        return True

    def has_unfinished(self) -> bool:
        return self.policy.has_unfinished()

    # -- the hot loop -----------------------------------------------------------------------

    def step(self) -> list[OutputFrame]:
        """schedule -> run -> update -> emit. Returns the frames of this step (possibly none)."""
        start = time.perf_counter()
        output = self.policy.schedule(self.clock())
        if output is None:
            return []
        switch_s = self._prepare(output)
        run_start = time.perf_counter()
        sampled = self._run(output)
        run_s = time.perf_counter() - run_start
        finished = self.policy.update(output, sampled, self.clock(), run_s, switch_s)
        self.policy.set_resident(self.slots.resident())
        frames = self._emit(output, finished)
        self.metrics.on_step(output, switch_s, start)
        self._account(output, start, run_start, run_s)
        return frames

    def _prepare(self, output: SchedulerOutput) -> float:
        """Weights of output.model in a slot, KV swaps done, next model prefetching."""
        switch_s = self.slots.ensure_resident(output.model)
        if output.prefetch_model and output.prefetch_model != output.model and output.prefetch_model in self.models:
            self.slots.prefetch(output.prefetch_model)
        for request_id, device_ids, host_ids in output.swap_out:
            view, host_view = self._kv_views(request_id)
            copy_blocks(view, device_ids, host_view, host_ids)
        for request_id, host_ids, device_ids in output.swap_in:
            view, host_view = self._kv_views(request_id)
            copy_blocks(host_view, host_ids, view, device_ids)
        return switch_s

    def _run(self, output: SchedulerOutput) -> dict[str, int]:
        m = self.models[output.model]
        chunks = [SeqChunk(r.all_token_ids[r.num_computed_tokens:], r.num_computed_tokens, r.block_ids)
                  for r in output.requests]
        kv = self.kv_pool.view(_kv_shape(m.spec, m.dtype), m.dtype)
        logits = m.runner.forward(self.slots.params(output.model), chunks, kv)   # [B, vocab]
        outs = [self.outputs[r.request_id] for r in output.requests]
        tokens = self.sampler.sample(logits, [r.sampling_params for r in output.requests],
                                     [o.generator for o in outs])
        return {r.request_id: t for r, t in zip(output.requests, tokens)}

    def _emit(self, output: SchedulerOutput, finished: list[Request]) -> list[OutputFrame]:
        done = {r.request_id for r in finished}
        frames = []
        for request in output.requests:
            assembler = self.outputs.get(request.request_id)
            if assembler is None:
                continue
            frame, stopped = assembler.frame(request)
            if stopped and request.request_id not in done:   # a stop string ended it
                self.policy.abort_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                done.add(request.request_id)
                frame.finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason
            if request.request_id in done:
                self.requests.pop(request.request_id, None)
                self.outputs.pop(request.request_id, None)
            if frame.token_ids or frame.finished:
                frames.append(frame)
        return frames

    def fail_all(self, message: str) -> list[OutputFrame]:
        """After an unexpected error in a step: end every request with an error frame."""
        frames = []
        for request_id in list(self.requests):
            self.abort(request_id)
            frames.append(OutputFrame(request_id, finish_reason=FINISH_ERROR, error=message))
        return frames

    # -- KV handoff (actors/handoff.py drives these on the engine thread, between steps) -----

    def detach(self, request_id: str) -> Request | None:
        """Take a RUNNING request out of scheduling; its KV blocks stay allocated (held) for export.

        None when it has no KV on the device now (queued, swapped out, finished). Follow with
        release_held (handed off) or reattach (continue here)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING or not request.num_computed_tokens:
            return None
        self.policy.detach_request(request_id)
        self.held[request_id] = (self.requests.pop(request_id), self.outputs.pop(request_id))
        return request

    def release_held(self, request_id: str) -> None:
        """The held request was handed off: free its blocks."""
        request, _ = self.held.pop(request_id)
        self.blocks.free(_kv_shape(self.models[request.model].spec, self.models[request.model].dtype),
                         request.block_ids)

    def reattach(self, request_id: str) -> None:
        """A handoff did not happen: the held request continues here, KV untouched."""
        request, assembler = self.held.pop(request_id)
        self.requests[request_id], self.outputs[request_id] = request, assembler
        self.policy.reattach_request(request)

    def kv_views(self, model: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pool as blocks of `model`: (view `[slabs, per_slab, L, 2, 16, H, D]`, grid
        `[slabs * per_slab, L, 2, 16, H, D]` indexed by block id, or None when slabs have a tail)."""
        m = self._model(model)
        view = self.kv_pool.view(_kv_shape(m.spec, m.dtype), m.dtype)
        grid = None
        if self.config.slab_bytes % _kv_shape(m.spec, m.dtype).block_bytes == 0:
            grid = view.view(view.shape[0] * view.shape[1], *view.shape[2:])
        return view, grid

    def add_prefilled(self, req: GenerateRequest, output_token_ids: list[int], token_times: list[float],
                      num_computed_tokens: int, fill=None, num_sent_chars: int | None = None) -> bool:
        """Continue a request another worker started: its output so far, and the KV of its first
        num_computed_tokens tokens written by `fill(dst_block_ids)` into blocks allocated here.

        True: the KV was adopted and the request decodes on. False (no room, no fill, or fill
        raised): it is queued to recompute prompt + output in one prefill; nothing is lost.
        Tokens in output_token_ids are not emitted again; ValueError on bad input."""
        self.add_request(req)
        request, assembler = self.requests[req.request_id], self.outputs[req.request_id]
        if not output_token_ids or not 0 <= num_computed_tokens < request.num_prompt_tokens + len(output_token_ids):
            self.abort(req.request_id)
            raise ValueError(f"request {req.request_id!r}: need >= 1 output token and num_computed_tokens below "
                             f"prompt + output, got {len(output_token_ids)} and {num_computed_tokens}")
        request.output_token_ids = [int(t) for t in output_token_ids]
        request.token_times = list(token_times)
        request.first_token_time = token_times[0] if token_times else self.clock()
        assembler.num_sent_tokens = len(request.output_token_ids)
        assembler.detokenizer.step(request.output_token_ids)
        assembler.num_sent_chars = len(assembler.detokenizer.text) if num_sent_chars is None else num_sent_chars
        status = request.check_stop(request.output_token_ids[-1])
        if status is not None:   # it had already ended; nothing to decode
            self.abort(req.request_id, status)
            raise ValueError(f"request {req.request_id!r} had already finished ({status.finish_reason})")
        if fill is None or not num_computed_tokens:
            return False
        m = self.models[req.model]
        ids = self.blocks.allocate(_kv_shape(m.spec, m.dtype), blocks_for_tokens(num_computed_tokens))
        if ids is None:
            return False
        try:
            fill(ids)
        except Exception as exc:   # KVTransferError, a dead sender, a layout mismatch: recompute
            logger.warning("KV import of %s failed (%s); recomputing its prefix", req.request_id, exc)
            self.blocks.free(_kv_shape(m.spec, m.dtype), ids)
            return False
        self.policy.waiting[req.model].remove(request)
        request.block_ids, request.num_computed_tokens = ids, num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.policy._insert_running(request)
        return True

    # -- bookkeeping ----------------------------------------------------------------------

    def _account(self, output: SchedulerOutput, start: float, run_start: float, run_s: float) -> None:
        end = time.perf_counter()
        self.num_steps += 1
        self.forward_seconds += run_s
        self.step_seconds += end - start
        now = self.clock()
        self.timeline.append((output.model, now - (end - start), now, output.is_prefill))

    def stats(self) -> dict:
        queue_depth: dict[str, int] = {}
        running: dict[str, int] = {}
        for r in self.requests.values():
            target = running if r.status == RequestStatus.RUNNING else queue_depth
            target[r.model] = target.get(r.model, 0) + 1
        return {
            "registered": sorted(self.models),
            "resident": sorted(self.slots.resident()),
            "num_slots": self.memory.num_slots,
            "slot_bytes": self.memory.slot_bytes,
            "budget_bytes": self.memory.total_bytes,
            "queue_depth": queue_depth,
            "running": running,
            "kv_free_frac": self.blocks.usage()["num_free_slabs"] / max(1, self.blocks.num_slabs),
            "num_steps": self.num_steps,
            "forward_seconds": self.forward_seconds,
            "step_seconds": self.step_seconds,
            "weights": self.slots.stats(),
        }

    def _model(self, name: str) -> LoadedModel:
        m = self.models.get(name)
        if m is None:
            raise ValueError(f"unknown model {name!r}; registered models: {sorted(self.models)}")
        return m

    def _kv_views(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.models[self.requests[request_id].model]
        shape = _kv_shape(m.spec, m.dtype)
        return self.kv_pool.view(shape, m.dtype), self.host_kv.view(shape, m.dtype)


def _kv_shape(spec: ModelSpec, dtype: torch.dtype):
    from scheduler.kv_blocks import KVShape

    return KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype.itemsize)
