"""OpenAI request -> GenerateRequest: reject what tokenmux does not do, tokenize, check limits.

Every problem is an `OpenAIError` (400, naming the parameter) raised before the engine
sees the request; the unknown-model 404 lists the models served.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from deploy.openai_api.engine_protocol import EngineClient, ServedModel
from deploy.openai_api.errors import OpenAIError, invalid, model_not_found, unsupported
from deploy.openai_api.config import IngressConfig
from deploy.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from scheduler.messages import GenerateRequest
from scheduler.sampling_params import SamplingParams
from scheduler.slo import SLO

MAX_STOP_STRINGS = 4  # as in the OpenAI API


def find_model(engine: EngineClient, name: str) -> ServedModel:
    models = engine.models()
    for info in models:
        if info.name == name:
            return info
    raise model_not_found(name, [m.name for m in models])


def _reject_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.n not in (None, 1):
        raise unsupported("n", "one choice per request; send n requests instead")
    if req.presence_penalty not in (None, 0, 0.0):
        raise unsupported("presence_penalty")
    if req.frequency_penalty not in (None, 0, 0.0):
        raise unsupported("frequency_penalty")
    if req.logit_bias:
        raise unsupported("logit_bias")
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise unsupported("best_of")
        if req.logprobs is not None:
            raise unsupported("logprobs")
        if req.echo:
            raise unsupported("echo")
        if req.suffix:
            raise unsupported("suffix")
    else:
        if req.logprobs:
            raise unsupported("logprobs")
        if req.top_logprobs:
            raise unsupported("top_logprobs")
        if req.tools:
            raise unsupported("tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise unsupported("tool_choice")
        if req.response_format and req.response_format.get("type") != "text":
            raise unsupported("response_format", "only {'type': 'text'}")
    if req.stream_options is not None and not req.stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", param="stream_options")


def _completion_prompt_ids(req: CompletionRequest, tok: Any) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise unsupported("prompt", "a batch of prompts; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tok.encode(prompt))
    vocab_size = len(tok)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt")
    return list(prompt)


def _chat_prompt_ids(req: ChatCompletionRequest, tok: Any) -> list[int]:
    if not getattr(tok, "chat_template", None):
        raise invalid(f"model '{req.model}' has no chat template; use /v1/completions", param="model")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
        raise invalid(f"cannot apply the chat template: {e}", param="messages") from e
    if isinstance(ids, Mapping):  # some tokenizer versions return a BatchEncoding regardless
        ids = ids["input_ids"]
    return list(ids)


def _max_tokens(req: CompletionRequest | ChatCompletionRequest, info: ServedModel, num_prompt_tokens: int,
                config: IngressConfig) -> int:
    param = "max_tokens"
    asked = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        param, asked = "max_completion_tokens", req.max_completion_tokens
    if num_prompt_tokens >= info.max_context:
        raise invalid(f"This model's maximum context length is {info.max_context} tokens; "
                      f"the prompt has {num_prompt_tokens} tokens", param="messages"
                      if isinstance(req, ChatCompletionRequest) else "prompt")
    if asked is None:
        return min(config.default_max_tokens, info.max_context - num_prompt_tokens)
    if asked <= 0:
        raise invalid(f"'{param}' must be a positive integer, got {asked}", param=param)
    if asked > config.max_tokens_cap:
        raise invalid(f"'{param}' is {asked}, above this server's limit of {config.max_tokens_cap}", param=param)
    if num_prompt_tokens + asked > info.max_context:
        raise invalid(f"This model's maximum context length is {info.max_context} tokens; you requested "
                      f"{num_prompt_tokens + asked} ({num_prompt_tokens} in the prompt, {asked} for the "
                      f"completion)", param=param)
    return asked


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                     config: IngressConfig) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=config.default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(req.top_k or 0, 0),   # -1 is "off" too, as in vLLM
            seed=req.seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            stop=tuple(stop),
            ignore_eos=req.ignore_eos,
        )
    except ValueError as e:
        raise invalid(str(e), param=str(e).split(" ", 1)[0]) from e


def request_slo(req: CompletionRequest | ChatCompletionRequest, config: IngressConfig) -> SLO:
    try:
        return SLO(ttft_s=config.default_slo.ttft_s if req.ttft_slo_s is None else req.ttft_slo_s,
                   tbt_s=config.default_slo.tbt_s if req.tbt_slo_s is None else req.tbt_slo_s)
    except ValueError as e:
        message = str(e).replace("ttft_s", "ttft_slo_s").replace("tbt_s", "tbt_slo_s")
        raise invalid(message, param=message.split(" ", 1)[0]) from e


def build_generate_request(engine: EngineClient, config: IngressConfig, request_id: str,
                           req: CompletionRequest | ChatCompletionRequest) -> GenerateRequest:
    """Blocking (tokenizes; may load the tokenizer the first time): run it off the event loop."""
    _reject_unsupported(req)
    info = find_model(engine, req.model)
    tok = engine.tokenizer(info.name)
    if isinstance(req, ChatCompletionRequest):
        prompt_ids = _chat_prompt_ids(req, tok)
    else:
        prompt_ids = _completion_prompt_ids(req, tok)
    if not prompt_ids:
        raise invalid("the prompt is empty (it has no tokens)", param="prompt")
    max_tokens = _max_tokens(req, info, len(prompt_ids), config)
    try:
        return GenerateRequest(request_id=request_id, model=info.name, prompt_token_ids=tuple(prompt_ids),
                               sampling_params=_sampling_params(req, max_tokens, config),
                               slo=request_slo(req, config), arrival_time=time.time())
    except ValueError as e:
        raise invalid(str(e)) from e


__all__ = ["build_generate_request", "find_model", "OpenAIError"]
