"""The `tokenmux` command line.

Each subcommand is one entry in COMMANDS: a function that receives its own argparse
parser, adds its arguments and sets `run=<function(args) -> int>`. To add a command,
write those two functions and add one line to COMMANDS. Heavy imports (torch, ray,
transformers) happen inside the run functions, so `tokenmux --help` stays fast.

Bad input (a CheckpointError, a ValueError) ends with one line on stderr,
`tokenmux: error: ...`, and exit status 2; set TOKENMUX_DEBUG=1 to see the traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable

from actors.model_spec import CheckpointError

PROG = "tokenmux"


# ---- zoo ------------------------------------------------------------------------------


def _zoo_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="zoo_command", metavar="{build,list}", required=True)
    build = sub.add_parser("build", help="build offline model checkpoints (skips complete ones)")
    build.add_argument("--dir", help="zoo directory (default: $TOKENMUX_ZOO_DIR or ~/.cache/tokenmux/zoo)")
    build.add_argument("--models", help="comma-separated names (default: all); see `tokenmux zoo list`")
    build.set_defaults(run=_zoo_build)
    listing = sub.add_parser("list", help="list zoo models, their sizes and whether they are built")
    listing.add_argument("--dir", help="zoo directory (default: $TOKENMUX_ZOO_DIR or ~/.cache/tokenmux/zoo)")
    listing.add_argument("--json", action="store_true", help="one JSON object per model")
    listing.set_defaults(run=_zoo_list)


def _zoo_build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from actors.zoo import zoo

    names = None  # every recipe marked default
    if args.models is not None:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        if not names:
            raise ValueError("--models is empty; give comma-separated names, see `tokenmux zoo list`")
        for name in names:
            zoo.recipe(name)  # unknown names fail before anything is built
    total = len(names) if names is not None else sum(r.default for r in zoo.ZOO.values())
    with tqdm(total=total, unit="model", file=sys.stderr) as bar:

        def progress(name: str, index: int, total: int) -> None:
            bar.n = index
            bar.set_description(name)
            bar.refresh()

        paths = zoo.build_zoo(args.dir, names=names, progress=progress)
        bar.n = total
        bar.set_description("done")
        bar.refresh()
    for path in paths:
        print(path)
    return 0


def _zoo_list(args: argparse.Namespace) -> int:
    from actors.zoo import zoo

    rows = zoo.list_zoo(args.dir)
    if args.json:
        for name, params, arch, built, path in rows:
            print(json.dumps({"name": name, "params": params, "architecture": arch,
                              "built": built, "path": str(path)}))
        return 0
    print(f"{'NAME':<16} {'ARCHITECTURE':<20} {'PARAMS':>8}  {'BUILT':<5}  PATH")
    for name, params, arch, built, path in rows:
        print(f"{name:<16} {arch:<20} {_human(params):>8}  {'yes' if built else 'no':<5}  {path}")
    return 0


def _human(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


# ---- demo -----------------------------------------------------------------------------


def _demo_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per request (engine part)")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of bursty load (cluster part)")
    parser.add_argument("--max-requests", type=int, default=120, help="requests at most (cluster part)")
    parser.add_argument("--out", default="out/demo", help="where the report and plots go")
    parser.set_defaults(run=_demo)


def _demo(args: argparse.Namespace) -> int:
    from deploy.cli.demo import run_demo

    return run_demo(args)


# ---- loadtest -------------------------------------------------------------------------


def _loadtest_parser(parser: argparse.ArgumentParser) -> None:
    from load_tests.runner import add_arguments  # stdlib-only at import; the heavy parts load in run

    add_arguments(parser)
    parser.set_defaults(run=_loadtest)


def _loadtest(args: argparse.Namespace) -> int:
    if args.url:   # a running server, not contenders this command starts
        from load_tests.url_load import run_url

        return run_url(args)
    from load_tests.runner import run

    return run(args)


# ---- plan / profile -------------------------------------------------------------------


def _plan_parser(parser: argparse.ArgumentParser) -> None:
    from cluster.planner.plan_cli import add_arguments   # stdlib-only at import; the simulator loads in run

    add_arguments(parser)
    parser.set_defaults(run=_plan)


def _plan(args: argparse.Namespace) -> int:
    from cluster.planner.plan_cli import run

    return run(args)


def _profile_parser(parser: argparse.ArgumentParser) -> None:
    from load_tests.profiler import add_arguments   # stdlib-only at import; torch loads in run

    add_arguments(parser)
    parser.set_defaults(run=_profile)


def _profile(args: argparse.Namespace) -> int:
    from load_tests.profiler import run

    return run(args)


# ---- bench ----------------------------------------------------------------------------


def _bench_parser(parser: argparse.ArgumentParser) -> None:
    from load_tests.bench.cluster_bench import add_arguments as add_cluster_arguments   # stdlib at import
    from load_tests.bench.options import add_engine_arguments   # argparse only; the benchmark loads in _bench_engine

    sub = parser.add_subparsers(dest="bench_command", metavar="{engine,cluster,colocate,sim,chaos,first-use,catalog}", required=True)
    engine = sub.add_parser("engine", help="worker engine: swap-in vs memcpy and cold load, decode vs HF "
                                           "generate, scheduler overhead (prints a table, --json FILE)")
    add_engine_arguments(engine)
    engine.set_defaults(run=_bench_engine)
    cluster = sub.add_parser("cluster", help="router overhead and KV handoff vs memcpy, 14 MiB and 256 MiB "
                                             "(starts its own 2-raylet cluster; prints a table, --json FILE)")
    add_cluster_arguments(cluster)
    cluster.set_defaults(run=_bench_cluster)
    colocate = sub.add_parser("colocate", help="N agents on one device: time-sliced engine processes vs one "
                                               "tokenmux engine (prints a table, --json FILE, --plot PNG)")
    from load_tests.bench.colocate import add_arguments as add_colocate_arguments   # argparse only at import

    add_colocate_arguments(colocate)
    colocate.set_defaults(run=_bench_colocate)
    sim = sub.add_parser("sim", help="fleet simulator speed: one trace on one fleet size (prints JSON)")
    from load_tests.bench.sim_bench import add_arguments as add_sim_arguments   # stdlib-only at import

    add_sim_arguments(sim)
    sim.set_defaults(run=_bench_sim)
    chaos = sub.add_parser("chaos", help="a local server under failures and abuse: worker and router killed, "
                                         "abandoned streams, 10x overload, fuzzed edge (prints floors, --json FILE)")
    from load_tests.bench.chaos import add_arguments as add_chaos_arguments   # stdlib at import

    add_chaos_arguments(chaos)
    chaos.set_defaults(run=_bench_chaos)
    first_use = sub.add_parser("first-use", help="what a new user sends first, against fresh servers: concurrent "
                                                 "streams and openai SDK completions (prints JSON, --json FILE)")
    from load_tests.bench.first_use import add_arguments as add_first_use_arguments   # stdlib at import

    add_first_use_arguments(first_use)
    first_use.set_defaults(run=_bench_first_use)
    catalog = sub.add_parser("catalog", help="the live catalog changed under a bursty load (add, update, remove) "
                                             "against the same load unchanged, in pairs (prints JSON, --json FILE)")
    from load_tests.bench.catalog_bench import add_arguments as add_catalog_arguments   # stdlib at import

    add_catalog_arguments(catalog)
    catalog.set_defaults(run=_bench_catalog)


def _bench_engine(args: argparse.Namespace) -> int:
    from load_tests.bench.engine_bench import run

    return run(args)


def _bench_colocate(args: argparse.Namespace) -> int:
    from load_tests.bench.colocate import run

    return run(args)


def _bench_sim(args: argparse.Namespace) -> int:
    from load_tests.bench.sim_bench import run

    return run(args)


def _bench_chaos(args: argparse.Namespace) -> int:
    from load_tests.bench.chaos import run

    return run(args)


def _bench_first_use(args: argparse.Namespace) -> int:
    from load_tests.bench.first_use import run

    return run(args)


def _bench_catalog(args: argparse.Namespace) -> int:
    from load_tests.bench.catalog_bench import run

    return run(args)


def _bench_cluster(args: argparse.Namespace) -> int:
    from load_tests.bench.cluster_bench import run

    return run(args)


# ---- serve / status / shutdown (deploy/cli/serve_command.py, deploy/cli/commands.py) ----


def _serve_parser(parser: argparse.ArgumentParser) -> None:
    from deploy.cli.serve_command import configure_serve

    configure_serve(parser)


def _status_parser(parser: argparse.ArgumentParser) -> None:
    from deploy.cli.commands import configure_status

    configure_status(parser)


def _models_parser(parser: argparse.ArgumentParser) -> None:
    from deploy.cli.models_command import configure_models

    configure_models(parser)


def _shutdown_parser(parser: argparse.ArgumentParser) -> None:
    from deploy.cli.commands import configure_shutdown

    configure_shutdown(parser)


# ---- metrics / dashboard (deploy/cli/observe.py) ----------------------------------------


def _metrics_parser(parser: argparse.ArgumentParser) -> None:
    from deploy.cli.observe import configure_metrics

    configure_metrics(parser)


def _dashboard_parser(parser: argparse.ArgumentParser) -> None:
    from deploy.cli.observe import configure_dashboard

    configure_dashboard(parser)


# ---- entry point ----------------------------------------------------------------------

# name -> (one-line help, function that configures the subcommand's parser)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "zoo": ("build or list the offline model zoo", _zoo_parser),
    "serve": ("deploy the OpenAI-compatible app (local Ray with virtual devices if none) and print its URL",
              _serve_parser),
    "status": ("workers, resident models, placement plan and queue depths of the running app", _status_parser),
    "models": ("the live catalog of the running app: add, update, remove or list models", _models_parser),
    "shutdown": ("delete the Serve app and every tokenmux actor (never `ray stop`)", _shutdown_parser),
    "bench": ("benchmarks (engine, cluster, colocate, sim, chaos, first-use, catalog)", _bench_parser),
    "metrics": ("Prometheus scrape config over Ray's service discovery; the metric names", _metrics_parser),
    "dashboard": ("build the Grafana dashboards, or push them to a Grafana", _dashboard_parser),
    "demo": ("the main job on the embedded default: local models, token-level multiplexing", _demo_parser),
    "loadtest": ("side-by-side load test: token vs request vs dedicated vs Ray Serve multiplexing", _loadtest_parser),
    "plan": ("how many GPUs a marketplace needs per policy: the fleet simulator over GPU counts", _plan_parser),
    "profile": ("profile a model's step times on this machine into iNbB.json profiles for `plan`",
                _profile_parser),
}


def _one_line(e: BaseException) -> str:
    """pydantic's errors span lines (one per field, a URL); the first field's is the answer."""
    errors = getattr(e, "errors", None)
    if callable(errors) and type(e).__name__ == "ValidationError":
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", e)).removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    return " ".join(str(e).split())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Serve many LLMs on a pool of GPUs, token by token.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, configure) in COMMANDS.items():
        configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = args.run(args)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        if os.environ.get("TOKENMUX_DEBUG"):
            raise
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
