"""`tokenmux status | shutdown`, the building blocks of `serve` (serve_command.py), and
`run_local`, the in-process way to serve.

    with run_local(["llama-tiny-a", "qwen2-tiny-b"], port=8000) as url:
        ...   # OpenAI-compatible HTTP at url; TokenmuxClient(url) or the openai SDK

`status` and `shutdown` join the cluster at --address / $RAY_ADDRESS, else the one Ray
finds on this machine (a detached `serve` leaves a local Ray only for as long as its
process lives, so use them with `ray start --head` + `serve --address auto`); with nothing
running they say so in one line. `shutdown` deletes the Serve app (its topology dies with
it, see deploy/serve_app/app.py) and kills any tokenmux actor left in Serve's namespace.
Nothing here runs `ray stop`.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from deploy.cli.app_handles import cluster_handle, cluster_status  # re-exported: callers import them from here
from deploy.serve_app.app_args import ZOO_PREFIX  # light: pydantic, no ray or torch
from scheduler.policy_registry import POLICY_NAMES  # pure Python

if TYPE_CHECKING:
    from deploy.serve_app.app_args import AppArgs
    from scheduler.messages import ClusterStatus

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
POLL_S = 0.5


# ---- building blocks ------------------------------------------------------------------


def _parse_args(raw: dict) -> "AppArgs":
    from deploy.serve_app.app_args import parse_app_args

    return parse_app_args(raw)


def parse_models(models: "str | list[str] | dict[str, str]") -> dict[str, str]:
    """`a,b` / [a, b] / {name: source} -> {name: source}.

    An item is `name=source`, an existing checkpoint dir (named after its folder), or a
    zoo model name (`llama-tiny-a`, or `zoo:llama-tiny-a`).
    """
    if isinstance(models, dict):
        return dict(models)
    items = [m.strip() for m in models.split(",")] if isinstance(models, str) else [str(m).strip() for m in models]
    items = [m for m in items if m]
    if not items:
        raise ValueError("--models is empty; give comma-separated zoo names, name=path pairs or checkpoint dirs")
    out: dict[str, str] = {}
    for item in items:
        if "=" in item:
            name, source = (s.strip() for s in item.split("=", 1))
        elif item.startswith(ZOO_PREFIX):
            name, source = item[len(ZOO_PREFIX):], item
        elif Path(item).expanduser().is_dir() or _looks_like_a_path(item):   # a missing dir fails its check later
            name, source = Path(item).expanduser().resolve().name, str(Path(item).expanduser().resolve())
        else:
            name, source = item, ZOO_PREFIX + item
        if name in out:
            raise ValueError(f"model {name!r} is given twice in --models")
        out[name] = source
    return out


def _looks_like_a_path(item: str) -> bool:
    return "/" in item or item.startswith((".", "~"))


def load_config_args(path: str, app_name: str | None = None) -> dict:
    """The `args` of the tokenmux application in a `serve deploy` config file."""
    import yaml

    config = yaml.safe_load(Path(path).read_text())
    apps = (config or {}).get("applications") or []
    apps = [a for a in apps if a.get("import_path") == "deploy.serve_app.app:build_app"
            and (app_name is None or a.get("name") == app_name)]
    if not apps:
        raise ValueError(f"{path}: no application with import_path deploy.serve_app.app:build_app")
    return dict(apps[0].get("args") or {})


def load_http_options(path: str) -> dict:
    import yaml

    return dict((yaml.safe_load(Path(path).read_text()) or {}).get("http_options") or {})


def build_zoo_models(args: AppArgs, show_progress: bool = True) -> None:
    """Build the zoo models the args name (once; later calls find them built); a trained
    one shows its training steps."""
    from actors.zoo import zoo

    names = [s[len(ZOO_PREFIX):] for s in args.models.values() if s.startswith(ZOO_PREFIX)]
    missing = [n for n in names if not zoo.is_built(n)]
    if not missing:
        return
    from tqdm import tqdm

    for name in missing:
        with tqdm(desc=f"building zoo model {name}", unit="step", file=sys.stderr, disable=not show_progress) as bar:

            def progress(step: int, steps: int) -> None:
                bar.total, bar.n = steps, step
                bar.refresh()

            zoo.ensure_model(name, progress=progress)


def http_url() -> str:
    """Base URL of the Serve HTTP proxy of the connected cluster."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    host = DEFAULT_HOST if config.host in (None, "", "0.0.0.0", "::") else config.host
    return f"http://{host}:{config.port}"


