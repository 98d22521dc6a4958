# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv bench clean prometheus

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall only when pyproject.toml changes; torch is pinned so pip takes the local CPU wheel.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/tokenmux demo

# The observability tests scrape a real Prometheus (Debian package `prometheus`). Installed here
# when missing and we are root with apt; otherwise those tests skip and say how to install it.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -q prometheus >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null; }) \
	      && echo "installed prometheus (Debian package)" || echo "could not install prometheus; its tests will skip"; \
	  else \
	    echo "prometheus is missing: install Debian's package (sudo apt-get install prometheus) or put a Prometheus 2.x binary on PATH; its tests will skip"; \
	  fi; }

test: $(STAMP) prometheus
	$(BIN)/python -m pytest -q --durations=25

bench: $(STAMP)
	$(BIN)/tokenmux bench engine --json bench-engine.json

clean:
	rm -rf $(VENV) build *.egg-info
