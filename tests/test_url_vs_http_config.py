"""The serve config printed for `tokenmux serve` is the app `tokenmux loadtest --via http` brings up.

Issue 42 compares `loadtest --url` against a running `tokenmux serve` with `--via http`; the
comparison is only fair if the server runs the same app args. No Ray: the config is parsed by
the same AppArgs `tokenmux serve --config` uses and compared with ServeContender.app_args.
"""
from __future__ import annotations

import os

import pytest
import yaml

from deploy.cli.commands import load_config_args
from deploy.local import _parse_args
from load_tests.contenders import Deployment, ServeContender
from load_tests.experiments.url_vs_http.serve_config import main
from load_tests.run_setup import engine_config, served_models
from scheduler.slo import SLO

FLAGS = ["--workers", "1", "--models", "3", "--checkpoint", "llama-tiny-a", "--slots", "2",
         "--slo-ttft", "0.7", "--slo-tbt", "0.05"]


def test_config_is_the_via_http_app(tmp_path, capsys):
    main([*FLAGS, "--policy", "token", "--port", "8123"])
    path = tmp_path / "serve.yaml"
    path.write_text(capsys.readouterr().out)
    raw = load_config_args(str(path))
    assert yaml.safe_load(path.read_text())["http_options"] == {"host": "127.0.0.1", "port": 8123}

    class Args:   # the loadtest flags engine_config reads
        kv_mb, budget, slots = 64.0, None, 2
    models = served_models("3", "llama-tiny-a")
    deployment = Deployment(models, 1, engine_config(models, Args), max(1, (os.cpu_count() or 1)),
                            SLO(0.7, 0.05))
    assert raw == {"models": models, **ServeContender("token").app_args(deployment)}
    args = _parse_args(raw)   # what `tokenmux serve --config` deploys
    assert args.policy == "token" and args.num_slots == 2 and args.slo.ttft_s == 0.7


def test_slo_must_be_given(capsys):
    with pytest.raises(ValueError, match="--slo-ttft"):
        main(FLAGS[:-4])


def test_served_models_order_the_app(tmp_path, capsys):
    main([*FLAGS, "--served-models", "llama-tiny-a-02,llama-tiny-a-00,llama-tiny-a-01"])
    path = tmp_path / "serve.yaml"
    path.write_text(capsys.readouterr().out)
    assert list(load_config_args(str(path))["models"]) == ["llama-tiny-a-02", "llama-tiny-a-00", "llama-tiny-a-01"]
    with pytest.raises(ValueError, match="--served-models"):
        main([*FLAGS, "--served-models", "llama-tiny-a-00,other"])
