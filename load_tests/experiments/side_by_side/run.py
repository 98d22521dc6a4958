"""One benchmark command, run on two trees of the code in one run, alternating: before and after.

    .venv/bin/python load_tests/experiments/side_by_side/run.py BEFORE_TREE AFTER_TREE OUT_DIR \
        [--rounds 2] [--after-args=--no-ttft-slack] -- bench cluster

runs `python -m deploy.cli.main <command> --json FILE` from each tree (a `git worktree add` of
each revision; PYTHONPATH and the working directory are the tree's, the interpreter and its
packages this one's), before, after, before, after, ... so that the host's load falls on both
alike; `--after-args` are added to the after tree's command only (e.g. an ablation flag that
turns off a change the comparison is not about). Writes OUT_DIR/<label>-<round>.json (each run's own JSON) and OUT_DIR/side-by-side.json:
every numeric field the runs share, each tree's median over its rounds, and after / before.
Exit status 1 when a run failed (its log is OUT_DIR/<label>-<round>.log).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def flatten(value, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON value, keyed by their dotted path."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {prefix: float(value)}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out: dict[str, float] = {}
    for key, child in items:
        out.update(flatten(child, f"{prefix}.{key}" if prefix else str(key)))
    return out


def compare(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per shared numeric field: each label's median over its rounds, and after / before."""
    flat = {label: [flatten(r) for r in results] for label, results in runs.items()}
    shared = set.intersection(*(set(f) for results in flat.values() for f in results))
    table = {}
    for key in sorted(shared):
        medians = {label: statistics.median(f[key] for f in results) for label, results in flat.items()}
        before, after = medians["before"], medians["after"]
        table[key] = {**medians, "after_over_before": after / before if before else None}
    return table


def revision(tree: Path) -> str:
    """The tree's commit, with "+changes" when its files differ from it."""
    git = lambda *a: subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_once(tree: Path, command: list[str], out: Path, log: Path) -> tuple[int, float]:
    """`command --json out` from `tree`, its output to `log`: (exit status, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.monotonic()
    with log.open("w") as sink:
        rc = subprocess.call([sys.executable, "-m", "deploy.cli.main", *command, "--json", str(out)],
                             cwd=tree, env=env, stdout=sink, stderr=subprocess.STDOUT)
    return rc, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--after-args", default="", help="extra arguments of the after tree's command")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("give the command after --, e.g. -- bench cluster")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    wall: dict[str, list[float]] = {"before": [], "after": []}
    failed = []
    for i in range(args.rounds):
        for label in ("before", "after"):
            out, log = args.out_dir / f"{label}-{i}.json", args.out_dir / f"{label}-{i}.log"
            extra = shlex.split(args.after_args) if label == "after" else []
            rc, secs = run_once(getattr(args, label).resolve(), command + extra, out, log)
            print(f"{label} round {i}: rc {rc}, {secs:.0f} s", flush=True)
            wall[label].append(secs)
            if rc != 0 or not out.exists():
                failed.append(f"{label}-{i}")
                continue
            runs[label].append(json.loads(out.read_text()))
    result = {"command": command, "after_args": args.after_args, "rounds": args.rounds, "order": "before, after, alternating",
              "trees": {label: {"path": str(tree), "revision": revision(tree)}
                        for label, tree in (("before", args.before), ("after", args.after))}, "wall_s": wall,
              "failed": failed, "fields": compare(runs) if all(runs.values()) else {}}
    (args.out_dir / "side-by-side.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
