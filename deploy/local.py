"""`run_local`, the in-process way to serve, and its building blocks (deploy, undeploy,
parse_models), shared by `tokenmux serve` (deploy/cli/serve_command.py), the demo, the
benchmarks and the tests.

    with run_local(["llama-tiny-a", "qwen2-tiny-b"], port=8000) as url:
        ...   # OpenAI-compatible HTTP at url; TokenmuxClient(url) or the openai SDK

Nothing here runs `ray stop`.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from deploy.app_handles import cluster_handle
from deploy.serve_app.app_args import ZOO_PREFIX  # light: pydantic, no ray or torch

if TYPE_CHECKING:
    from deploy.serve_app.app_args import AppArgs

DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
POLL_S = 0.5

# The embedded default of a bare `tokenmux serve`: zoo models trained to write words.
DEFAULT_MODELS = {"llama-prose": ZOO_PREFIX + "llama-prose", "qwen2-prose": ZOO_PREFIX + "qwen2-prose"}


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
