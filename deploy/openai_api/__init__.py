"""The OpenAI-compatible HTTP edge: how requests get in and tokens get out.

    client (openai SDK / HTTP / tokenmux client / Serve handle)
      -> ingress.py: FastAPI app, OpenAI-compatible routes       (OpenAIIngress)
      -> request_builder.py: validate, tokenize, apply limits   -> GenerateRequest
      -> admission.py: accept (a Ticket) or 429 with Retry-After
      -> engine_protocol.py: EngineClient protocol (router + workers behind it)
      <- OutputFrame stream (several tokens per frame, text deltas)
      <- stream.py: frames -> OpenAI chunks / response, SSE; abort on disconnect or silence

protocol.py holds the pydantic request/response models, errors.py the OpenAI error shape
(400 naming the field, 404 listing models, 429 overloaded, 500 from the engine), config.py
the limits (max_tokens cap, defaults, default SLO, admission bounds, stall timeout).
"""
