"""Handles on a running tokenmux Serve app: its cluster deployment and the cluster's status.

Their own module so `tokenmux status` (cli/commands.py), `status --watch`
(cli/status_watch.py), deploy/local.py and the chaos bench all reach the app without
importing each other or the CLI.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.status import ClusterStatus


class NothingRunning(Exception):
    """No Ray cluster (or no tokenmux app) where the command looked; the message is one line."""


def cluster_handle(app_name: str = "tokenmux"):
    """Serve handle of the app's TokenmuxCluster deployment (the topology's owner)."""
    from ray import serve

    from deploy.serve_app.app import CLUSTER_DEPLOYMENT

    return serve.get_deployment_handle(CLUSTER_DEPLOYMENT, app_name=app_name)


def cluster_status(app_name: str = "tokenmux") -> "ClusterStatus":
    """The topology's status (workers, plan, router) from the app that owns it."""
    from ray import serve

    if app_name not in serve.status().applications:
        raise NothingRunning(f"no tokenmux app {app_name!r} is running on this cluster "
                             f"(`tokenmux serve` starts one)")
    return cluster_handle(app_name).status.remote().result(timeout_s=60)
