"""One JSON of the whole GPU check (tests/gpu/run.sh): each step's outcome, every gpu test's
result, and the figures of the benchmarks with the floors of the GPU issue beside them.

    python tests/gpu/summarize.py DETAIL_DIR OUT.json
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# figure -> (operator, floor): the GPU run's floors
FLOORS = {
    "mistral-7b.decode_vs_bw_limit": ("<=", 1.5),
    "llama3-1b.decode_vs_bw_limit": ("<=", 2.0),
    "mistral-7b.swap_vs_memcpy": ("<=", 1.1),
    "kv_ipc.256MiB.handoff_over_copy": ("<=", 1.5),
}


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tests(xml: Path) -> dict:
    if not xml.is_file():
        return {"ran": False}
    out = {"passed": [], "failed": {}, "skipped": {}}
    for case in ET.parse(xml).getroot().iter("testcase"):
        where = f"{case.get('classname')}::{case.get('name')}"
        bad = case.findall("failure") + case.findall("error")
        skipped = case.findall("skipped")
        if bad:
            out["failed"][where] = (bad[0].get("message") or "")[:400]
        elif skipped:
            out["skipped"][where] = (skipped[0].get("message") or "")[:200]
        else:
            out["passed"].append(where)
    return out


def _engine(bench: dict | None) -> dict:
    if not bench:
        return {}
    keep = ("decode_vs_bw_limit", "bw_decode_step_s", "bw_limit_step_s", "bw_copy_bytes_s", "bw_cuda_graph_replays",
            "swap_vs_memcpy", "swap_s", "memcpy_limit_s", "swap_gb_s", "memcpy_gb_s", "kernel_path", "build_s")
    out = {"llama-100m": {k: bench[k] for k in keep if k in bench}}
    for name, shape in (bench.get("shapes") or {}).items():
        out[name] = {k: shape[k] for k in keep if k in shape} | ({"skipped": shape["skipped"]} if "skipped" in shape else {})
    return out


def _ipc(bench: dict | None) -> dict:
    if not bench:
        return {}
    out = dict(bench)
    big = [v for v in bench.values() if isinstance(v, dict) and v.get("bytes", 0) >= 256 << 20]
    if big:
        out["256MiB"] = min(big, key=lambda v: v["bytes"])
    return out


def _loadtest(folder: Path) -> dict:
    summary = _load(folder / "loadtest-summary.json")
    if summary is None:
        return {"ran": (folder / "loadtest-records.jsonl.gz").is_file(), "summary": None}
    return {"ran": True, "summary": summary, "poisson": _load(folder / "loadtest-poisson.json")}


def _lookup(data: dict, dotted: str):
    head, _, rest = dotted.partition(".")
    value = data.get(head)
    for part in rest.split(".") if rest else []:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def main(detail: str, out_path: str) -> int:
    detail_dir = Path(detail)
    steps = [json.loads(line) for line in (detail_dir / "steps.jsonl").read_text().splitlines() if line.strip()] \
        if (detail_dir / "steps.jsonl").is_file() else []
    env = (detail_dir / "env.txt").read_text() if (detail_dir / "env.txt").is_file() else ""
    figures = {**_engine(_load(detail_dir / "bench-engine.json")), "kv_ipc": _ipc(_load(detail_dir / "kv_ipc_bench.json"))}
    floors = {}
    for name, (op, floor) in FLOORS.items():
        value = _lookup(figures, name)
        met = None if value is None else (value <= floor if op == "<=" else value >= floor)
        floors[name] = {"value": value, "floor": f"{op} {floor}", "met": met}
    result = {"env": env.splitlines(), "steps": steps, "gpu_tests": _tests(detail_dir / "pytest-gpu.xml"),
              "figures": figures, "floors": floors, "loadtest": _loadtest(detail_dir / "loadtest-gpu")}
    Path(out_path).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({"steps": steps, "floors": floors,
                      "gpu_tests_failed": list(result["gpu_tests"].get("failed", {}))}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
