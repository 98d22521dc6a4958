"""Typed arguments of the Serve app (`deploy.serve_app.app:build_app`), as `serve deploy` passes them.

    args:
      models: {llama-a: zoo:llama-tiny-a, qwen: /ckpt/Qwen2.5-0.5B-Instruct}
      slo: {ttft_s: 5.0, tbt_s: 0.2}
      budget_gb: 40            # or budget_bytes; per device: weight slots + KV region
      kv_fraction: 0.3         # of the budget, for the unified KV pool
      num_slots: 3             # resident models per device (incl. the prefetch slot)
      policy: token            # token | request | dedicated (scheduler/policy_registry.py)
      scheduler: {quota_max_s: 4.0, quota_switch_factor: 8.0}   # SchedulerConfig fields; omitted: its defaults
      devices_per_node: 2      # virtual devices per node on CPU hosts (omit on GPUs)
      tensor_parallel: {qwen-72b: 2}   # devices of a model's group on one node (omitted: 1)
      api_keys: [sha256:...]   # HTTP needs one of these keys (or $TOKENMUX_API_KEYS); digests or keys
      require_api_key: true    # refuse to start without one (a config that listens beyond loopback)
      max_waiting_per_model: 256   # then 429 + Retry-After; also when predicted TTFT > ttft_slo_multiple x SLO

A model is a local checkpoint directory, or `zoo:NAME` for a model of the offline zoo
(built on first use). A model whose weights exceed one device's weight slot is refused
unless its `tensor_parallel` degree splits it small enough (scheduler/tp_groups.py). Unknown keys are refused, and every error names its field. API keys
are held as `sha256:<hex>` digests from parsing on (deploy/openai_api/auth.py), so the
args Serve stores and shows carry no key.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deploy.openai_api.auth import key_digests
from deploy.openai_api.config import DEFAULT_MAX_BODY_BYTES, DEFAULT_STALL_TIMEOUT_S
from scheduler.policy import SchedulerConfig
from scheduler.policy_registry import check_policy_name
from scheduler.tp_groups import check_fits_device, check_tensor_parallel

if TYPE_CHECKING:
    from actors.engine import EngineConfig

ZOO_PREFIX = "zoo:"
# What a checkpoint directory needs besides config.json and weights (ModelSpec checks those).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
GiB = 1 << 30
MiB = 1 << 20
DEFAULT_BUDGET_BYTES = 256 * MiB


class SLOArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ttft_s: float = Field(10.0, gt=0, description="time to first token, seconds")
    tbt_s: float = Field(0.5, gt=0, description="time between tokens, seconds")


class SchedulerArgs(BaseModel):
    """The fields of scheduler.policy.SchedulerConfig a deployment may set; what it leaves
    out keeps SchedulerConfig's default (one place holds the defaults)."""

    model_config = ConfigDict(extra="forbid")

    max_prefill_group: int | None = Field(None, ge=1, description="requests of one model prefilled as a group")
    max_prefill_tokens: int | None = Field(None, ge=1, description="token budget of one prefill step")
    max_batch_size: int | None = Field(None, ge=1, description="requests in one decode step")
    quota_max_s: float | None = Field(None, gt=0, description="Q_max of the decode quota rule, seconds")
    min_quota_steps: int | None = Field(None, ge=1, description="decode steps per turn when switches are free")
    turn_overhead_frac: float | None = Field(None, gt=0, lt=1, description="when switches are free, turns are "
                                             "long enough to keep the engine's fixed cost of a turn under this "
                                             "share of it (within the TBT SLO; null: min_quota_steps)")
    quota_switch_factor: float | None = Field(None, gt=0, description="cap quotas at this x the round's switch "
                                                                      "cost (null: Q_max only)")
    chunked_prefill: bool | None = Field(None, description="split a prompt whose prefill exceeds a round's "
                                         "prefill budget while streams decode")
    slo_measure: Literal["mean_tpot", "per_token"] | None = Field(
        None, description="what the SLO promises of a stream's tokens after its first: mean_tpot (goodput, "
        "the default) or per_token (every token k by arrival + TTFT + k x TBT, Aegaeon's); the token-level "
        "policy plans by it")
    admission_alpha: float | None = Field(None, gt=0, le=1, description="overload control admits a new "
                                          "batch while the next round's alpha stays <= this (null: 0.6 under "
                                          "mean_tpot, 1.0 under per_token)")
    smooth_streams: bool | None = Field(None, description="with every model resident and room to spare, run "
                                        "turns in slices round-robin and spread prefill between them: smoother "
                                        "streams, at the price of TTFT and throughput")

    def config(self) -> SchedulerConfig:
        return SchedulerConfig(**self.model_dump(exclude_unset=True))


class AppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: dict[str, str] = Field(..., description="name -> local checkpoint dir, or zoo:NAME")
    slo: SLOArgs = Field(default_factory=SLOArgs)
    budget_bytes: int | None = Field(None, gt=0, description="device budget in bytes")
    budget_gb: float | None = Field(None, gt=0, description="device budget in GiB")
    kv_fraction: float = Field(0.25, gt=0, lt=1, description="share of the budget for the KV pool")
    host_kv_gb: float = Field(0.25, ge=0, description="host swap space for preempted KV (0: recompute)")
    num_slots: int = Field(3, ge=1, le=64)
    policy: str = Field("token", description="scheduling policy, a name in scheduler/policy_registry.py")
    scheduler: SchedulerArgs = Field(default_factory=SchedulerArgs)
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    devices_per_node: int | None = Field(None, ge=1, description="virtual devices per node (CPU hosts)")
    tensor_parallel: dict[str, int] = Field(default_factory=dict, description="model -> devices of its "
                                            "tensor-parallel group on one node: a power of two dividing "
                                            "the node's devices (omitted: 1)")
    threads_per_worker: int | None = Field(None, ge=1, description="torch threads per worker (CPU hosts)")
    engine_nice: int | None = Field(None, ge=0, le=19, description="how much lower the engine threads' CPU priority "
                                                                   "is (default: 10 on a virtual device, else 0)")
    max_tokens_cap: int = Field(4096, ge=1)
    default_max_tokens: int = Field(256, ge=1)
    num_ingress_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.0, ge=0, description="CPUs Ray reserves per ingress replica")
    max_ongoing_requests: int = Field(512, ge=1, description="per ingress replica (Serve's default is 5); "
                                      "admission serves this less a few places at once")
    # Serve counts a request as queued from its arrival until it is assigned to a replica, however
    # free the replica is: with a bound of 1, requests sent at once were refused by the proxy
    # (Ray's router.py says so), 2-5 of a 24-48 request burst on a fresh server; with 64, 99 of
    # 300 streams sent at once. As large as max_ongoing_requests: a burst the edge takes passes.
    max_queued_requests: int = Field(512, ge=-1, description="per ingress replica: requests Serve's proxy holds "
                                                         "beyond max_ongoing_requests or while it assigns "
                                                         "them, unseen by admission; more get a 429 there "
                                                         "(-1: no bound)")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024, description="larger request bodies get a 413")
    api_keys: list[str] = Field(default_factory=list, description="HTTP API keys, or sha256:<hex> digests of them")
    require_api_key: bool = Field(False, description="refuse to start unless api_keys or $TOKENMUX_API_KEYS "
                                                     "give a key")
    max_waiting_per_model: int = Field(256, ge=1, description="per ingress replica: requests waiting for their "
                                                               "first token; more get a 429")
    ttft_slo_multiple: float = Field(1.0, ge=0, allow_inf_nan=False,
                                     description="429 when the predicted TTFT exceeds this x the TTFT SLO (0: off)")
    stall_timeout_s: float = Field(DEFAULT_STALL_TIMEOUT_S, gt=0, allow_inf_nan=False,
                                   description="a request with no output for this long fails with an error")

    @field_validator("api_keys")
    @classmethod
    def _hash_keys(cls, keys: list[str]) -> list[str]:
        return list(key_digests(keys))

    @field_validator("max_queued_requests")
    @classmethod
    def _check_queue(cls, n: int) -> int:
        if n == 0:   # Serve takes -1 or a positive bound, and would fail only at deploy
            raise ValueError("max_queued_requests must be -1 (no bound) or at least 1, got 0")
        return n

    @field_validator("models")
    @classmethod
    def _check_models(cls, models: dict[str, str]) -> dict[str, str]:
        if not models:
            raise ValueError("give at least one model: {name: checkpoint dir or zoo:NAME}")
        for name, source in models.items():
            if not name.strip() or name != name.strip():
                raise ValueError(f"model name {name!r} must be non-empty, without surrounding spaces")
            if not source.strip():
                raise ValueError(f"model {name!r}: empty source; give a checkpoint dir or zoo:NAME")
            if source.startswith(ZOO_PREFIX):
                from actors.zoo import zoo

                zoo_name = source[len(ZOO_PREFIX):]
                if zoo_name not in zoo.ZOO:
                    raise ValueError(f"model {name!r}: unknown zoo model {zoo_name!r}; known: {', '.join(zoo.ZOO)}")
        return models

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, policy: str) -> str:
        return check_policy_name(policy)

    @field_validator("scheduler")
    @classmethod
    def _check_scheduler(cls, scheduler: SchedulerArgs) -> SchedulerArgs:
        scheduler.config()   # SchedulerConfig's own checks, with its messages
        return scheduler

    @model_validator(mode="after")
    def _check_budget(self) -> "AppArgs":
        if self.budget_bytes is not None and self.budget_gb is not None:
            raise ValueError("give budget_bytes or budget_gb, not both")
        for name, degree in self.tensor_parallel.items():
            if name not in self.models:
                raise ValueError(f"tensor_parallel names {name!r}, which is not among the models "
                                 f"({', '.join(self.models)})")
            check_tensor_parallel(degree, self.devices_per_node, model=name)
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_cap "
                             f"({self.max_tokens_cap})")
        return self

    @property
    def device_budget_bytes(self) -> int:
        if self.budget_bytes is not None:
            return self.budget_bytes
        if self.budget_gb is not None:
            return int(self.budget_gb * GiB)
        return DEFAULT_BUDGET_BYTES

    @property
    def slab_bytes(self) -> int:
        return 4 * MiB if self.device_budget_bytes >= 1 * GiB else 1 * MiB

    @property
    def kv_bytes(self) -> int:
        slab = self.slab_bytes
        return max(slab, int(self.device_budget_bytes * self.kv_fraction) // slab * slab)

    @property
    def weight_slot_bytes(self) -> int:
        """One weight slot of a device: what is left of the budget after the KV pool, per slot."""
        return (self.device_budget_bytes - self.kv_bytes) // self.num_slots

    def engine_config(self) -> "EngineConfig":
        """The EngineConfig of every worker (its device is the node's: cluster/topology.py)."""
        from actors.engine import EngineConfig   # torch comes with it: only where workers start

        budget, slab, kv = self.device_budget_bytes, self.slab_bytes, self.kv_bytes
        # detokenize=False: the ingress makes the text (deploy/serve_app/cluster_engine.py)
        return EngineConfig(budget_bytes=budget, kv_bytes=kv, num_slots=self.num_slots, slab_bytes=slab,
                            host_kv_bytes=int(self.host_kv_gb * GiB), policy=self.policy, dtype=self.dtype,
                            detokenize=False, scheduler=self.scheduler.config())


def parse_app_args(args: "dict | AppArgs") -> AppArgs:
    """AppArgs from a dict (a serve config's `args`); pydantic's errors name each field."""
    if isinstance(args, AppArgs):
        return args
    if not isinstance(args, dict):
        raise ValueError(f"app args must be a mapping, got {type(args).__name__}")
    return AppArgs.model_validate(args)


def resolve_model_sources(models: dict[str, str], progress=None) -> dict[str, str]:
    """name -> local checkpoint dir; zoo models are built if missing (`progress(name, i, n)`)."""
    resolved = {}
    for i, (name, source) in enumerate(models.items()):
        if progress is not None:
            progress(name, i, len(models))
        if source.startswith(ZOO_PREFIX):
            from actors.zoo import zoo

            resolved[name] = str(zoo.ensure_model(source[len(ZOO_PREFIX):]))
        else:
            resolved[name] = source
    return resolved


def check_local_sources(models: dict[str, str]) -> None:
    """Fail in one line naming the model, the path and the cause when a checkpoint dir in
    `models` is not servable from this machine (zoo models are built, not checked)."""
    from pathlib import Path

    from actors.model_spec import CheckpointError, ModelSpec

    for name, source in models.items():
        if source.startswith(ZOO_PREFIX):
            continue
        try:
            ModelSpec.from_dir(source)
        except CheckpointError as e:
            raise CheckpointError(f"model {name!r}: {e}") from None
        if not any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
            raise CheckpointError(f"model {name!r}: not a model checkpoint: {source} "
                                  f"(no tokenizer: none of {', '.join(TOKENIZER_FILES)})")


def check_model_fits(args: AppArgs, models: dict[str, str]) -> None:
    """ValueError naming `tensor_parallel` when a model's share of its weights exceeds one
    device's weight slot (`models`: name -> checkpoint dir; zoo sources not built yet are skipped)."""
    from actors.model_spec import ModelSpec   # reads headers only, no torch

    for name, source in models.items():
        if source.startswith(ZOO_PREFIX):
            continue
        check_fits_device(name, ModelSpec.from_dir(source).weight_bytes, args.tensor_parallel.get(name, 1),
                          args.weight_slot_bytes)
