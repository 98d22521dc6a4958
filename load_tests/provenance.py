"""Where a result came from: the code's revision, the command, the machine, the start time.

Every result file the load test writes carries `provenance()` under "provenance", so a
number can be traced to the commit that produced it (and whether the tree had uncommitted
changes), re-run with the same command, and weighed against the machine it ran on (a
shared 2-core host and an idle 16-core one are not the same measurement).
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_revision(repo: Path = REPO) -> dict:
    """{"revision": sha or None, "dirty": bool or None}: None where git or the repo is missing."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    rev = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"revision": rev.strip() if rev else None, "dirty": bool(status.strip()) if status is not None else None}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(torch_threads: int | None = None) -> dict:
    """CPU model, cores (all, and those this process may run on), torch threads, host."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cores_usable": usable,
           "platform": platform.platform(), "python": platform.python_version(), "hostname": platform.node()}
    if torch_threads is None and "torch" in sys.modules:
        torch_threads = sys.modules["torch"].get_num_threads()
    out["torch_threads"] = torch_threads
    try:
        out["load_avg"] = list(os.getloadavg())   # how busy the machine was when the run began
    except OSError:
        pass
    return out


def process_started() -> datetime.datetime:
    """When this process (the command) started, UTC; now where that cannot be read."""
    try:
        import psutil

        return datetime.datetime.fromtimestamp(psutil.Process().create_time(), datetime.timezone.utc)
    except Exception:   # no psutil, no /proc: the time of asking is the best left
        return datetime.datetime.now(datetime.timezone.utc)


def provenance(argv: list[str] | None = None, *, started: datetime.datetime | None = None,
               torch_threads: int | None = None) -> dict:
    """The provenance block of a result file (see the module docstring); `started` defaults
    to when this process started."""
    started = started or process_started()
    return {**git_revision(), "command": list(sys.argv if argv is None else argv),
            "machine": machine(torch_threads), "started_at": started.isoformat(timespec="seconds")}
