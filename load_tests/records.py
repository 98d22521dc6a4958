"""Per-request records of a load test, kept beside its JSON so any run can be re-scored.

One JSON object per line (gzip when the name ends in .gz). The first line describes the
run (`{"kind": "run", ...}`: the SLO it was driven with, the deployment, the workloads);
every other line is one request of one measured point:

    {"kind": "request", "contender": "token", "trace": "bursty", "rate": 4.0, "seed": 1,
     "request_id": ..., "model": ..., "worker_id": ..., "arrival": ..., "token_times": [...],
     "end": ..., "error": ..., "num_prompt_tokens": ..., "num_output_tokens": ...}

Times are seconds since the start of that point's run; `token_times` are when the client
received each token. Nothing else is needed to score a point again under any SLO
(load_tests/analysis.py) without re-running it.
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator

from cluster.planner.metrics import RequestRecord

_DROP = ("server_token_times",)  # diagnostics kept in memory, not in the published records


@dataclass(frozen=True)
class PointKey:
    contender: str
    trace: str
    rate: float
    seed: int


@dataclass
class RecordSet:
    """A run's description and its records, grouped by measured point."""

    run: dict = field(default_factory=dict)
    points: dict[PointKey, list[RequestRecord]] = field(default_factory=dict)

    def add(self, key: PointKey, records: Iterable[RequestRecord]) -> None:
        self.points.setdefault(key, []).extend(records)

    def contenders(self) -> list[str]:
        return list(dict.fromkeys(k.contender for k in self.points))

    def traces(self) -> list[str]:
        return list(dict.fromkeys(k.trace for k in self.points))

    def select(self, contender: str, trace: str) -> dict[float, dict[int, list[RequestRecord]]]:
        """{rate: {seed: records}} of one contender on one trace."""
        out: dict[float, dict[int, list[RequestRecord]]] = {}
        for key, recs in self.points.items():
            if key.contender == contender and key.trace == trace:
                out.setdefault(key.rate, {})[key.seed] = recs
        return dict(sorted(out.items()))


def _open(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")
    return path.open(mode, encoding="utf-8")


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 6) for v in values]  # microseconds: far below any SLO, a third of the bytes


def write_records(path: str | Path, records: RecordSet) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open(path, "w") as f:
        f.write(json.dumps({"kind": "run", **records.run}, default=str) + "\n")
        for key, recs in records.points.items():
            for r in recs:
                d = {k: v for k, v in r.to_dict().items() if k not in _DROP}
                d["token_times"] = _rounded(d["token_times"])
                f.write(json.dumps({"kind": "request", "contender": key.contender, "trace": key.trace,
                                    "rate": key.rate, "seed": key.seed, **d}) + "\n")
    return path


def read_records(path: str | Path) -> RecordSet:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"records file not found: {path}")
    out = RecordSet()
    with _open(path, "r") as f:
        for number, line in enumerate(_lines(f), start=1):
            try:
                d = json.loads(line)
                kind = d.pop("kind")
                if kind == "run":
                    out.run = d
                    continue
                if kind != "request":
                    raise ValueError(f"unknown line kind {kind!r}")
                key = PointKey(d.pop("contender"), d.pop("trace"), float(d.pop("rate")), int(d.pop("seed")))
                out.add(key, [RequestRecord.from_dict(d)])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: {e}") from None
    return out


def _lines(f: IO[str]) -> Iterator[str]:
    for line in f:
        if line.strip():
            yield line
