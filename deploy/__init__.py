"""deploy: the edge of tokenmux — how requests get in and tokens get out.

    client (openai SDK / HTTP / tokenmux client / Serve handle)
      -> ingress.py: FastAPI app, OpenAI-compatible routes       (OpenAIIngress)
      -> request_builder.py: validate, tokenize, apply limits   -> GenerateRequest
      -> engine_client.py: EngineClient protocol (router + workers behind it)
      <- OutputFrame stream (several tokens per frame, text deltas)
      <- openai_stream.py: frames -> OpenAI chunks / response, SSE; abort on disconnect

openai_protocol.py holds the pydantic request/response models, errors.py the OpenAI
error shape (400 naming the field, 404 listing models, 500 from the engine),
ingress_config.py the limits (max_tokens cap, defaults, default SLO). client.py is the
Python client (`TokenmuxClient`, `AsyncTokenmuxClient`); client_backends.py its two
transports, HTTP (httpx) and a Serve DeploymentHandle calling the ingress deployment's
`generate_frames(request_dict)`.
"""