def deploy(args: AppArgs, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, app_name: str = "tokenmux",
           show_progress: bool = True) -> str:
    """Start Serve (if needed), deploy the app, wait until it serves; returns its URL."""
    from ray import serve

    from deploy.serve_app.app import build_app

    build_zoo_models(args, show_progress)
    serve.start(http_options={"host": host, "port": port})   # serve.run below reconnects (quietly: console.py)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            serve.run(build_app(args), name=app_name, route_prefix="/")
        except BaseException as exc:  # reported by the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="tokenmux-deploy", daemon=True)
    thread.start()
    _show_registration(thread, args, show_progress)
    thread.join()
    if failure:
        raise RuntimeError(f"deploying tokenmux failed: {failure[0]}") from failure[0]
    return http_url()


def _show_registration(thread: threading.Thread, args: AppArgs, show_progress: bool) -> None:
    """A bar of models servable on some worker, while the deploy thread waits for RUNNING."""
    import ray
    from tqdm import tqdm

    from scheduler.messages import ROUTER_NAME

    with tqdm(total=len(args.models), desc="registering models", unit="model", file=sys.stderr,
              disable=not show_progress) as bar:
        while thread.is_alive():
            thread.join(POLL_S)
            if not show_progress:
                continue
            try:
                (namespace,) = _namespaces_of(ROUTER_NAME)
                router = ray.get_actor(ROUTER_NAME, namespace=namespace)
                servable = ray.get(router.status.remote(), timeout=5).servable
            except Exception:  # not up yet (or several tokenmux clusters: no bar then)
                continue
            bar.n = len(set(servable) & set(args.models))
            bar.refresh()
        bar.n = bar.total


def _namespaces_of(name: str) -> list[str]:
    import ray

    return [a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name]


def undeploy(app_name: str = "tokenmux", everywhere: bool = False) -> list[str]:
    """Delete the app (its topology dies with its owner replica), then kill any tokenmux
    router/placement (and their workers) left in the app's namespace — or, when the app is
    gone already and `everywhere`, in any namespace; returns what was removed."""
    import ray
    from ray import serve

    from scheduler.messages import PLACEMENT_NAME, ROUTER_NAME

    removed = []
    namespaces = None
    if app_name in serve.status().applications:
        with contextlib.suppress(Exception):
            namespaces = [cluster_handle(app_name).namespace.remote().result(timeout_s=10)]
        serve.delete(app_name)
        removed.append(f"serve app {app_name}")
    for name in (ROUTER_NAME, PLACEMENT_NAME):
        if namespaces is None:
            namespaces_of_name = _namespaces_of(name) if everywhere else []
        else:
            namespaces_of_name = namespaces
        for namespace in namespaces_of_name:
            try:
                actor = ray.get_actor(name, namespace=namespace)
            except ValueError:  # died with the app
                continue
            if name == ROUTER_NAME:
                with contextlib.suppress(Exception):
                    for handle in ray.get(actor.worker_handles.remote(), timeout=10).values():
                        ray.kill(handle)
            ray.kill(actor)
            removed.append(f"actor {name} (namespace {namespace})")
    return removed


@contextlib.contextmanager
def run_local(models: "str | list[str] | dict[str, str]", *, port: int = DEFAULT_PORT, host: str = DEFAULT_HOST,
              num_devices: int = 2, address: str | None = None, app_name: str = "tokenmux",
              show_progress: bool = False, log_to_driver: bool = False, **app_args: Any) -> Iterator[str]:
    """Ray (joined or started with `num_devices` virtual devices) + topology + Serve app;
    yields the base URL and tears it all down (stops Ray only if it started it)."""
    import ray
    from ray import serve

    from cluster.ray_runtime import connect_or_start

    args = _parse_args({"models": parse_models(models), **app_args})
    runtime = connect_or_start(address, num_virtual_gpus=num_devices, log_to_driver=log_to_driver)
    try:
        url = deploy(args, host, port, app_name, show_progress)
        try:
            yield url
        finally:
            undeploy(app_name)
    finally:
        if runtime.started_locally:
            serve.shutdown()
            ray.shutdown()


