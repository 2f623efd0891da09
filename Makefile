# Everything a fresh clone needs: `make test`, `make serve`, `make demo`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= configs/default.toml

.PHONY: install test test-gpu serve demo bench clean-venv prometheus

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: the local CPU wheel, no CUDA packages downloaded
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The end-to-end metrics test runs a real Prometheus (Debian package prometheus).
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)

test: $(STAMP) prometheus
	$(BIN)/python -m pytest -q

# On a machine with a GPU (torch with CUDA already installed): only the gpu-marked tests.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu

serve: $(STAMP)
	$(BIN)/tiercache serve --config $(CONFIG)

demo: $(STAMP)
	$(BIN)/tiercache demo --config $(CONFIG)

bench: $(STAMP)
	$(BIN)/tiercache bench --backend cpu

clean-venv:
	rm -rf $(VENV)
