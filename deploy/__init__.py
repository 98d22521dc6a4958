"""deploy: the edges of tokenmux, one sub-package per audience.

    openai_api/  the OpenAI-compatible HTTP edge: FastAPI ingress over an `EngineClient`
                 (validate, tokenize, stream OutputFrames back as OpenAI chunks / SSE)
    serve_app/   the Ray Serve application (`deploy.serve_app.app:build_app`), its typed
                 args, the real `EngineClient` over the router + DeviceWorkers, and the
                 `serve deploy` / KubeRay configs
    cli/         the `tokenmux` command line for operators (serve, status, shutdown, demo,
                 bench, loadtest, zoo)
    client/      the Python client library (`TokenmuxClient`, `AsyncTokenmuxClient`) over
                 HTTP or a Serve handle
    local.py     `run_local`: serve in-process (Ray + topology + the Serve app) and yield
                 the URL; app_handles.py: handles on a running app and its status
"""
