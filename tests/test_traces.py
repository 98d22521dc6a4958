"""Trace readers on the real files in /work/shared/data and on malformed files."""
from collections import Counter
from pathlib import Path

import pytest

from cluster.planner.traces import TraceError, detect_schema, map_models, read_rows, read_trace
from cluster.planner.workloads import TraceRequest, Uniform

DATA = Path("/work/shared/data/traces")
AEGAEON = DATA / "aegaeon-synth" / "synth-16-0.5-1.0-1.0.csv"
AZURE = DATA / "azure-llm-2023" / "conv.csv"
needs_data = pytest.mark.skipif(not AEGAEON.exists(), reason="shared trace data not present")

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
110.5,GPT-4,417,505,922,API log
"""


@needs_data
def test_aegaeon_trace_reads_every_row_with_its_models():
    schema, rows = read_rows(AEGAEON)
    assert schema == "aegaeon"
    lines = AEGAEON.read_text().splitlines()
    assert len(rows) == len(lines) - 1
    first = lines[1].split(",")
    assert rows[0].model == first[1] and rows[0].input_len == int(first[2])
    assert rows[0].arrival_s == 0.0
    # "synth-16-0.5": 16 models at 0.5 req/s each
    assert len({r.model for r in rows}) == 16
    w = read_trace(AEGAEON)
    assert len(w) / w.duration_s == pytest.approx(16 * 0.5, rel=0.15)


@needs_data
def test_azure_trace_gets_models_by_popularity():
    w = read_trace(AZURE, deployed=[f"m{i}" for i in range(20)], seed=3, max_requests=5000)
    assert len(w) == 5000 and w.requests[0].arrival_s == 0.0
    counts = Counter(r.model for r in w)
    # default LongTail: the 19 least popular of 20 models share ~1.35% of requests
    assert counts["m0"] / 5000 > 0.95
    u = read_trace(AZURE, deployed=["a", "b"], popularity=Uniform(), seed=3, max_requests=5000)
    assert Counter(r.model for r in u)["a"] / 5000 == pytest.approx(0.5, abs=0.03)
    with pytest.raises(ValueError, match="no model column"):
        read_trace(AZURE, max_requests=10)


@needs_data
def test_window_and_speedup_on_a_real_trace():
    full = read_trace(AZURE, deployed=["a"])
    win = read_trace(AZURE, deployed=["a"], start_s=600, end_s=900)
    expected = [r for r in full if 600 <= r.arrival_s < 900]
    assert len(win) == len(expected)
    assert win.requests[0].arrival_s == pytest.approx(expected[0].arrival_s - 600)
    fast = read_trace(AZURE, deployed=["a"], start_s=600, end_s=900, speedup=3.0)
    assert fast.duration_s == pytest.approx(win.duration_s / 3)


def test_burstgpt_schema_and_failed_rows(tmp_path):
    p = tmp_path / "burst.csv"
    p.write_text(BURSTGPT)
    w = read_trace(p)  # the 0-response-token row is a logged failure, left out
    assert [(r.arrival_s, r.model, r.input_len, r.output_len) for r in w] == [
        (0.0, "ChatGPT", 472, 18), (105.5, "GPT-4", 417, 505)]
    with pytest.raises(TraceError, match=r"burst.csv:3: failed request"):
        read_rows(p, drop_failed=False)


def test_model_mapping():
    rows = [TraceRequest(float(i), n, 1, 1) for i, n in enumerate(["x", "y", "x", "z"])]
    rr = map_models(rows, ["a", "b"], "round_robin")
    assert [r.model for r in rr] == ["a", "b", "a", "a"]
    h1 = map_models(rows, ["a", "b", "c"], "hash")
    assert [r.model for r in h1] == [r.model for r in map_models(rows, ["a", "b", "c"], "hash")]
    assert h1[0].model == h1[2].model
    ex = map_models(rows, ["a", "b"], {"x": "b", "y": "a", "z": "a"})
    assert [r.model for r in ex] == ["b", "a", "b", "a"]
    with pytest.raises(ValueError, match=r"no entry for trace models \['z'\]"):
        map_models(rows, ["a"], {"x": "a", "y": "a"})
    with pytest.raises(ValueError, match="not deployed"):
        map_models(rows, ["a"], {"x": "q", "y": "a", "z": "a"})


@pytest.mark.parametrize("body, line, problem", [
    ("Request Time,Model Name,Input Length,Output Length\n00:00:01.0,m,5,5\n00:00:02.0,m,abc,5\n",
     3, "Input Length 'abc' is not an integer"),
    ("Request Time,Model Name,Input Length,Output Length\n00:00:01.0,m,5,5\n\n00:00:02.0,m,5\n",
     4, "expected 4 columns, got 3"),
    ("Request Time,Model Name,Input Length,Output Length\n1.5,m,5,5\n",
     2, "not HH:MM:SS"),
    ("Request Time,Model Name,Input Length,Output Length\n00:00:01.0,,5,5\n",
     2, "model name is empty"),
    ("Request Time,Model Name,Input Length,Output Length\n00:00:01.0,m,5.5,5\n",
     2, "Input Length '5.5' is not an integer"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,0\n",
     2, "GeneratedTokens must be >= 1"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,3\nyesterday,1,1\n",
     3, "Invalid isoformat"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n-3,m,1,1,2,API log\n",
     2, "finite number >= 0"),
    ("when,what\n1,2\n", 1, "unknown trace header"),
])
def test_malformed_rows_name_file_and_line(tmp_path, body, line, problem):
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(TraceError) as e:
        read_trace(p, deployed=["a"])
    assert e.value.line == line and e.value.path == str(p)
    assert problem in str(e.value) and f"bad.csv:{line}:" in str(e.value)


def test_empty_and_missing_files(tmp_path):
    p = tmp_path / "empty.csv"
    p.write_text("")
    with pytest.raises(TraceError, match="no header"):
        read_rows(p)
    with pytest.raises(FileNotFoundError):
        read_rows(tmp_path / "nope.csv")


def test_detect_schema():
    assert detect_schema(["TIMESTAMP", "ContextTokens", "GeneratedTokens"]) == "azure"
    assert detect_schema("Timestamp,Model,Request tokens,Response tokens,Total tokens,"
                         "Log Type,Session ID,Elapsed time".split(",")) == "burstgpt"


def test_requests_logged_in_one_tick_are_spread_over_it(tmp_path):
    from cluster.planner.traces import spread_ties

    f = tmp_path / "ticks.csv"
    f.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 + "".join(f"{t},ChatGPT,10,5,15,Conversation log\n" for t in (5, 5, 5, 5, 6, 8, 8)))
    w = read_trace(f, speedup=100.0)   # BurstGPT: 1 s ticks; sped up 100x
    times = [r.arrival_s for r in w]
    assert times == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01, 0.03, 0.035])
    assert len(set(times)) == len(times)   # no two requests at one instant
    rows = [TraceRequest(1.0, "m", 1, 1)] * 2 + [TraceRequest(2.0, "m", 1, 1)]
    assert [r.arrival_s for r in spread_ties(rows, 0.1)] == [1.0, 1.05, 2.0]


def test_a_workload_written_as_an_aegaeon_trace_reads_back_the_same(tmp_path):
    from cluster.planner.traces import read_trace, write_aegaeon
    from cluster.planner.workloads import TraceRequest, Workload

    workload = Workload((TraceRequest(0.0, "m-00", 12, 40), TraceRequest(61.2345, "m-01", 7, 300),
                         TraceRequest(3725.5, "m-00", 512, 1)))
    back = read_trace(write_aegaeon(workload, tmp_path / "w.csv"))
    assert [(round(r.arrival_s, 3), r.model, r.input_len, r.output_len) for r in back] == \
        [(0.0, "m-00", 12, 40), (61.234, "m-01", 7, 300), (3725.5, "m-00", 512, 1)]
