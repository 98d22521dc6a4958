"""The worker engine: many models on one device, switched between steps.

    step():  schedule -> run -> update -> emit

The policy (scheduler/) decides which model runs and which requests advance; the engine
makes that happen on the device: weights resident in a slot (prefetching the next model
in the background), KV blocks swapped between the device pool and host swap space, one
forward of the model runner, sampling, and OutputFrames of token ids (with their text deltas
when `detokenize`; else the caller makes the text).
Everything is made once at start (device memory, KV pool, host swap space); a model
switch is a bulk copy into a slot, never a re-initialisation.

A tensor-parallel model (actors/tensor_parallel.py) is registered with its group: this
engine holds its rank's part. On the group's leader (rank 0) the policy schedules it like
any model, and each step's KV copies and forwards go to the members first (`TPMembers`,
actors/tp_member.py); a member's engine never schedules, it `follow`s them. When a member
is gone, the leader's requests of the group wait with their output (`strand`) until the
group is formed again and the model registered with it.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from actors.device_memory import DeviceMemory, format_bytes
from actors.device_pace import DevicePace
from actors.engine_metrics import EngineRecorder
from actors.fault_isolation import GroupLost, describe, run_isolated
from actors.host_cache import HostWeightCache
from actors.kernel_check import resolve_kernels
from actors.kernel_path import KERNELS, KernelPath
from actors.kv_pool import DeviceKVPool, HostKVPool, KVBlocks, copy_blocks
from actors.model_runner import ModelRunner, SeqChunk
from actors.model_spec import ModelSpec
from actors.output_stream import OutputAssembler
from actors.sampler import Sampler, skip_draws
from actors.tensor_parallel import TPShard
from actors.tp_group import TPGroup, TPStep
from actors.weight_layout import WeightLayout
from actors.weight_slots import WeightSlots
from scheduler.estimator import StepLatencyEstimator
from scheduler.kv_blocks import BlockManager, blocks_for_tokens
from actors.worker_reports import StepRecord
from scheduler.messages import (FINISH_ERROR, EngineStats, GenerateRequest, HandoffState, OutputFrame,
                                RegisteredModel)
from scheduler.policy import SchedulerConfig, SchedulingPolicy
from scheduler.policy_registry import check_policy_name, make_policy
from scheduler.request import Request, RequestStatus
from scheduler.scheduler_output import KVCopy, SchedulerOutput, StepResult

logger = logging.getLogger(__name__)

MiB = 1 << 20
NO_TOKEN = 0   # what "sampling" gives a chunk of a split prefill; the policy drops it
STEP_EMA_WEIGHT = 0.2   # of the newest decode step: follows a load change within ~5 steps


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
    policy: str = "token"                # a name in scheduler.policy_registry.POLICIES
    dtype: str | None = None             # None = the checkpoint's dtype
    timeline_len: int = 4096             # steps kept for stats/plots (StepRecord: model, start, end, is_prefill)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # "reference": transformers' arithmetic, token for token (the oracle tests); "fast":
    # fused q/k/v and gate/up, packed weights on CPU, CUDA graphs for decode on GPU
    # (actors/kernel_path.py). bf16 on CPU (dtype="bfloat16") needs AVX512-BF16 or AMX.
    # "auto": the fast path on a CUDA device once it is checked there, else the reference
    # path (actors/kernel_check.py).
    kernels: str = "auto"
    # True: frames carry their text, and stop strings end requests here. False: frames carry
    # token ids only and the caller makes the text (TextAssembler.fill; a DeviceWorker's
    # ingress does, see actors/output_stream.py), stop strings included.
    detokenize: bool = True
    # > 1: a virtual device this many times slower than the thread that drives it, so more
    # devices than cores can run at their own pace (actors/device_pace.py); 1: the real one.
    device_slowdown: float = 1.0

    def __post_init__(self) -> None:
        check_policy_name(self.policy)
        DevicePace(self.device_slowdown)   # checks it
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(f"scheduler must be a SchedulerConfig, got {self.scheduler!r}")
        if self.kv_bytes < self.slab_bytes:
            raise ValueError(f"kv_bytes ({format_bytes(self.kv_bytes)}) must hold at least one slab "
                             f"({format_bytes(self.slab_bytes)})")
        if self.slab_bytes % 256:
            raise ValueError(f"slab_bytes must be a multiple of 256, got {self.slab_bytes}")
        if self.host_kv_bytes < 0:
            raise ValueError(f"host_kv_bytes must be >= 0, got {self.host_kv_bytes}")
        if self.kernels not in (*KERNELS, "auto"):
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, auto; got {self.kernels!r}")


@dataclass
class LoadedModel:
    name: str
    spec: ModelSpec
    layout: WeightLayout
    runner: ModelRunner
    tokenizer: object   # None when the engine does not detokenise
    dtype: torch.dtype
    kv: torch.Tensor   # the KV pool viewed as this model's blocks (the pool never moves)
    members: object = None   # a tensor-parallel leader's TPMembers (actors/tp_member.py); None otherwise
    tp_size: int = 1         # ranks of its tensor-parallel group (1: a single-device model)


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
        self.pace = DevicePace(config.device_slowdown)
        choice = resolve_kernels(config.kernels, self.device)
        self.kernels, self.kernel_warning = choice.kernels, choice.warning
        self.kernel_path = KernelPath(self.kernels, self.device.type)
        self.models: dict[str, LoadedModel] = {}
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, OutputAssembler] = {}
        self.timeline: deque[StepRecord] = deque(maxlen=config.timeline_len)
        self.num_steps = 0
        self.forward_seconds = 0.0
        self.step_seconds = 0.0
        self.decode_step_s = 0.0                      # EMA of a decode step's wall time, all models
        self.decode_step_s_by_model: dict[str, float] = {}
        self._held: dict[str, tuple[Request, OutputAssembler]] = {}   # detached for a KV handoff
        self._hold_after_prefill: set[str] = set()   # detach these the step their first token comes out
        self.metrics = EngineRecorder()   # local counters; the worker's metrics thread exports them
        self._led: set[str] = set()       # tensor-parallel models whose group this engine leads
        self._tp_shapes: set = set()      # KV shapes of the tensor-parallel models here (dedicated slabs)
        self._tp_models: set[str] = set()  # tensor-parallel models here (led or followed)
        # requests of led models whose group lost a member: they wait here, with the output they
        # have, until the group is formed again (`register_model` adopts them: prefix recomputed)
        self._stranded: dict[str, dict[str, HandoffState | GenerateRequest]] = {}

    # -- models ---------------------------------------------------------------------------

    def register_model(self, name: str, path: str | Path, group: TPGroup | None = None,
                       members=None, kv_share: float = 0.5) -> RegisteredModel:
        """Make `name` servable from the checkpoint at `path`; refuse it if it can never fit.
        Registering the same name and checkpoint again is a no-op (placement may retry).

        group: this process's tensor-parallel group; this engine then holds its rank's part.
        members: on the leader (rank 0), the TPMembers its steps go to (their models registered).
        kv_share: the share of the KV pool and of the host swap space a tensor-parallel model
        holds for good, the same slabs on every rank (its blocks are the leader's decision);
        register a group's models on every rank in the same order, before serving."""
        if name in self.models:
            if Path(self.models[name].spec.path).resolve() == Path(path).resolve():
                return self.model_info(name)
            raise ValueError(f"model {name!r} is already registered from {self.models[name].spec.path}")
        shard = group.shard if group is not None else TPShard()
        if shard.size > 1 and (members is None) != (shard.rank > 0):
            raise ValueError(f"model {name!r}: a tensor-parallel leader (rank 0) needs its members, "
                             f"and only the leader has them (rank {shard.rank})")
        spec = shard.spec(ModelSpec.from_dir(path))
        dtype = getattr(torch, self.config.dtype or spec.torch_dtype)
        layout = self.kernel_path.weight_layout(path, dtype, shard)
        kv_shape = _kv_shape(spec, dtype)
        if kv_shape.block_bytes > self.config.slab_bytes:
            raise ValueError(f"model {name!r}: one KV block takes {format_bytes(kv_shape.block_bytes)} but a "
                             f"KV slab holds {format_bytes(self.config.slab_bytes)}; raise slab_bytes")
        if any(kv_shape == _kv_shape(m.spec, m.dtype) for m in self.models.values()) and \
                (shard.size > 1 or self._tp_shapes):
            raise ValueError(f"model {name!r}: its KV blocks have the shape of another model's here, and one of "
                             f"them is tensor-parallel (its blocks are its leader's to decide)")
        if shard.size > 1:
            self._dedicate_kv(name, kv_shape, kv_share)
        self.slots.add_model(name, layout)   # refuses weights larger than a slot, with the numbers
        tokenizer = None
        if self.config.detokenize:
            from transformers import AutoTokenizer   # heavy import, only where a model is registered

            tokenizer = AutoTokenizer.from_pretrained(str(spec.path))
        runner = ModelRunner(spec, self.device, self.kernels, cuda_graphs=self.kernel_path.cuda_graphs and not group,
                             all_reduce=group.all_reduce if shard.size > 1 else None)
        self.models[name] = LoadedModel(name, spec, layout, runner, tokenizer, dtype,
                                        self.kv_pool.view(kv_shape, dtype), members, shard.size)
        if members is not None:
            self._led.add(name)
        if shard.size > 1:
            self._tp_models.add(name)
        self.estimator.register_model(name, layout.total_bytes)
        self.policy.add_model(name, kv_shape, layout.total_bytes)
        logger.info("registered %s (%s, %s weights)", name, spec.architecture, format_bytes(layout.total_bytes))
        for state in self._stranded.pop(name, {}).values():   # its group formed again: they go on
            if isinstance(state, HandoffState):
                self.adopt(state)
            else:
                self.add_request(state)
        return self.model_info(name)

    def _dedicate_kv(self, name: str, shape, kv_share: float) -> None:
        if not 0 < kv_share < 1:
            raise ValueError(f"kv_share must be in (0, 1), got {kv_share!r}")
        if shape in self._tp_shapes:   # registered again (its group formed again): its slabs are still its own
            return
        for blocks in (self.blocks, self.host_blocks):
            if blocks is not None:
                blocks.dedicate(shape, max(1, int(blocks.num_slabs * kv_share)))
        self._tp_shapes.add(shape)
        logger.info("%s: %.0f%% of the KV pool dedicated to its tensor-parallel group", name, 100 * kv_share)

    def unregister_model(self, name: str, evict_host: bool = False) -> None:
        """Stop serving `name` and free what it held: its weight slot, its runner and its KV view
        (its blocks went back with its last request), its host-cache mapping (and the node's file,
        with `evict_host`). Refused while it has requests here: nothing accepted is lost
        (placement retries once they have finished; `requests_of` + `abort` cut them first)."""
        self._model(name)
        live = len(self.requests_of(name))
        if live:
            raise ValueError(f"model {name!r} still has {live} unfinished requests on this worker")
        self.policy.remove_model(name)
        self.slots.remove_model(name, evict_host)
        self.decode_step_s_by_model.pop(name, None)
        self._led.discard(name)
        self._tp_models.discard(name)
        del self.models[name]
        logger.info("unregistered %s%s", name, " (host cache evicted)" if evict_host else "")

    def kv_layout(self, name: str) -> tuple[int, int, int, int]:
        """(ranks, KV heads per rank, layers, head dim) of `name`'s KV here: what a handed-off KV must match."""
        m = self._model(name)
        return m.tp_size, m.spec.num_kv_heads, m.spec.num_layers, m.spec.head_dim

    def members_of(self, name: str):
        """The TPMembers of `name`'s group when this engine leads it; None otherwise."""
        return self._model(name).members

    def tp_models(self) -> list[str]:
        """The tensor-parallel models registered here (led or followed)."""
        return sorted(self._tp_models)

    def strand(self, name: str) -> int:
        """`name`'s group lost a member: take its requests out of scheduling, each with the output
        it has (its KV is gone with the group's), to go on once the group is formed again and
        `name` registered with it (their streams stay open meanwhile; `abort` drops them).
        Requests that arrive meanwhile wait with them. Returns how many wait."""
        stranded = self._stranded.setdefault(name, {})
        for request_id in [rid for rid, r in self.requests.items() if r.model == name]:
            request, assembler = self.requests[request_id], self.outputs[request_id]
            req = request.to_generate_request()
            self.abort(request_id)
            stranded[request_id] = req if not request.output_token_ids else HandoffState.continuing(
                req, request.output_token_ids, request.token_times, assembler.num_sent_chars)
        return len(stranded)

    def requests_of(self, name: str) -> list[str]:
        """Ids of the unfinished requests of model `name` here (held for a handoff included)."""
        return [rid for rid, r in self.requests.items() if r.model == name] + \
            [rid for rid, (r, _) in self._held.items() if r.model == name]

    def model_info(self, name: str) -> RegisteredModel:
        m = self._model(name)
        return RegisteredModel(name, str(m.spec.path), m.spec.architecture, m.spec.max_position_embeddings,
                               m.layout.total_bytes, _kv_shape(m.spec, m.dtype).block_bytes)

    # -- requests -------------------------------------------------------------------------

    def add_request(self, req: GenerateRequest, hold_after_prefill: bool = False) -> None:
        """Accept a request or raise ValueError naming the problem; nothing accepted is lost.

        hold_after_prefill: a prefill worker's request for a KV handoff. The step that makes its
        first token also detaches it (as `detach` does), so it never decodes here while the
        handoff is decided, however fast the steps are; `detach` then returns it and
        `end_detach` frees it or lets it go on here."""
        if req.model in self._stranded:   # its group is being formed again
            self._stranded[req.model][req.request_id] = req
            return
        request = self._new_request(req)
        self.policy.add_request(request)
        if hold_after_prefill:
            self._hold_after_prefill.add(req.request_id)

    def _new_request(self, req: GenerateRequest) -> Request:
        """Check a request and hold it with its output state; the caller hands it to the policy."""
        req.check()   # it may have come unpickled from another process, which skips its constructor's checks
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
        self.outputs[req.request_id] = OutputAssembler(m.tokenizer, request, self.device, self.config.detokenize)
        return request

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """Cancel a request and free its KV; False when it is unknown or already finished."""
        if request_id in self._held:   # detached, its handoff undecided: drop it with its blocks
            self.end_detach(request_id, handed_off=True)
            return True
        for stranded in self._stranded.values():
            if stranded.pop(request_id, None) is not None:
                return True
        if request_id not in self.requests:
            return False
        self.policy.abort_request(request_id, status)
        self._forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.policy.has_unfinished()

    # -- the hot loop -----------------------------------------------------------------------

    def step(self) -> list[OutputFrame]:
        """schedule -> run -> update -> emit. Returns the frames of this step (possibly none).

        A decode output may allow several steps of its batch (output.num_steps, see
        scheduler/policy.py): they run back to back, each forward + sample + update, until
        one ends a request; then one emit makes each request's frame of the run. A group this
        engine leads that lost a member has its requests wait for it (`strand`)."""
        try:
            return self._step()
        except GroupLost as exc:
            logger.warning("%s: the requests of %s wait for the group to be formed again", exc, sorted(self._led))
            for name in sorted(self._led):
                self.strand(name)
            return []

    def _step(self) -> list[OutputFrame]:
        start = time.perf_counter()
        output = self.policy.schedule(self.clock())
        if output is None:
            return []
        switch_s = self._prepare(output)
        copy_s = self.slots.take_copy_seconds(output.model)
        single = output.num_steps == 1   # a prefill, or a decode step on its own: observed as it runs
        context = 0 if single else sum(r.num_tokens for r in output.requests)
        frames: list[OutputFrame] = []
        run_s, steps = 0.0, 0
        while True:
            run_start = time.perf_counter()
            with self.pace.paced():
                sampled, failed = self._run(output)
            step_s = time.perf_counter() - run_start
            run_s += step_s
            steps += 1
            if failed:   # requests that failed alone end here; the step goes on
                frames += self._fail(failed)
            first = steps == 1
            finished = self.policy.update(output, StepResult(sampled, self.clock(), step_s,
                                                             switch_s if first else 0.0, copy_s, observe=single))
            if finished or failed or steps >= output.num_steps:
                break
        if not single:   # one observation of a run: its mean step (the first after a switch runs on cold caches)
            self.policy.observe(output, run_s / steps, switch_s, copy_s,
                                context + len(output.requests) * (steps - 1) // 2)
        self.policy.set_resident(self.slots.resident())
        frames += self._emit(output, finished)
        self.metrics.on_step(output, switch_s, start, steps)
        if self._hold_after_prefill:
            self._hold_prefilled(output)
        self._account(output, start, steps, run_s)
        return frames

    def _hold_prefilled(self, output: SchedulerOutput) -> None:
        """Detach the requests of this step that asked for it and now have their first token."""
        for r in output.requests:
            request = self.requests.get(r.request_id)
            if r.request_id not in self._hold_after_prefill:
                continue
            if request is None:   # it ended on its first token (or a stop string): nothing to hand off
                self._hold_after_prefill.discard(r.request_id)
            elif request.output_token_ids and request.status is RequestStatus.RUNNING:
                self._hold_after_prefill.discard(r.request_id)
                self._take_out(request)

    def _prepare(self, output: SchedulerOutput) -> float:
        """Weights of output.model in a slot, KV swaps done, next model prefetching; the same
        sent first to the members of each tensor-parallel model led here that has a part in it."""
        pending = []
        for name in self._led - self._stranded.keys():   # a group that lost a member is sent nothing
            copies = self._copies_of(name, output)
            if name == output.model or any(copies):
                members = self.models[name].members
                pending.append((members, members.send(TPStep(name, *copies))))
        switch_s = self.make_resident(output.model)
        if output.prefetch_model and output.prefetch_model != output.model and output.prefetch_model in self.models:
            self.slots.prefetch(output.prefetch_model)
        self._swap(output.swap_out, output.swap_in)
        for members, sent in pending:
            members.wait(sent)
        return switch_s

    def make_resident(self, model: str) -> float:
        """Make `model`'s weights resident in a slot (a switch); returns the seconds it waited,
        paced on a virtual device like a forward."""
        with self.pace.paced() as paced:
            waited_s = self.slots.ensure_resident(model)
        return waited_s + paced.extra_s

    def _copies_of(self, model: str, output: SchedulerOutput) -> tuple[tuple[KVCopy, ...], tuple[KVCopy, ...]]:
        """The swaps (out, in) of `model`'s requests in this step."""
        return (tuple(c for c in output.swap_out if self.requests[c.request_id].model == model),
                tuple(c for c in output.swap_in if self.requests[c.request_id].model == model))

    def _swap(self, swap_out, swap_in, model: str | None = None) -> None:
        """Every device -> host copy, then every host -> device copy (a swap-in may land in blocks
        a swap-out just left). model: whose KV they all are (None: each request's model)."""
        for copies, to_host in ((swap_out, True), (swap_in, False)):
            for copy in copies:
                m = self.models[model or self.requests[copy.request_id].model]
                host_view = self.host_kv.view(_kv_shape(m.spec, m.dtype), m.dtype)
                if to_host:
                    copy_blocks(m.kv, copy.src, host_view, copy.dst)
                else:
                    copy_blocks(host_view, copy.src, m.kv, copy.dst)

    def follow(self, step: TPStep) -> None:
        """A tensor-parallel member's share of its leader's step (see TPStep); the forward's
        logits are the leader's too, and only the leader samples. A decode forward is counted
        in this device's rounds (the policy's `group_stepped`)."""
        m = self._model(step.model)
        start = self.clock()
        self.slots.ensure_resident(step.model)
        self._swap(step.swap_out, step.swap_in, step.model)
        if step.chunks:
            forward_start = self.clock()
            m.runner.forward(self.slots.params(step.model), list(step.chunks), m.kv)
            end = self.clock()
            self.timeline.append(StepRecord(step.model, start, end, step.is_prefill))
            if not step.is_prefill and step.tbt_slo_s > 0 and end > forward_start:
                self.policy.group_stepped(step.model, step.tbt_slo_s, end - forward_start, end)

    def _run(self, output: SchedulerOutput) -> tuple[dict[str, int], dict[str, str]]:
        """One forward + sampling: (request id -> token, request id -> why it failed alone)."""
        m = self.models[output.model]
        params = self.slots.params(output.model)

        partial, scheduled = output.partial, output.num_scheduled_tokens

        def chunk(r: Request) -> SeqChunk:
            tokens = _new_tokens(r, scheduled[r.request_id] if r.request_id in partial else None)
            start = r.num_computed_tokens
            restart = m.runner.recompute_from(start, start + len(tokens))   # longrope past its pretraining length
            if restart < start:
                tokens = (list(r.prompt_token_ids) + list(r.output_token_ids))[restart:start] + tokens
            return SeqChunk(tokens, restart, r.block_ids)

        def forward(requests: list[Request]) -> torch.Tensor:   # -> [B, vocab]
            chunks = [chunk(r) for r in requests]
            if m.members is None:
                return m.runner.forward(params, chunks, m.kv)
            sent = m.members.send(TPStep(m.name, chunks=tuple(chunks), is_prefill=output.is_prefill,   # before ours
                                         tbt_slo_s=min(r.slo.tbt_s for r in requests)))
            try:
                logits = m.runner.forward(params, chunks, m.kv)
            except Exception:
                m.members.wait(sent)   # a member gone (GroupLost) is why a collective failed
                raise
            m.members.wait(sent)
            return logits

        def draw(requests: list[Request], logits: torch.Tensor) -> list[int]:
            return self.sampler.sample(logits, [r.sampling_params for r in requests],
                                       [self.outputs[r.request_id].generator for r in requests])

        def sample(requests: list[Request], logits: torch.Tensor) -> list[int]:
            if not partial:
                return draw(requests, logits)
            # a chunk of a split prefill makes no token: its generator must not draw
            rows = [i for i, r in enumerate(requests) if r.request_id not in partial]
            tokens = [NO_TOKEN] * len(requests)
            if rows:
                for i, token in zip(rows, draw([requests[i] for i in rows], logits[rows])):
                    tokens[i] = token
            return tokens

        return run_isolated(forward, sample, output.requests)

    def _fail(self, failed: dict[str, str]) -> list[OutputFrame]:
        """End each request that failed alone with an error frame of its own."""
        frames = []
        for request_id, why in failed.items():
            logger.warning("request %s failed: %s", request_id, why)
            self.abort(request_id)
            frames.append(OutputFrame(request_id, finish_reason=FINISH_ERROR, error=why))
        return frames

    def _emit(self, output: SchedulerOutput, finished: list[Request]) -> list[OutputFrame]:
        done = {r.request_id for r in finished}
        frames = []
        for request in output.requests:
            if request.request_id in output.partial:   # a chunk of its prompt: nothing to say yet
                continue
            assembler = self.outputs.get(request.request_id)
            if assembler is None:
                continue
            try:
                frame, stopped = assembler.frame(request)
            except Exception as exc:   # this request's text cannot be made: it alone fails
                frames += self._fail({request.request_id: f"detokenizing failed: {describe(exc)}"})
                continue
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
        """After a step failed in a way no request explains (a device fault, see
        actors/fault_isolation.py):
        end every request on this device with an error frame."""
        frames = []
        for request_id in list(self.requests):
            self.abort(request_id)
            frames.append(OutputFrame(request_id, finish_reason=FINISH_ERROR, error=message))
        return frames

    # -- KV handoff verbs (actors/handoff.py calls them on the engine thread, between steps) --

    def detach(self, request_id: str) -> tuple[HandoffState, KVBlocks] | None:
        """Take a RUNNING request out of scheduling, its KV blocks held for export: returns its
        state and the blocks of its computed tokens. None when it has no KV on the device now
        (queued, swapped out, finished). For a tensor-parallel model led here the blocks are this
        rank's shard; the members hold theirs under the same ids (actors/tp_handoff.py), until
        end_detach frees the ids here. Follow with end_detach."""
        self._hold_after_prefill.discard(request_id)   # decided now, held or not
        if request_id in self._held:   # held after its prefill (add_request(hold_after_prefill=True))
            request, assembler = self._held[request_id]
        else:
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING or not request.num_computed_tokens:
                return None
            assembler = self._take_out(request)
        n = request.num_computed_tokens
        state = HandoffState.continuing(request.to_generate_request(), request.output_token_ids, request.token_times,
                                        assembler.num_sent_chars, num_computed_tokens=n)
        return state, self.kv_blocks(request.model, request.block_ids[:blocks_for_tokens(n)])

    def _take_out(self, request: Request) -> OutputAssembler:
        self.policy.detach_request(request.request_id)
        assembler = self.outputs.pop(request.request_id)
        self._held[request.request_id] = (self.requests.pop(request.request_id), assembler)
        return assembler

    def end_detach(self, request_id: str, handed_off: bool) -> None:
        """handed_off: another worker has the KV, free the blocks. Else the request continues
        here where it was, KV untouched. A no-op for a request no longer held (aborted meanwhile)."""
        self._hold_after_prefill.discard(request_id)
        held = self._held.pop(request_id, None)
        if held is None:
            return
        request, assembler = held
        if handed_off:
            m = self.models[request.model]
            self.blocks.free(_kv_shape(m.spec, m.dtype), request.block_ids)
            return
        self.requests[request_id], self.outputs[request_id] = request, assembler
        self.policy.reattach_request(request)

    def adopt(self, state: HandoffState, fill: Callable[[KVBlocks], None] | None = None) -> bool:
        """Continue a request another worker started: its output so far, and the KV of its first
        state.num_computed_tokens tokens, which `fill(blocks)` writes into blocks allocated here
        (for a tensor-parallel model led here: this rank's shard; `fill` has the members fill
        theirs, the same block ids, actors/tp_handoff.py).

        True: the KV was adopted and the request decodes on. False (no room, no fill, or fill
        raised): it is queued to recompute prompt + output in one prefill; nothing is lost.
        Tokens already output are not emitted again; ValueError on bad input."""
        req, n = state.request, state.num_computed_tokens
        if req.model in self._stranded:   # its group is being formed again
            self._stranded[req.model][req.request_id] = replace(state, num_computed_tokens=0)
            return False
        request = self._new_request(req)
        if not state.output_token_ids or not n < request.num_prompt_tokens + len(state.output_token_ids):
            self._forget(req.request_id)
            raise ValueError(f"request {req.request_id!r}: need >= 1 output token and num_computed_tokens below "
                             f"prompt + output, got {len(state.output_token_ids)} and {n}")
        request.output_token_ids = list(state.output_token_ids)
        request.token_times = list(state.token_times)
        request.first_token_time = state.token_times[0] if state.token_times else self.clock()
        self.outputs[req.request_id].resume(request, state.num_sent_chars)
        if req.sampling_params.seed is not None:   # the seeded stream goes on where the sender left it
            skip_draws(self.outputs[req.request_id].generator, len(request.output_token_ids))
        status = request.check_stop(request.output_token_ids[-1])
        if status is not None:   # it had already ended; nothing to decode
            self._forget(req.request_id)
            raise ValueError(f"request {req.request_id!r} had already finished ({status.finish_reason})")
        m = self.models[req.model]
        shape = _kv_shape(m.spec, m.dtype)
        ids = self.blocks.allocate(shape, blocks_for_tokens(n)) if fill is not None and n else None
        if ids is not None:
            try:
                fill(self.kv_blocks(req.model, ids))
                self.policy.adopt_request(request, ids, n)
                return True
            except Exception as exc:   # KVTransferError, a dead sender, a layout mismatch: recompute
                logger.warning("KV import of %s failed (%s); recomputing its prefix", req.request_id, exc)
                self.blocks.free(shape, ids)
        try:
            self.policy.add_request(request)
        except ValueError:
            self._forget(req.request_id)
            raise
        return False

    def kv_blocks(self, model: str, block_ids) -> KVBlocks:
        """Blocks `block_ids` of `model`'s KV in this pool (a tensor-parallel model: this rank's shard)."""
        m = self._model(model)
        return KVBlocks(self.kv_pool.view(_kv_shape(m.spec, m.dtype), m.dtype), tuple(block_ids))

    def _forget(self, request_id: str) -> None:
        self._hold_after_prefill.discard(request_id)
        self.requests.pop(request_id, None)
        self.outputs.pop(request_id, None)

    # -- bookkeeping ----------------------------------------------------------------------

    def _account(self, output: SchedulerOutput, start: float, steps: int, run_s: float) -> None:
        end = time.perf_counter()
        self.num_steps += steps
        self.forward_seconds += run_s
        self.step_seconds += end - start
        step_s = (end - start) / steps
        if not output.is_prefill:   # what a queued request waits per step: the router's step time
            self.decode_step_s = _ema(self.decode_step_s, step_s)
            self.decode_step_s_by_model[output.model] = _ema(self.decode_step_s_by_model.get(output.model, 0.0),
                                                             step_s)
        now = self.clock()   # a multi-step run's steps share its time equally in the timeline
        first = now - (end - start)
        for i in range(1, steps + 1):
            self.timeline.append(StepRecord(output.model, first + (i - 1) * step_s, first + i * step_s,
                                            output.is_prefill))

    def stats(self) -> EngineStats:
        queue_depth: dict[str, int] = {}
        running: dict[str, int] = {}
        for r in self.requests.values():
            target = running if r.status == RequestStatus.RUNNING else queue_depth
            target[r.model] = target.get(r.model, 0) + 1
        return EngineStats(
            registered=tuple(sorted(self.models)), resident=tuple(sorted(self.slots.resident())),
            num_slots=self.memory.num_slots, slot_bytes=self.memory.slot_bytes,
            budget_bytes=self.memory.total_bytes, queue_depth=queue_depth, running=running,
            kv_free_frac=self.blocks.usage()["num_free_slabs"] / max(1, self.blocks.num_slabs),
            num_steps=self.num_steps, forward_seconds=self.forward_seconds, step_seconds=self.step_seconds,
            decode_step_s=self.decode_step_s, decode_step_s_by_model=dict(self.decode_step_s_by_model),
            alpha=self.policy.last_alpha, weights=self.slots.stats(), kernels=self.kernels,
            kernel_warning=self.kernel_warning, num_preemptions=self.policy.num_preemptions)

    def _model(self, name: str) -> LoadedModel:
        m = self.models.get(name)
        if m is None:
            raise ValueError(f"unknown model {name!r}; registered models: {sorted(self.models)}")
        return m


def _ema(previous: float, sample: float) -> float:
    """Exponential moving average of step times; the first sample is taken as it is."""
    return sample if previous == 0.0 else previous + STEP_EMA_WEIGHT * (sample - previous)


def _new_tokens(r: Request, limit: int | None = None) -> list[int]:
    """The tokens of `r` not in the cache yet (a decode step: the last one; a chunk of a
    split prefill: the first `limit`), without concatenating the whole prompt and output
    every step."""
    done, prompt = r.num_computed_tokens, r.prompt_token_ids
    if done >= len(prompt):
        tokens = r.output_token_ids[done - len(prompt):]
    else:
        tokens = prompt[done:] + r.output_token_ids
    return tokens if limit is None else tokens[:limit]


def _kv_shape(spec: ModelSpec, dtype: torch.dtype):
    from scheduler.kv_blocks import KVShape

    return KVShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype.itemsize)
