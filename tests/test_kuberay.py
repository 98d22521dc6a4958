"""The KubeRay RayService parses, asks for GPUs, and embeds deploy/serve_app/serve_config_gpu.yaml's app."""
from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "serve_app"


def _rayservice() -> dict:
    return yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())


def test_rayservice_embeds_the_gpu_serve_config_application():
    service = _rayservice()
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    gpu = yaml.safe_load((DEPLOY / "serve_config_gpu.yaml").read_text())
    assert embedded["applications"] == gpu["applications"]   # same import_path, args, runtime_env
    assert embedded["http_options"] == gpu["http_options"]
    app = embedded["applications"][0]
    assert app["import_path"] == "deploy.serve_app.app:build_app"


def test_the_embedded_args_are_valid_app_args():
    from deploy.serve_app.app_args import parse_app_args

    for config in (yaml.safe_load(_rayservice()["spec"]["serveConfigV2"]),
                   yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())):
        args = parse_app_args(config["applications"][0]["args"])
        assert args.models and args.max_ongoing_requests > 5   # Serve's default 5 would throttle


def test_rayservice_has_a_head_and_a_gpu_worker_group_mounting_the_models():
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"].startswith("2.")
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"   # no DeviceWorker on the head
    (group,) = cluster["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    args = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])["applications"][0]["args"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert all(any(path.startswith(m + "/") for m in mounts) for path in args["models"].values())
    assert "/dev/shm" in mounts


def _serve_configs() -> list[dict]:
    return [yaml.safe_load(_rayservice()["spec"]["serveConfigV2"]),
            yaml.safe_load((DEPLOY / "serve_config_gpu.yaml").read_text()),
            yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())]


def test_no_config_exposes_http_beyond_loopback_without_requiring_a_key():
    for config in _serve_configs():
        host = config["http_options"]["host"]
        args = config["applications"][0]["args"]
        assert host in ("127.0.0.1", "localhost", "::1") or args.get("require_api_key") is True, config


def test_the_rayservice_protects_the_dashboard_and_hands_every_container_the_api_keys():
    service = _rayservice()["spec"]["rayClusterConfig"]
    assert service["authOptions"]["mode"] == "token"   # dashboard, GCS and raylets need Ray's token
    groups = [service["headGroupSpec"], *service["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env["TOKENMUX_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "tokenmux-api-keys"


def test_require_api_key_without_one_refuses_to_start(monkeypatch):
    import pytest

    from deploy.openai_api.auth import ENV_VAR
    from deploy.serve_app.app import api_keys
    from deploy.serve_app.app_args import parse_app_args

    args = parse_app_args(_serve_configs()[1]["applications"][0]["args"])
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match=ENV_VAR):
        api_keys(args)
    monkeypatch.setenv(ENV_VAR, "k1,k2")
    assert len(api_keys(args)) == 2
