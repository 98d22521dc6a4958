"""`tokenmux status | shutdown`, and the serve config readers of `serve` (serve_command.py;
the building blocks of serving and `run_local` are in deploy/local.py).

`status` and `shutdown` join the cluster at --address / $RAY_ADDRESS, else the one Ray
finds on this machine (a detached `serve` leaves a local Ray only for as long as its
process lives, so use them with `ray start --head` + `serve --address auto`); with nothing
running they say so in one line. `shutdown` deletes the Serve app (its topology dies with
it, see deploy/serve_app/app.py) and kills any tokenmux actor left in Serve's namespace.
Nothing here runs `ray stop`.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.app_handles import cluster_status
from deploy.local import undeploy
from scheduler.policy_registry import POLICY_NAMES  # pure Python

if TYPE_CHECKING:
    from cluster.status import ClusterStatus

logger = logging.getLogger(__name__)


# ---- serve config files ---------------------------------------------------------------


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
    from cluster.status import WorkerDown

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
    for wid, w in sorted(status.workers.items()):
        if not isinstance(w, WorkerDown) and w.engine.kernel_warning:
            lines.append(f"{wid}: WARNING {w.engine.kernel_warning}")
    plan = status.plan
    lines.append("")
    lines.append(f"placement plan v{plan.version if plan else '-'}:")
    for model, workers in sorted((plan.assignments if plan else {}).items()):
        lines.append(f"  {model:<24} -> {', '.join(workers) or '-'}")
    for model, why in sorted((plan.unplaceable if plan else {}).items()):
        lines.append(f"  {model:<24} unplaceable: {why}")
    lines.append(f"servable: {', '.join(status.router.servable) or '-'}")
    lines.append(f"in flight: {dict(status.router.pending) or '-'}")
    lines += _catalog_lines(status.catalog)
    for r in status.replacements:
        when = time.strftime("%H:%M:%S", time.localtime(r.noticed_at))
        after = f"replaced by {r.replacement_id} in {r.replaced_s:.1f}s" if r.replacement_id else "replacement starting"
        lines.append(f"{when} {r.worker_id} {r.reason}: {after}")
    return "\n".join(lines)


def _catalog_lines(catalog) -> list[str]:
    """The live catalog: each model's version, the versions still draining, the last changes."""
    if not catalog:
        return []
    lines = ["", f"catalog r{catalog.get('revision', 0)}:"]
    for name, e in sorted(catalog.get("models", {}).items()):
        lines.append(f"  {name:<24} {e['fingerprint']:<28} {e['path']}")
    for key in sorted(catalog.get("retiring", {})):
        lines.append(f"  {key:<24} retiring (draining its requests)")
    for event in catalog.get("events", [])[-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(event["time"]))
        lines.append(f"  {when} {event['kind']:<8} {event['model']} {event['detail']}")
    return lines


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
