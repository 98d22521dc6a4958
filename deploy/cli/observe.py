"""`tokenmux metrics prometheus-config` and `tokenmux dashboard build | push`.

    tokenmux metrics prometheus-config --out prometheus.yml [--address auto] [--loopback]
    prometheus --config.file=prometheus.yml
    tokenmux dashboard build                       # regenerate deploy/dashboards/*.json
    tokenmux dashboard push --url http://grafana:3000 --token $GRAFANA_TOKEN

The scrape config follows Ray's service-discovery file (cluster/prometheus.py); the
dashboards are generated from Python (deploy/dashboards/) and provisioned through
Grafana's HTTP API with grafana-client.
"""
from __future__ import annotations

import argparse
import json


def configure_metrics(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="metrics_command", metavar="{prometheus-config,names}", required=True)
    config = sub.add_parser("prometheus-config", help="write a Prometheus scrape config over Ray's "
                                                      "service-discovery file (and that file, if Ray keeps none)")
    config.add_argument("--out", default="prometheus.yml", help="where to write the config (default prometheus.yml)")
    config.add_argument("--address", help="Ray cluster (default: $RAY_ADDRESS, else auto)")
    config.add_argument("--scrape-interval", type=float, default=5.0, help="seconds between scrapes (default 5)")
    config.add_argument("--loopback", action="store_true",
                        help="scrape this host's node through 127.0.0.1 (Prometheus on the same machine)")
    config.set_defaults(run=run_prometheus_config)
    names = sub.add_parser("names", help="every tokenmux metric as Prometheus sees it")
    names.set_defaults(run=run_metric_names)


def run_prometheus_config(ns: argparse.Namespace) -> int:
    from cluster.prometheus import write_prometheus_config
    from deploy.cli.commands import _join

    _join(ns.address)
    done = write_prometheus_config(ns.out, ns.scrape_interval, ns.loopback)
    print(f"wrote {done['config']} (targets: {', '.join(done['targets'])})")
    if done["wrote_service_discovery"]:
        print(f"Ray's dashboard keeps no service-discovery file here, so tokenmux wrote {done['service_discovery']} "
              "from the nodes alive now; run this again after nodes join")
    print(f"run: prometheus --config.file={done['config']}")
    return 0


def run_metric_names(ns: argparse.Namespace) -> int:
    from actors.metrics import CATALOG, prometheus_name

    for name, spec in CATALOG.items():
        print(f"{prometheus_name(name):<52} {spec.kind:<9} {','.join(spec.labels):<28} {spec.help}")
    return 0


def configure_dashboard(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dashboard_command", metavar="{build,push}", required=True)
    build = sub.add_parser("build", help="generate the Grafana dashboards into deploy/dashboards/*.json")
    build.add_argument("--out", help="folder (default: deploy/dashboards)")
    build.set_defaults(run=run_dashboard_build)
    push = sub.add_parser("push", help="provision the dashboards in a Grafana through its HTTP API")
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://127.0.0.1:3000")
    push.add_argument("--token", required=True, help="a Grafana service-account token")
    push.add_argument("--folder", default="tokenmux", help="Grafana folder (made if missing; default tokenmux)")
    push.add_argument("--datasource", default="prometheus", help="uid of the Prometheus data source")
    push.set_defaults(run=run_dashboard_push)


def run_dashboard_build(ns: argparse.Namespace) -> int:
    from deploy.dashboards.generate import write_dashboards

    for path in write_dashboards(ns.out):
        print(path)
    return 0


def run_dashboard_push(ns: argparse.Namespace) -> int:
    from deploy.dashboards.push import push_dashboards

    pushed = push_dashboards(ns.url, ns.token, folder=ns.folder, datasource_uid=ns.datasource)
    print(json.dumps(pushed, indent=1))
    return 0
