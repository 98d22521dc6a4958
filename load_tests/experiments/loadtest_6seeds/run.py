"""The 6-seed runs behind docs/results/loadtest-{bursty,poisson}-6seeds*/: the published preset's
settings (120 requests per point, bisection to 10%, the SLO measured at the start), token and
request only, one trace, seeds 0-5.

    TOKENMUX_DATA_DIR=../shared/data .venv/bin/python load_tests/experiments/loadtest_6seeds/run.py TRACE OUT_DIR

TRACE is bursty (loadtest-bursty-6seeds on 1187f37, loadtest-bursty-6seeds-ee613a6 on ee613a6)
or poisson (loadtest-poisson-6seeds on 1ab98d9). Each folder had its own copy of this script
with the trace fixed; they differed in nothing else.
"""
import argparse

from load_tests.published import Preset, run_published

p = argparse.ArgumentParser()
p.add_argument("trace", choices=("bursty", "poisson"))
p.add_argument("out_dir")
a = p.parse_args()
preset = Preset(contenders=("token", "request"), traces=(a.trace,), seeds=(0, 1, 2, 3, 4, 5),
                models_sweep=False, ablation_traces=())
run_published(a.out_dir, readme=None, preset=preset, sweep_models=False)
