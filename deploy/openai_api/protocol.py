"""Pydantic models of the OpenAI-compatible HTTP API: requests, responses, errors.

Requests are parsed strictly from JSON (`model_validate_json`): a wrong type or an
unknown argument is an error naming the field, as the OpenAI API does. Parameters that
OpenAI defines but tokenmux does not implement are accepted by the parser and rejected
with a clear message in `deploy/request_builder.py`.

tokenmux extensions, all optional: `ignore_eos`, `top_k`, `seed`, `stop_token_ids`, and
the SLO hints `ttft_slo_s` / `tbt_slo_s`. Responses and stream chunks carry a `tokenmux`
object with the exact token ids and per-token wall-clock times (`TokenmuxExtension`).
`IngressRequest` is the same request for an in-cluster caller of the ingress (a Serve handle).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from scheduler.sampling_params import MAX_SEED, MIN_SEED
from scheduler.slo import MAX_SLO_S, MIN_SLO_S
from scheduler.validation import check_real

# ---------------------------------------------------------------- requests


class _Strict(BaseModel):
    # allow_inf_nan=False: JSON's NaN / Infinity extensions are refused for every float.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Ranges are OpenAI's where it documents one; request_builder.py checks the rest.
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    user: str | None = None  # accepted and ignored, as an opaque end-user id
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # tokenmux extensions
    top_k: int | None = Field(None, ge=-1, description="0 or -1: no top-k cut")
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    ttft_slo_s: float | None = Field(None, ge=MIN_SLO_S, le=MAX_SLO_S, description="time to first token, seconds")
    tbt_slo_s: float | None = Field(None, ge=MIN_SLO_S, le=MAX_SLO_S, description="time between tokens, seconds")

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty")
    @classmethod
    def _normal(cls, value: float | None, info) -> float | None:
        # A denormal (1e-40) passes the range checks but overflows once logits are divided by it.
        return None if value is None else check_real(info.field_name, value)


class CompletionRequest(_SamplingFields):
    # A string, or token ids; a batch of exactly one of either is also accepted.
    prompt: str | list[int] | list[str] | list[list[int]]
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (tool_call_id, refusal, ...) are tolerated on messages; the role and
    # content are what the chat template sees.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# ---------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenmuxExtension(BaseModel):
    """Exact output of one chunk (or the whole response): token ids and the wall-clock
    time (time.time(), on the worker) each was produced; `worker_id` served it."""

    token_ids: list[int] = Field(default_factory=list)
    token_times: list[float] = Field(default_factory=list)
    worker_id: str | None = None


class ResponseEnvelope(BaseModel):
    """What every completion response and chunk carries beside its choices."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    system_fingerprint: str | None = None   # the model version that served it (the live catalog's name@vN)
    tokenmux: TokenmuxExtension | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(ResponseEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(ResponseEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ResponseEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "tokenmux"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# The OpenAI routes an in-cluster caller may name, as the HTTP edge serves them.
INGRESS_ENDPOINTS = ("completions", "chat.completions")


@dataclass(frozen=True)
class IngressRequest:
    """An OpenAI request for the ingress's `generate_frames` over a Serve handle (producer: the
    client's handle transports, deploy/client/transports.py). `body` is the OpenAI request body
    as HTTP carries it; the answer is the chunks the SSE stream carries (an error: one chunk
    with its `status`)."""

    endpoint: str
    body: Mapping[str, Any]

    def __post_init__(self) -> None:
        if self.endpoint not in INGRESS_ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(INGRESS_ENDPOINTS)}; got {self.endpoint!r}")
        if not isinstance(self.body, Mapping):
            raise ValueError(f"body must be a mapping (the OpenAI request body), got {type(self.body).__name__}")
        object.__setattr__(self, "body", dict(self.body))
