"""The run behind this folder: the published preset's settings (120 requests per point,
bisection to 10%, the SLO measured at the start), token and request only, the Poisson trace,
seeds 0-5.

    TOKENMUX_DATA_DIR=../shared/data .venv/bin/python docs/results/loadtest-poisson-6seeds/run.py OUT_DIR
"""
import sys

from load_tests.published import Preset, run_published

preset = Preset(contenders=("token", "request"), traces=("poisson",), seeds=(0, 1, 2, 3, 4, 5),
                models_sweep=False, ablation_traces=())
run_published(sys.argv[1], readme=None, preset=preset, sweep_models=False)
