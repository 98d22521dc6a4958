"""`tokenmux serve`: deploy the OpenAI-compatible app and stay until Ctrl-C or SIGTERM.

`serve` joins the Ray cluster at --address / $RAY_ADDRESS, or starts a local one with
virtual devices (loopback only, see cluster/ray_runtime.py); deploys
`deploy.serve_app.app:build_app` with Serve; prints the URL; and stays until Ctrl-C or
SIGTERM (then stops the Ray it started, or deletes the app from the cluster it joined), or returns at once with
--detach. Without --models or --config it serves the embedded default (DEFAULT_MODELS:
two zoo models trained to write words, built on first use). Checkpoint dirs are checked
before Ray starts (one line naming the path and the cause), and so is the port of a local
start (a taken one is refused: Serve's proxy would share it), and HTTP beyond loopback
needs an API key (--api-key, $TOKENMUX_API_KEYS) unless --allow-no-auth says otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import TYPE_CHECKING

from deploy.cli.commands import load_config_args, load_http_options
from deploy.local import DEFAULT_HOST, DEFAULT_MODELS, DEFAULT_PORT, _parse_args, deploy, parse_models, undeploy
from scheduler.policy_registry import POLICY_NAMES  # pure Python

if TYPE_CHECKING:
    from deploy.serve_app.app_args import AppArgs

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def configure_serve(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help="a serve config file (deploy/serve_app/serve_config.yaml); "
                        "its app's args are used")
    source.add_argument("--models", help="comma-separated zoo names, name=checkpoint_dir pairs, or checkpoint dirs "
                        f"(default: {', '.join(DEFAULT_MODELS)}, zoo models trained to write words)")
    parser.add_argument("--port", type=int, help=f"HTTP port (default: the config's, else {DEFAULT_PORT})")
    parser.add_argument("--host", help=f"HTTP host (default: the config's, else {DEFAULT_HOST})")
    parser.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS, else start a local one)")
    parser.add_argument("--devices", type=int, default=2, help="virtual devices of a local Ray on a CPU host")
    parser.add_argument("--policy", choices=POLICY_NAMES, help="scheduling policy")
    parser.add_argument("--detach", action="store_true", help="return once deployed (the app keeps running "
                        "in a cluster started with `ray start --head`)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require this API key on HTTP (Authorization: Bearer KEY); repeat for several; "
                        "also read from $TOKENMUX_API_KEYS (comma-separated)")
    parser.add_argument("--allow-no-auth", action="store_true",
                        help="serve on a non-loopback --host without an API key (anyone who reaches it may use it)")
    parser.set_defaults(run=run_serve)


def serve_args(ns: argparse.Namespace) -> tuple["AppArgs", str, int]:
    """(app args, host, port) of `tokenmux serve`; ValueError / CheckpointError on bad input."""
    from deploy.openai_api.auth import ENV_VAR, keys_from_env

    if ns.config:
        raw, http = load_config_args(ns.config), load_http_options(ns.config)
    else:
        raw, http = {"models": parse_models(ns.models) if ns.models else dict(DEFAULT_MODELS)}, {}
    host, port = ns.host or http.get("host") or DEFAULT_HOST, ns.port or http.get("port") or DEFAULT_PORT
    if ns.policy:
        raw["policy"] = ns.policy
    raw["api_keys"] = [*raw.get("api_keys", []), *ns.api_key, *keys_from_env(os.environ)]   # hashed by AppArgs
    args = _parse_args(raw)
    if host not in LOOPBACK_HOSTS and not args.api_keys and not ns.allow_no_auth:
        raise ValueError(f"refusing to serve on {host} without an API key: give --api-key (or ${ENV_VAR}), "
                         f"or --allow-no-auth to let anyone who reaches {host}:{port} use it")
    return args, host, port


def run_serve(ns: argparse.Namespace) -> int:
    from cluster.ray_runtime import connect_or_start
    from deploy.cli.console import check_port_free, quiet_ray, stop_on_sigterm
    from deploy.serve_app.app_args import check_local_sources, check_model_fits

    verbose = bool(getattr(ns, "verbose", False))
    args, host, port = serve_args(ns)
    check_local_sources(args.models)   # before Ray starts: a bad path is one line, at once
    check_model_fits(args, args.models)
    if not (ns.address or os.environ.get("RAY_ADDRESS")):   # a joined cluster's Serve may hold it already
        check_port_free(host, port)
    quiet_ray(verbose)
    # Replica and worker logs reach this terminal with -v only (Serve logs every request).
    runtime = connect_or_start(ns.address, num_virtual_gpus=ns.devices, log_to_driver=verbose)
    stop_on_sigterm()
    if ns.detach and runtime.started_locally:
        raise ValueError("--detach needs a running cluster to leave the app in (`ray start --head`, "
                         "then --address auto); this process started its own Ray, which ends with it")
    try:
        url = deploy(args, host, port)
        keys = f"API key required ({len(args.api_keys)} key{'s' * (len(args.api_keys) != 1)})" if args.api_keys \
            else "no API key"
        print(f"tokenmux serving {', '.join(args.models)} at {url}  (OpenAI API: {url}/v1; {keys})", flush=True)
        if ns.detach:
            return 0
        print("Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr, flush=True)
    finally:
        if not ns.detach:
            _stop(runtime)
    return 0


def _stop(runtime) -> None:
    """End what this serve started: the Ray it started, or else (a joined cluster) the app.
    A second signal does not cut it short.

    Serve, the app and every actor end with the Ray they run on, so a local stop is just
    `ray.shutdown()` (~2 s): deleting the app first waited in `serve.status()` for up to ~50 s
    (more so while the app was still deploying), and serve.shutdown only adds noise."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if runtime.started_locally:
        import ray

        ray.shutdown()
        return
    with contextlib.suppress(Exception):
        undeploy()