# ---- the subcommands ------------------------------------------------------------------


def configure_status(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray cluster (default: $RAY_ADDRESS, else auto)")
    parser.add_argument("--app", default="tokenmux", help="Serve application name (default tokenmux)")
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")
    parser.add_argument("--watch", action="store_true", help="a live view (tokens/s, alpha, swaps/s, device "
                        "memory per worker), refreshed in place until Ctrl-C")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")
    parser.set_defaults(run=run_status)


def _join(address: str | None, verbose: bool = False) -> None:
    """Connect to a running cluster; NothingRunning (one line) when there is none."""
    import os

    from cluster.ray_runtime import connect_or_start
    from deploy.cli.console import NothingRunning, check_reachable, quiet_ray

    quiet_ray(verbose)
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if address != "auto":
        check_reachable(address)
    try:
        connect_or_start(address, log_to_driver=False)
    except ConnectionError as e:   # "auto" found no Ray on this machine
        where = "on this machine" if address == "auto" else f"at {address}"
        raise NothingRunning(f"no Ray cluster is running {where} (`tokenmux serve` starts one)") from e


def format_status(status: "ClusterStatus") -> str:
    """A readable table: one row per worker, then the placement plan."""
    from scheduler.messages import WorkerDown

    lines = [f"{'WORKER':<18} {'ROLE':<7} {'KV FREE':>7} {'STEP':>8}  {'RESIDENT':<28} {'REGISTERED':<36} "
             f"QUEUED/RUNNING"]
    for wid, w in sorted(status.workers.items()):
        if isinstance(w, WorkerDown):
            lines.append(f"{wid:<18} DEAD    {w.error}")
            continue
        e = w.engine
        queued = ",".join(f"{m}:{n}" for m, n in sorted(e.queue_depth.items())) or "-"
        running = ",".join(f"{m}:{n}" for m, n in sorted(e.running.items())) or "-"
        step = f"{1e3 * e.decode_step_s:.1f}ms" if e.decode_step_s else "-"
        lines.append(f"{wid:<18} {w.role:<7} {e.kv_free_frac:>7.0%} {step:>8}  {','.join(e.resident) or '-':<28} "
                     f"{','.join(e.registered) or '-':<36} {queued} / {running}")
    plan = status.plan
    lines.append("")
    lines.append(f"placement plan v{plan.version if plan else '-'}:")
    for model, workers in sorted((plan.assignments if plan else {}).items()):
        lines.append(f"  {model:<24} -> {', '.join(workers) or '-'}")
    for model, why in sorted((plan.unplaceable if plan else {}).items()):
        lines.append(f"  {model:<24} unplaceable: {why}")
    lines.append(f"servable: {', '.join(status.router.servable) or '-'}")
    lines.append(f"in flight: {dict(status.router.pending) or '-'}")
    for r in status.replacements:
        when = time.strftime("%H:%M:%S", time.localtime(r.noticed_at))
        after = f"replaced by {r.replacement_id} in {r.replaced_s:.1f}s" if r.replacement_id else "replacement starting"
        lines.append(f"{when} {r.worker_id} {r.reason}: {after}")
    return "\n".join(lines)


def run_status(ns: argparse.Namespace) -> int:
    import json

    from deploy.cli.console import NothingRunning

    try:
        _join(ns.address, bool(getattr(ns, "verbose", False)))
        if ns.watch:
            from deploy.cli.status_watch import watch

            return watch(ns.app, ns.interval)
        status = cluster_status(ns.app)
    except NothingRunning as e:
        print(f"tokenmux: nothing running: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status.to_dict(), indent=2, default=str) if ns.json else format_status(status))
    return 0


def configure_shutdown(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray cluster (default: $RAY_ADDRESS, else auto)")
    parser.add_argument("--app", default="tokenmux", help="Serve application name (default tokenmux)")
    parser.set_defaults(run=run_shutdown)


def run_shutdown(ns: argparse.Namespace) -> int:
    from deploy.cli.console import NothingRunning

    try:
        _join(ns.address, bool(getattr(ns, "verbose", False)))
    except NothingRunning as e:
        print(f"nothing to shut down: {e}")
        return 0
    removed = undeploy(ns.app, everywhere=True)
    print("removed: " + (", ".join(removed) if removed else "nothing (no tokenmux app or actors found)"))
    return 0
