"""The serve config of the app `tokenmux loadtest --via http` brings up, for `tokenmux serve --config`.

    PYTHONPATH=. .venv/bin/python load_tests/experiments/url_vs_http/serve_config.py \
        --policy token --port 8123 --workers 1 --models 12 --slots 2 --slo-ttft 0.7 --slo-tbt 0.05 \
        > /tmp/serve.yaml
    .venv/bin/tokenmux serve --config /tmp/serve.yaml --devices 1

Issue 42's floor compares `tokenmux loadtest --url` against a running `tokenmux serve` with
`--via http`: the two only measure the same thing if the server runs the app `--via http`
starts. This prints that app's args (load_tests/contenders.py ServeContender.app_args, over the
models and engine budget load_tests/run_setup.py derives from the same loadtest flags) as a
`serve deploy` config. The SLO is given, not measured: the app schedules by it, so both runs
must be given the same one. --served-models orders the models as the --via http run deployed
them (most popular first, its JSON's deployment.models), and the --url run is given the same.
"""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from load_tests.contenders import Deployment, ServeContender
from load_tests.run_setup import engine_config, scheduler_overrides, served_models
from load_tests.runner import add_arguments
from scheduler.slo import SLO


def serve_config(args: argparse.Namespace, policy: str, port: int) -> dict:
    if args.slo_ttft is None or args.slo_tbt is None:
        raise ValueError("give --slo-ttft and --slo-tbt: the app schedules by its SLO, so both runs need the same")
    models = served_models(args.models, args.checkpoint)
    if args.served_models:   # the order --via http deployed them in (its JSON's deployment.models)
        if sorted(args.served_models) != sorted(models):
            raise ValueError(f"--served-models must order the models {sorted(models)}, got {args.served_models}")
        models = {m: models[m] for m in args.served_models}
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // args.workers)
    deployment = Deployment(models, args.workers, engine_config(models, args), threads,
                            SLO(args.slo_ttft, args.slo_tbt))
    contender = ServeContender(policy, scheduler=scheduler_overrides(args) if policy == "token" else None)
    app_args = {"models": dict(models), **contender.app_args(deployment)}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "tokenmux", "route_prefix": "/",
                              "import_path": "deploy.serve_app.app:build_app", "args": app_args}]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--policy", choices=("token", "request"), default="token")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    yaml.safe_dump(serve_config(args, args.policy, args.port), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
