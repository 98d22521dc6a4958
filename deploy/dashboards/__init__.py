"""Grafana dashboards as code: panels declared in `panels.py`, built with Grafana's
foundation SDK into `deploy/dashboards/*.json` (`generate.py`, `tokenmux dashboard build`),
provisioned into a Grafana with grafana-client (`push.py`, `tokenmux dashboard push`).
Every panel's PromQL runs against a real Prometheus in tests/test_observability.py."""
