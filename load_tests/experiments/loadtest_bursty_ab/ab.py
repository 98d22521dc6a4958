"""The A/B behind docs/results/loadtest-bursty-ab (and loadtest-poisson-ab, and
loadtest-poisson-6seeds/recheck.json): one contender at fixed rates of one trace, one fixed
SLO for every code under test, seeds 0-5 x 120 requests.

    TOKENMUX_DATA_DIR=../shared/data PYTHONPATH=TREE .venv/bin/python \
        load_tests/experiments/loadtest_bursty_ab/ab.py OUT.json 0.506,0.72 [contender] [field=json ...] \
        [--trace bursty|poisson] [--slo-ttft 0.0616] [--slo-tbt 0.0052] [--seeds 0,1,2,3,4,5]

TREE is a worktree of the code under test (git worktree add); each field=json is a
SchedulerConfig override of the token contender (chunked_prefill=false). The defaults are
the bursty A/B's run: the bursty trace (Gamma CV 4), TTFT 61.6 ms, TBT 5.2 ms (the 6-seed
run's SLO). Writes OUT.json (attainment per rate and seed) and OUT.json.records.jsonl.gz
(every request, re-scorable).
"""
import argparse, json, time, logging
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
from cluster.planner.metrics import summarize
from cluster.ray_runtime import connect_or_start
from load_tests.contenders import Deployment
from load_tests.experiment import Experiment, TraceSpec
from load_tests.records import write_records
from load_tests.run_setup import engine_config, served_models
from load_tests.sweep import RunSettings
from scheduler.slo import SLO

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("rates")
p.add_argument("contender", nargs="?", default="token")
p.add_argument("overrides", nargs="*", help="field=json SchedulerConfig overrides")
p.add_argument("--trace", choices=("bursty", "poisson"), default="bursty")
p.add_argument("--slo-ttft", type=float, default=0.0616)
p.add_argument("--slo-tbt", type=float, default=0.0052)
p.add_argument("--seeds", default="0,1,2,3,4,5", help="comma-separated trace seeds")
a = p.parse_args()
if "=" in a.contender:   # no contender named: the first override came in its place
    a.overrides, a.contender = [a.contender] + a.overrides, "token"
rates = [float(r) for r in a.rates.split(",")]
overrides = {}
for kv in a.overrides:
    k, v = kv.split("="); overrides[k] = json.loads(v)
trace = TraceSpec("bursty", "gamma", 4.0) if a.trace == "bursty" else TraceSpec("poisson", "poisson")
args = SimpleNamespace(arrival=trace.arrival, cv=4.0, popularity="zipf", zipf_alpha=1.0, lengths="azure",
                       input_scale=0.125, output_scale=0.25, max_input=256, max_output=256,
                       seed=0, kv_mb=64.0, slots=2, budget=None, slo_ttft=None, slo_tbt=None,
                       device="cpu", dtype=None)
slo = SLO(a.slo_ttft, a.slo_tbt)
timeout = max(2.0, 4.0 * (slo.ttft_s + 256 * slo.tbt_s))
connect_or_start(num_virtual_gpus=1, log_to_driver=False)
models = served_models("12", "llama-tiny-a")
settings = RunSettings(max_requests=120, request_timeout_s=timeout, settle_s=0.5, idle_skip_s=0.5)
dep = Deployment(models, 1, engine_config(models, args), 1, slo)
ex = Experiment(dep, args, settings, seeds=tuple(int(x) for x in a.seeds.split(",")), metric="goodput", scheduler=overrides)
res = {}
t0 = time.time()
with ex.session(a.contender) as s:
    for r in rates:
        s.point(trace, r)
for key, recs in ex.records.points.items():
    sm = summarize(recs, slo)
    res.setdefault(str(key.rate), {})[str(key.seed)] = {k: sm[k] for k in sm if k.startswith("attainment")}
json.dump({"rates": res, "elapsed_s": time.time() - t0, "overrides": overrides, "contender": a.contender,
           "trace": a.trace, "slo": [a.slo_ttft, a.slo_tbt]}, open(a.out, "w"), indent=1)
write_records(a.out + ".records.jsonl.gz", ex.records)
for r, seeds in res.items():
    g = [v["attainment_goodput"] for v in seeds.values()]
    print(r, round(sum(g) / len(g), 3), [round(x, 3) for x in g])
